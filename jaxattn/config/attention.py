"""The configs of a layer's attention, each a frozen dataclass checked when built: Multi-head Latent
Attention's widths (`MLAConfig`), what one layer's attention differs in (`LayerKind`) and the resolved
`AttentionSpec` a layer is built from (`ModelConfig.layer_attention`).

They import nothing of the model, so the attention layers (`jaxattn.layers.gqa`, `jaxattn.layers.mla`) and
the model's config (`jaxattn.config.model`) can all read them.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Mapping

from jaxattn._validate import (require_field_fraction, require_field_positive_int,
                               require_field_positive_number)
from jaxattn.rope import RopeScaling


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """Multi-head Latent Attention's sizes (DeepSeek-V2/V3, docs/theory.md §6).

    Attributes:
      kv_lora_rank: R, the joint key/value latent (what the cache stores per token, with E).
      q_lora_rank: Q, the query compression rank (None = queries projected directly).
      qk_nope_head_dim: P, per-head query/key dims that carry no position.
      qk_rope_head_dim: E, the decoupled rotary dims (one rotary key shared by all heads).
      v_head_dim: per-head value dim.
    """

    kv_lora_rank: int = 64
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32

    def __post_init__(self):
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            require_field_positive_int("MLAConfig", name, getattr(self, name))
        if self.q_lora_rank is not None:
            require_field_positive_int("MLAConfig", "q_lora_rank", self.q_lora_rank)
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"MLAConfig.qk_rope_head_dim must be even (RoPE rotates pairs), "
                             f"got {self.qk_rope_head_dim}")

    def replace(self, **changes) -> "MLAConfig":
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class LayerKind:
    """What may differ between the layers of one model (docs/theory.md §21); None = the model's setting.

    Attributes:
      local: True = a sliding-window layer of `ModelConfig.sliding_window` W (the
        query and the W - 1 tokens before it); False = a global layer.
      rope: False = a layer without positions (NoPE, SmolLM3 and Llama 4 every k-th layer).
      rope_theta: this layer's RoPE base (Gemma 3: 10 000 local, 1 000 000 global).
      rope_scaling: this layer's scaling; "none" = unscaled (Gemma 3's local layers).
      rotary_fraction: the part of each head that is rotated.
    """

    local: bool = False
    rope: bool = True
    rope_theta: float | None = None
    rope_scaling: RopeScaling | Literal["none"] | None = None
    rotary_fraction: float | None = None

    def __post_init__(self):
        for name in ("local", "rope"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"LayerKind.{name} must be true or false, got {getattr(self, name)!r}")
        require_field_positive_number("LayerKind", "rope_theta", self.rope_theta)
        if isinstance(self.rope_scaling, Mapping):
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        if not (self.rope_scaling is None or self.rope_scaling == "none" or isinstance(self.rope_scaling, RopeScaling)):
            raise TypeError(f"LayerKind.rope_scaling must be a jaxattn.RopeScaling, \"none\" or None, "
                            f"got {self.rope_scaling!r}")
        require_field_fraction("LayerKind", "rotary_fraction", self.rotary_fraction, none_ok=True)


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """One layer's attention, resolved from the model's settings and its `LayerKind` (`ModelConfig.layer_attention`).

    Attributes:
      window: W for a sliding-window layer (the query and W - 1 tokens back), None for a global one.
      rope: RoPE is applied (positions == "rope" and the kind's `rope`).
      rope_theta, rope_scaling, rotary_fraction: the RoPE of this layer (meaningless without `rope`;
        rope_scaling is None there).
      logits_soft_cap: c of `c * tanh(logits / c)` on the attention logits, or None.
      sinks: the layer has a learned sink logit per query head.
    """

    window: int | None
    rope: bool
    rope_theta: float
    rope_scaling: RopeScaling | None
    rotary_fraction: float
    logits_soft_cap: float | None
    sinks: bool
