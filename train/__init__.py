"""Training programs for jaxattn's tiny character-level LM (Tiny Shakespeare).

Modules:
  data: find, download and split the corpus; deterministic batches.
  tokenizer: character- and byte-level tokenizers, saved with checkpoints.
  config: TrainConfig, ExperimentConfig, configs/*.toml and --set overrides.
  checkpoint: orbax checkpoints (latest and best) and load_for_sampling.
  tiny_lm: the main program, `python -m train.tiny_lm`.
  compare: attention kinds x position schemes side by side.
  attention_maps: heatmaps of a trained model's attention weights.
"""
