"""Models for the programs to run, from wherever they come, through one loader.

* `load`: `load_model(source) -> LoadedModel`, the one loader every program calls (sample, serve,
  export, attention_maps), with a PEFT adapter merged in, q/k/v fused, layers relaid, weights quantized;
* `source`: the model-source flags (`--checkpoint`, `--hf`, `--gguf`, `--random-init` and their
  options) defined once (`SourceFlags`), read back as a `ModelSource`;
* `runs`: a training run's checkpoints (a LoRA run's adapters merged into their base);
* `pretrained`: transformers directories and GGUF files, with their tokenizers and chat templates
  (also a fine-tuning run's `train.init_from`);
* `fresh`: a config's model with fresh parameters and its tokenizer (`--random-init`);
* `nonfinite`: where a model whose weights hold NaN or infinity goes wrong, in words.
"""
