"""Hugging Face checkpoints in and out of jaxattn, without torch or transformers.

```python
from jaxattn import hf
config, params = hf.load_pretrained(path, dtype="float32")   # a local checkpoint directory
logits = jaxattn.DecoderLM(config).apply({"params": params}, tokens)
hf.save_pretrained(out_dir, config, params, tokenizer=None)  # AutoModelForCausalLM loads it
tok = hf.load_tokenizer(path)                                 # encode, decode, eos_token_id, vocab_size
```

Supported, both ways (load and export), with the transformers 5.23 classes:

| family | transformers class | jaxattn features |
| --- | --- | --- |
| GPT-2 | `GPT2LMHeadModel` | learned positions, LayerNorm, GELU MLP, biases, fused QKV |
| Llama 1/2/3, SmolLM | `LlamaForCausalLM` | RoPE (default, linear, llama3, yarn), RMSNorm, gated MLP, GQA/MQA |
| Mistral | `MistralForCausalLM` | Llama + `sliding_window` |
| Qwen2 / Qwen2.5 | `Qwen2ForCausalLM` | Llama + q/k/v biases (+ one window for every layer) |
| Qwen3 | `Qwen3ForCausalLM` | Llama + `qk_norm` |
| DeepSeek-V2 | `DeepseekV2ForCausalLM` | MLA (with or without `q_lora_rank`), YaRN with mscale, dense MLPs |
| DeepSeek-V3 | `DeepseekV3ForCausalLM` | the same, RoPE interleaved or half-split |
| GPT-NeoX | `GPTNeoXForCausalLM` | RoPE, LayerNorm, GELU MLP, sequential residual, rotary_pct 1.0 |

Not supported (`UnsupportedCheckpoint`): mixture-of-experts layers, dynamic or
longrope RoPE, partial rotary, per-layer windows, parallel residuals, GPT-2's
per-layer attention scaling, and every other architecture.

Contracts:

* `load_pretrained(path, dtype)` reads `config.json` and `model.safetensors`
  (or the shards of `model.safetensors.index.json`) from a local directory;
  `dtype` ("float32" or "bfloat16") becomes the config's `dtype` and
  `param_dtype` and the parameters' dtype, whatever the checkpoint stores.
  Everything is validated before any tensor data is read: an unsupported
  architecture or feature raises `UnsupportedCheckpoint` naming it; a missing,
  unexpected or wrongly shaped tensor raises a ValueError naming the tensor,
  the expected shape and the one found. Buffers that are not parameters
  (GPT-2 and GPT-NeoX attention masks, `rotary_emb.inv_freq`) are ignored.
* `save_pretrained(path, config, params, tokenizer=None, *, overwrite=False,
  eos_token_id=None)` writes `config.json`, `model.safetensors` and, given a
  `tokenizers.Tokenizer`, `tokenizer.json` (+ a `tokenizer_config.json`). A
  config with no transformers counterpart raises `UnsupportedCheckpoint`
  naming the field that prevents it (see `jaxattn.hf.export` for the choice
  of architecture). A non-empty directory is refused unless `overwrite=True`.
* `load_tokenizer(path)` wraps the directory's tokenizer.json (see `jaxattn.hf.tokenizer`).
"""

from jaxattn.hf.architectures import ARCHITECTURES
from jaxattn.hf.checkpoint import load_pretrained, save_pretrained
from jaxattn.hf.errors import UnsupportedCheckpoint
from jaxattn.hf.tokenizer import HFTokenizer, load_tokenizer

__all__ = ["ARCHITECTURES", "HFTokenizer", "UnsupportedCheckpoint", "load_pretrained", "load_tokenizer",
           "save_pretrained"]
