"""A run's checkpoints and where a run starts.

* `store`: the orbax checkpoint store (latest and best), read back newest valid first;
* `meta`: what a checkpoint's meta holds and must match (config, tokenizer, checksums);
* `init_from`: a fine-tuning run's starting checkpoint (`train.init_from = "hf:DIR"` or `"gguf:FILE"`).
"""
