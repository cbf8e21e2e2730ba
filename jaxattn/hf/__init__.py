"""Hugging Face checkpoints in and out of jaxattn, without torch or transformers.

```python
from jaxattn import hf
config, params = hf.load_pretrained(path, dtype="float32")   # a local checkpoint directory
logits = jaxattn.DecoderLM(config).apply({"params": params}, tokens)
report = hf.save_pretrained(out_dir, config, params, tokenizer=None)  # AutoModelForCausalLM loads it
tok = hf.load_tokenizer(path)                                 # encode, decode, eos_token_id, vocab_size
```

Supported, both ways (load and export), with the transformers 5.23 classes
(one record per family in `jaxattn.hf.families`; `jaxattn.hf.family` describes it):

| family | transformers class | jaxattn features |
| --- | --- | --- |
| GPT-2 | `GPT2LMHeadModel` | learned positions, LayerNorm, GELU MLP, biases, fused QKV |
| Llama 1/2/3, SmolLM | `LlamaForCausalLM` | RoPE (default, linear, llama3, yarn), RMSNorm, gated MLP, GQA/MQA |
| Mistral | `MistralForCausalLM` | Llama + one `sliding_window` for every layer |
| Qwen2 / Qwen2.5 | `Qwen2ForCausalLM` | Llama + q/k/v biases, sliding windows on the layers `layer_types` names |
| Qwen3 | `Qwen3ForCausalLM` | Qwen2's windows + per-head q/k RMSNorm (`qk_norm="head"`) |
| DeepSeek-V2 | `DeepseekV2ForCausalLM` | MLA (with or without `q_lora_rank`), YaRN with mscale; routed experts (greedy or group-limited softmax router, scaling factor) and shared experts, dense first layers |
| DeepSeek-V3 | `DeepseekV3ForCausalLM` | the same, RoPE interleaved or half-split; sigmoid router with the correction bias, group-limited, normalised |
| Qwen2-MoE | `Qwen2MoeForCausalLM` | Qwen2 + routed experts, a sigmoid-gated shared expert, `mlp_only_layers` / `decoder_sparse_step` |
| Qwen3-MoE | `Qwen3MoeForCausalLM` | Qwen3 + routed experts (normalised or not), dense layers as Qwen2-MoE |
| Mixtral | `MixtralForCausalLM` | Mistral + routed experts in every layer, renormalised top-k |
| GPT-OSS | `GptOssForCausalLM` | attention sinks, q/k/v/o biases, alternating sliding/full layers, YaRN; biased router, softmax over the top k, clamped SwiGLU experts with biases; MXFP4 experts read (dequantized) |
| GPT-NeoX, Pythia | `GPTNeoXForCausalLM` | RoPE on `rotary_pct` of a head, LayerNorm, GELU MLP, parallel residual |
| Gemma 2 | `Gemma2ForCausalLM` | sandwich (1 + w) RMSNorms, sqrt(D) embeddings, soft-caps, local/global layers (*) |
| Gemma 3 (text) | `Gemma3ForCausalLM` | Gemma 2 + per-head q/k norm, 5 local layers per global, a RoPE per kind (*) |
| Phi-3 | `Phi3ForCausalLM` | fused `qkv_proj` and `gate_up_proj`, partial rotary, `sliding_window` |
| OLMo 2 | `Olmo2ForCausalLM` | norms after attention and MLP only (post-norm), full-width q/k RMSNorm |
| SmolLM3 | `SmolLM3ForCausalLM` | NoPE layers (`no_rope_layers`), sliding windows per `layer_types` |

(*) Gemma: a softmax scale `query_pre_attn_scalar ** -0.5`, a gated tanh-GELU MLP, the final-logit
soft-cap; Gemma 2 also caps attention logits (Gemma 3's transformers class ignores that key).

Mixture-of-experts layers load as `ModelConfig.moe` (`jaxattn.MoEConfig`) and
`dense_layers`, from the hub's per-expert tensors or transformers' fused ones;
export writes the per-expert layout (GPT-OSS: its fused one). Not supported
(`UnsupportedCheckpoint`): routers transformers does not compute (e.g. DeepSeek-V2's
`topk_method="noaux_tc"`), experts in a family without them (the message names
"mixture-of-experts" and the key), dynamic or longrope RoPE, a partial rotary fraction of an odd number of dims
(or in a family that rotates whole heads), GPT-2's per-layer attention scaling,
bidirectional Gemma, quantized checkpoints (`quantization_config`, FP8 and
smaller float tensors; GPT-OSS's MXFP4 experts aside), and every other architecture.

Errors: every failure to read a checkpoint is an `HFCheckpointError` (a
ValueError): `UnsupportedCheckpoint` for what jaxattn does not implement,
`InvalidCheckpoint` (attributes `path`, `key`) for a file that is missing,
unreadable or damaged, its message naming the file and the config key or
tensor.

Contracts:

* `load_pretrained(path, dtype, *, allow_nonfinite=False)` reads `config.json`
  and `model.safetensors` (or, without it, the shards of
  `model.safetensors.index.json`: transformers' order) from a local directory;
  `dtype` ("float32" or "bfloat16") becomes the config's `dtype` and
  `param_dtype` and the parameters' dtype, whatever the checkpoint stores.
  Everything is validated before any tensor data is read: config.json's keys
  (required ones present, each of its JSON type, sizes positive), every
  safetensors header against its file's size (offsets inside the file, not
  overlapping, each `prod(shape) * itemsize` bytes), the index's shards, and
  the dtypes (F32, F16, BF16, F64 hold weights; integers and bool do not).
  An unsupported architecture or feature raises `UnsupportedCheckpoint`
  naming it; anything else `InvalidCheckpoint`, e.g. a missing, unexpected
  or wrongly shaped tensor naming the tensor, the expected shape and the one
  found. Each tensor is checked as it is read: NaN or infinite values (after
  conversion to `dtype`) raise `InvalidCheckpoint` with their count, unless
  `allow_nonfinite=True` (the rare checkpoint that stores -inf masks or
  overflowed values on purpose). Buffers that are not parameters (GPT-2 and
  GPT-NeoX attention masks, `rotary_emb.inv_freq`) are ignored, unchecked.
* `load_state_dict(hf_config, tensors, dtype, *, allow_nonfinite=False)` is
  `load_pretrained` without the files: a config.json dict and the tensors by
  transformers name (a `{name: array}` dict, or a source that makes each
  array on request, as `jaxattn.gguf` dequantizes), with the same checks.
* `save_pretrained(path, config, params, tokenizer=None, *, overwrite=False,
  eos_token_id=None) -> SaveReport` writes `config.json`, `model.safetensors`,
  `generation_config.json` (the end-of-sequence id, when known) and, given a
  `tokenizers.Tokenizer`, `tokenizer.json` + `tokenizer_config.json`. A
  config with no transformers counterpart raises `UnsupportedCheckpoint`
  naming the field that prevents it (see `jaxattn.hf.export` for the choice
  of architecture). A non-empty directory is refused (FileExistsError) unless
  `overwrite=True`, which replaces exactly those files, plus an older
  `model.safetensors.index.json` and the shards it lists; every other file
  (an adapter, a README) stays as it was. Files are written under temporary
  names and renamed into place once all are written, so a failed save leaves
  the older checkpoint as it was. The `SaveReport` lists `written` and
  `replaced` files and the `architecture`.
* `jaxattn.hf.peft`: `save_adapter` / `load_adapter` write and read PEFT's LoRA adapter files
  (`adapter_config.json`, `adapter_model.safetensors`) for `jaxattn.lora` adapters, mapped through
  the same layouts; see that module for what is refused.
* `load_tokenizer(path)` wraps the directory's tokenizer.json (see `jaxattn.hf.tokenizer`);
  failures are `InvalidCheckpoint`.

The modules, one job each: `jaxattn.hf.checkpoint` (loading) and `jaxattn.hf.save` (writing);
`jaxattn.hf.architectures` (config.json -> `ModelConfig`) and `jaxattn.hf.export` (`ModelConfig` ->
architecture and config.json), with `jaxattn.hf.rope_params` (the RoPE settings); `jaxattn.hf.family`
and `jaxattn.hf.families` (one record per family); `jaxattn.hf.weights` and `jaxattn.hf.layouts`
(which tensors hold which parameter), `jaxattn.hf.mxfp4` (GPT-OSS's MXFP4 experts to floats);
`jaxattn.hf.fields` (typed reads of the JSON files), `jaxattn.hf.safetensors_io` (safetensors without
torch); `jaxattn.hf.tokenizer` and `jaxattn.hf.chat_template` (the tokenizer and the chat template; `jaxattn.hf.render_bounds` the bounds
on a server's renders);
`jaxattn.hf.errors` (the errors); `jaxattn.hf.peft` and `jaxattn.hf.peft_modules` (PEFT's adapter
files, and which Hugging Face module holds which part of a weight).
"""

from jaxattn.hf.architectures import ARCHITECTURES
from jaxattn.hf.checkpoint import load_pretrained, load_state_dict
from jaxattn.hf.errors import HFCheckpointError, InvalidCheckpoint, UnsupportedCheckpoint
from jaxattn.hf.save import SaveReport, save_pretrained
from jaxattn.hf.tokenizer import HFTokenizer, load_tokenizer
from jaxattn.hf import peft  # PEFT's LoRA adapter files (`peft.save_adapter`, `peft.load_adapter`)

__all__ = ["ARCHITECTURES", "HFCheckpointError", "HFTokenizer", "InvalidCheckpoint", "SaveReport",
           "UnsupportedCheckpoint", "load_pretrained", "load_state_dict", "load_tokenizer", "peft", "save_pretrained"]
