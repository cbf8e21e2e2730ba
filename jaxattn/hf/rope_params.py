"""RoPE settings between a Hugging Face config.json and jaxattn's `rope_theta` and `RopeScaling`.

transformers 5 writes `rope_parameters` (`rope_type`, `rope_theta` and the
scaling keys in one dict); older checkpoints write `rope_theta` beside
`rope_scaling` (with `type` or `rope_type`). Both are read, with transformers'
precedence (`rope_scaling` over `rope_parameters`; a top-level
`original_max_position_embeddings` over the dict's). Only the exported form
is written: `rope_parameters`.

YaRN's attention factor is computed here as transformers computes it and
stored explicitly (`RopeScaling.attention_factor`): transformers derives it
from which keys are *present* (`mscale` and `mscale_all_dim` both non-zero, or
neither), which jaxattn's defaults cannot express.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from jaxattn.hf.errors import UnsupportedCheckpoint
from jaxattn.hf.fields import Fields
from jaxattn.rope import RopeScaling, rope_attention_factor

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_dict(hf: Fields) -> Fields:
    """The flat RoPE parameters of a config.json: `rope_scaling`, else `rope_parameters`, else empty."""
    params = hf.section("rope_scaling") or hf.section("rope_parameters") or Fields({}, hf.path, "rope_parameters.")
    nested = sorted(k for k, v in params.items() if isinstance(v, Mapping))
    if nested:
        raise UnsupportedCheckpoint(f"rope_parameters per layer type {nested} are not supported "
                                    "(jaxattn uses one RoPE for every layer)")
    return params


def rope_type(params: Fields) -> str:
    return params.text("rope_type", params.text("type", "default"))


def _get_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _original_max_position(hf: Fields, params: Fields) -> int:
    top = hf.integer("original_max_position_embeddings", None)  # transformers gives the top-level value priority
    return top or params.integer("original_max_position_embeddings", None) or hf.integer("max_position_embeddings")


def _yarn(hf: Fields, params: Fields) -> RopeScaling:
    original = _original_max_position(hf, params)
    factor = params.number("factor", None) or hf.integer("max_position_embeddings") / original
    # transformers reads these with `or`: 0 means the default, and a present mscale counts even when 0
    mscale = params.number("mscale", None, positive=False)
    mscale_all_dim = params.number("mscale_all_dim", None, positive=False)
    attention_factor = params.number("attention_factor", None)
    if attention_factor is None:  # transformers' _compute_yarn_parameters, key presence included
        attention_factor = (_get_mscale(factor, mscale) / _get_mscale(factor, mscale_all_dim)
                            if mscale and mscale_all_dim else _get_mscale(factor))
    return RopeScaling("yarn", float(factor), original_max_position=original,
                       beta_fast=params.number("beta_fast", None, positive=False) or 32.0,
                       beta_slow=params.number("beta_slow", None, positive=False) or 1.0,
                       mscale=1.0 if mscale is None else mscale, mscale_all_dim=mscale_all_dim or 0.0,
                       attention_factor=float(attention_factor), truncate=params.flag("truncate", True))


def read_rope(hf: Fields, *, default_theta: float = 10000.0,
              default_partial: float = 1.0) -> tuple[float, RopeScaling | None]:
    """`(rope_theta, rope_scaling)` of a config.json; UnsupportedCheckpoint for partial rotary or other types."""
    params = rope_dict(hf)
    theta = params.number("rope_theta", None) or hf.number("rope_theta", None) or default_theta
    partial = params.number("partial_rotary_factor", hf.number("partial_rotary_factor", default_partial, null=None),
                            null=None)
    if partial is not None and partial != 1.0:  # None: transformers rotates the whole head
        raise UnsupportedCheckpoint(f"partial_rotary_factor={partial}: jaxattn rotates whole heads (1.0) only")
    kind = rope_type(params)
    if kind not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedCheckpoint(f"rope_type={kind!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
    if kind == "default":
        return theta, None
    if kind == "linear":
        return theta, RopeScaling("linear", params.number("factor"))
    if kind == "llama3":
        return theta, RopeScaling("llama3", params.number("factor"),
                                  original_max_position=_original_max_position(hf, params),
                                  low_freq_factor=params.number("low_freq_factor"),
                                  high_freq_factor=params.number("high_freq_factor"))
    return theta, _yarn(hf, params)


def write_rope(theta: float, scaling: RopeScaling | None) -> dict[str, Any]:
    """The `rope_parameters` dict transformers 5 reads back as the same frequencies and factor."""
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": float(theta)}
    if scaling is None:
        return params
    if scaling.kind == "ntk":
        raise UnsupportedCheckpoint("rope_scaling kind 'ntk' (static NTK-aware) has no transformers "
                                    "counterpart (its 'dynamic' rescales with the sequence length)")
    params.update(rope_type=scaling.kind, factor=float(scaling.factor))
    if scaling.kind == "llama3":
        params.update(original_max_position_embeddings=scaling.original_max_position,
                      low_freq_factor=scaling.low_freq_factor, high_freq_factor=scaling.high_freq_factor)
    elif scaling.kind == "yarn":
        params.update(original_max_position_embeddings=scaling.original_max_position,
                      beta_fast=scaling.beta_fast, beta_slow=scaling.beta_slow, mscale=scaling.mscale,
                      mscale_all_dim=scaling.mscale_all_dim, truncate=scaling.truncate,
                      attention_factor=float(rope_attention_factor(scaling)))
    return params
