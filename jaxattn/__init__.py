"""jaxattn: attention mechanisms in JAX/Flax, from the formula to a tiny LM.

The functional core (pure, jit-able):

* `scaled_dot_product_attention`, `reference_attention`, `repeat_kv`
* masks: `causal_mask`, `padding_mask`, `sliding_window_mask`,
  `combine_masks`, `mask_to_bias`
* positions: `rope_frequencies`, `apply_rope`, `RopeScaling`,
  `rope_attention_factor`, `sinusoidal_positions`
* `additive_attention`
"""

from jaxattn.additive import additive_attention
from jaxattn.attention import reference_attention, repeat_kv, scaled_dot_product_attention
from jaxattn.masks import (
    causal_mask,
    combine_masks,
    mask_to_bias,
    padding_mask,
    sliding_window_mask,
)
from jaxattn.positions import sinusoidal_positions
from jaxattn.rope import RopeScaling, apply_rope, rope_attention_factor, rope_frequencies

__all__ = [
    "RopeScaling",
    "additive_attention",
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
