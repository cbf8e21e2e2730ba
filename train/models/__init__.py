"""Models for the programs to run, from wherever they come: a run's checkpoints (`runs`), a transformers
directory or a GGUF file (`pretrained`)."""
