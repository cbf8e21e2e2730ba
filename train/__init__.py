"""The programs of jaxattn's tiny character-level LM (Tiny Shakespeare) and the modules behind them.

Programs (thin command-line interfaces):
  tiny_lm: train, `python -m train.tiny_lm`.
  sample: generate text from a run's checkpoint, a transformers directory (--hf) or a random init.
  export: write a run (or a GGUF file) as a transformers directory with its tokenizer.
  compare: attention kinds x position schemes side by side.
  attention_maps: heatmaps of a trained model's attention weights (a run or --hf).

Modules:
  config: ExperimentConfig = [model] (the maths) + [train] + [runtime]; TOML files and --set overrides.
  runtime: devices, XLA flags and kernels, resolved once before JAX starts, with reasons.
  data: find, download and split the corpus (a text file or a prepared directory).
  batches: deterministic batches, a pure function of (seed, split, step), read on the host.
  tokenizer: character- and byte-level tokenizers, saved with checkpoints; as `tokenizers` ones.
  optim: nanoGPT's AdamW, schedule and weight-decay mask.
  steps: the jitted programs (init, train steps, evaluation) and data parallelism.
  experiment: a run end to end (run_experiment): corpus, runtime, run directory, then loop and finish.
  loop: a run's steps (Run): metrics, progress bar, evaluations, checkpoints.
  finish: the end of a run: the sample, the loss plot and result.json.
  checkpoint: orbax checkpoints (latest and best) and the one loader for sampling.
  plots: loss curves, the comparison chart, attention maps.
  models: the one loader of a model for every program (load_model) and the model-source flags.
  decode: many samples drawn call by call and window by window, and the memory they take (train.sample).
"""
