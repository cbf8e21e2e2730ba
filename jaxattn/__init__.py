"""jaxattn: attention mechanisms in JAX/Flax, from the formula to a tiny LM.

The functional core (pure, jit-able):

* `scaled_dot_product_attention`, `reference_attention`, `repeat_kv`
* masks: `causal_mask`, `padding_mask`, `sliding_window_mask`,
  `combine_masks`, `mask_to_bias`
* positions: `rope_frequencies`, `apply_rope`, `RopeScaling`,
  `rope_attention_factor`, `sinusoidal_positions`
* `additive_attention`

The Flax modules and the model (built from one `ModelConfig`):

* `Attention` (MHA/MQA/GQA), `MultiHeadLatentAttention`, `MLP`, `RMSNorm`, `LayerNorm`
* `Block`, `DecoderLM`, `count_params`
* caches: `KVCache`, `LatentCache`, `DecodeCache`, `init_cache`, `cache_bytes_per_token`

Decoding: `generate` (prefill + `jax.lax.scan` over one-token steps), and the
pure sampling functions in `jaxattn.sampling` (`sample`, `greedy`, `filter_logits`).
"""

from jaxattn.additive import additive_attention
from jaxattn.attention import reference_attention, repeat_kv, scaled_dot_product_attention
from jaxattn.cache import DecodeCache, KVCache, LatentCache, cache_bytes_per_token, init_cache
from jaxattn.config import ModelConfig
from jaxattn.decoding import GenerateOutput, generate
from jaxattn.layers import (
    MLP,
    Attention,
    LayerNorm,
    RMSNorm,
    fused_to_separate_qkv,
    separate_to_fused_qkv,
)
from jaxattn.masks import (
    causal_mask,
    combine_masks,
    mask_to_bias,
    padding_mask,
    sliding_window_mask,
)
from jaxattn.positions import sinusoidal_positions
from jaxattn.mla import MultiHeadLatentAttention, latent_attention
from jaxattn.model import Block, DecoderLM, count_params
from jaxattn.rope import RopeScaling, apply_rope, rope_attention_factor, rope_frequencies

__all__ = [
    "Attention",
    "Block",
    "DecodeCache",
    "DecoderLM",
    "GenerateOutput",
    "KVCache",
    "LatentCache",
    "LayerNorm",
    "MLP",
    "ModelConfig",
    "MultiHeadLatentAttention",
    "RMSNorm",
    "RopeScaling",
    "additive_attention",
    "cache_bytes_per_token",
    "count_params",
    "fused_to_separate_qkv",
    "generate",
    "init_cache",
    "latent_attention",
    "separate_to_fused_qkv",
    "apply_rope",
    "causal_mask",
    "combine_masks",
    "mask_to_bias",
    "padding_mask",
    "reference_attention",
    "repeat_kv",
    "rope_attention_factor",
    "rope_frequencies",
    "scaled_dot_product_attention",
    "sinusoidal_positions",
    "sliding_window_mask",
]
