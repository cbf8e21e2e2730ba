"""jaxattn: attention mechanisms in JAX/Flax, from the formula to a tiny LM.

The functional core (pure, jit-able; docs/theory.md derives each formula):

* `scaled_dot_product_attention`, `cached_attention` (against a cache), `reference_attention`, `repeat_kv`
  (`jaxattn.attention`; their argument checks: `jaxattn.attention_checks`)
* `masked_softmax` (the one softmax every attention uses)
* masks: `causal_mask`, `padding_mask`, `sliding_window_mask`,
  `combine_masks`, `mask_to_bias`; packed rows: `segment_mask`, `segment_positions`
* positions: `rope_frequencies`, `apply_rope`, `RopeScaling`,
  `rope_attention_factor`, `sinusoidal_positions`
* `additive_attention`

The Flax modules and the model (built from one `ModelConfig`, the maths, and
an optional `Kernels`, which implementations run it):

* `Attention` (MHA/MQA/GQA, `jaxattn.layers.gqa`), `MultiHeadLatentAttention`
  (`MLAConfig`, `jaxattn.layers.mla`), peers over one skeleton (`jaxattn.layers.attention_layer`);
  `MLP`, `RMSNorm`, `LayerNorm` (`jaxattn.layers.primitives`)
* per-layer attention: `LayerKind` (`ModelConfig.layer_pattern`), `AttentionSpec`
* mixture-of-experts MLPs: `MoE`, `MoEConfig` (`ModelConfig.moe`, `dense_layers`; `jaxattn.layers.moe`:
  the router, the router losses; the routed experts' implementations behind `Kernels.moe`)
* `Block` (`jaxattn.layers.block`), `DecoderLM`, `abstract_params`, `count_params`, `active_params`,
  `attention_weights` (`jaxattn.model`; its input checks in `jaxattn.model_checks`)
* caches: `KVCache`, `LatentCache`, `DecodeCache` (each attention kind declares what it keeps per
  token, `jaxattn.cache.containers`), `init_cache`, `cache_bytes_per_token` (`jaxattn.cache.build`: the dense cache
  and the paged pools built from that declaration)

Decoding: `generate` (prefill + `jax.lax.scan` over one-token steps),
`generate_windowed` and `windows` (past the context, all at once or window by
window), and the pure sampling functions in
`jaxattn.sampling`. Speculative decoding: `speculative_generate` (`jaxattn.speculative`: drafts from
prompt lookup or a small model, checked k at a time by the target; docs/speculative.md).

Many requests at once: `jaxattn.serving` (`Engine`, `EngineConfig`, `SamplingParams`): a paged
KV cache, continuous batching, prefix caching and preemption (docs/serving.md).

Weight-only quantization: `quantize` (every `Linear` kernel, a tied head, a mixture's experts and
MLA's `wkv_b` as int8 or int4 in groups of 32 input rows, or int8 per output channel, a
`QuantizedWeight`), `dequantize` (`jaxattn.quantization`); its matmul is `Kernels.quantized`, which
`generate` and the `Engine` given no kernels take on this machine's fast path
(`jaxattn.kernels.default_kernels`).

Implementations: `Kernels`, `resolve_kernels` and the formulations behind
them live in `jaxattn.kernels`, the one seam between maths and machine.

Device meshes: `jaxattn.axes` (the mesh's and the logical axis names, their rules, `MeshShape`,
`make_mesh`) and `jaxattn.sharding` (`param_layout`: where each parameter lives by its logical
axis names); `generate(..., mesh=mesh)` samples on one.

The modules, one job each. The maths: `attention` (its checks `attention_checks`), `softmax`,
`masks`, `rope`, `positions` (sinusoidal), `additive` (Bahdanau). The model: `config` (the configs),
`layers` (the Flax modules), `model` (its checks `model_checks`), `scan_plan` (which layers one scan
runs), `head_loss` (next-token losses without `[M, V]` logits), `layer_losses` (the losses layers
sow). Decoding: `cache`, `decoding`, `windowed` (past the context), `sampling`, `speculative`, `serving`.
Weights: `lora` (LoRA adapters), `quantization`; implementations: `kernels`; meshes: `axes`, `sharding`;
compiled programs kept between runs: `program_cache`, and traced ones beside them: `program_store`.
Checkpoints in and out: `hf` (Hugging Face), `gguf` (llama.cpp's files). `viewer`: the interactive
attention viewer.
"""

from jaxattn.additive import additive_attention
from jaxattn.attention import cached_attention, reference_attention, repeat_kv, scaled_dot_product_attention
from jaxattn.cache.containers import DecodeCache, KVCache, LatentCache
from jaxattn.cache.build import cache_bytes_per_token, init_cache
from jaxattn.config import AttentionSpec, LayerKind, MLAConfig, ModelConfig, MoEConfig
from jaxattn.decoding import GenerateOutput, generate
from jaxattn.speculative import speculative_generate
from jaxattn.windowed import generate_windowed, windows
from jaxattn.kernels import Kernels, Platform, prepare_weights, resolve_kernels
from jaxattn.layers.gqa import Attention
from jaxattn.layers.primitives import (
    MLP,
    LayerNorm,
    RMSNorm,
    fused_to_separate_qkv,
    separate_to_fused_qkv,
    with_fused_qkv,
)
from jaxattn.masks import (
    causal_mask,
    combine_masks,
    mask_to_bias,
    padding_mask,
    segment_mask,
    segment_positions,
    sliding_window_mask,
)
from jaxattn.layers.mla import MultiHeadLatentAttention, latent_attention
from jaxattn.layers.moe import MoE
from jaxattn.layers.block import Block
from jaxattn.model import DecoderLM, abstract_params, active_params, attention_weights, count_params
from jaxattn.positions import sinusoidal_positions
from jaxattn.quantization import QuantizedWeight, dequantize, quantize
from jaxattn.rope import RopeScaling, apply_rope, rope_attention_factor, rope_frequencies
from jaxattn.softmax import masked_softmax

__all__ = [
    "Attention",
    "AttentionSpec",
    "Block",
    "DecodeCache",
    "DecoderLM",
    "GenerateOutput",
    "KVCache",
    "Kernels",
    "LatentCache",
    "LayerKind",
    "LayerNorm",
    "MLAConfig",
    "MLP",
    "ModelConfig",
    "MoE",
    "MoEConfig",
    "MultiHeadLatentAttention",
    "Platform",
    "QuantizedWeight",
    "RMSNorm",
    "RopeScaling",
    "active_params",
    "additive_attention",
    "apply_rope",
    "abstract_params",
    "attention_weights",
    "cache_bytes_per_token",
    "cached_attention",
    "causal_mask",
    "combine_masks",
    "count_params",
    "dequantize",
    "fused_to_separate_qkv",
    "generate",
    "generate_windowed",
    "init_cache",
    "latent_attention",
    "mask_to_bias",
    "masked_softmax",
    "padding_mask",
    "prepare_weights",
    "quantize",
    "reference_attention",
    "repeat_kv",
    "resolve_kernels",
    "rope_attention_factor",
    "rope_frequencies",
    "scaled_dot_product_attention",
    "segment_mask",
    "segment_positions",
    "separate_to_fused_qkv",
    "sinusoidal_positions",
    "sliding_window_mask",
    "speculative_generate",
    "windows",
    "with_fused_qkv",
]
