"""jaxattn's programs and its training machinery: the library (`jaxattn`) is what they run.

Programs, each `python -m train.NAME` and each thin (flags, one loader, library calls, what it prints):
  tiny_lm: train a config (or fine-tune a checkpoint, whole or with LoRA) into a run directory.
  prepare: tokenize a corpus once into token shards.
  sample: generate text from a run, a transformers directory, a GGUF file or a random config.
  export: write a run as a transformers directory (a LoRA run as a PEFT adapter), or a GGUF file as one.
  serve: the OpenAI-compatible server (`jaxattn.serving.api`) over the continuous-batching engine.
  compare: attention kinds x position schemes trained side by side.
  attention_maps: a model's attention as a PNG or an interactive page.
  distill_draft: a small draft model for speculative decoding, distilled from a target model.

What the programs share:
  cli: how every program ends (one `error:` line and an exit code, never a traceback).
  outputs: every path a program will write, checked before any work starts.
  models: the one loader of a model from any source (`load_model`) and the model-source flags.
  decode: many samples drawn call by call and window by window, and the memory they take.
  kept_programs: compiled programs kept between runs (`--no-program-cache`), and the line saying so.

The training machinery, in rooms:
  config: the experiment's config: [model] (a `jaxattn.config.ModelConfig`), [train], [runtime], [lora].
  data: the corpus, its tokenizer, prepared shards, batches, fine-tuning chats.
  run: a run end to end: runtime, jitted steps, optimizers, the loop, resume, the finish.
  checkpoints: the checkpoint store, its meta, and where a fine-tuning run starts (`init_from`).
  distill: a draft model cut from its target and fitted to the target's next-token distribution.

docs/architecture.md draws the packages and the path of a training step through them.
"""
