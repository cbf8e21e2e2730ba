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
from jaxattn.rope import RopeScaling, rope_attention_factor

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_dict(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The flat RoPE parameter dict of a config.json (a copy; {} without one)."""
    params = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    nested = sorted(k for k, v in params.items() if isinstance(v, Mapping))
    if nested:
        raise UnsupportedCheckpoint(f"rope_parameters per layer type {nested} are not supported "
                                    "(jaxattn uses one RoPE for every layer)")
    return params


def rope_type(params: Mapping[str, Any]) -> str:
    return params.get("rope_type", params.get("type", "default"))


def _get_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _original_max_position(hf: Mapping[str, Any], params: Mapping[str, Any]) -> int:
    if "original_max_position_embeddings" in hf:  # transformers gives the top-level value priority
        return int(hf["original_max_position_embeddings"])
    return int(params.get("original_max_position_embeddings") or hf["max_position_embeddings"])


def _yarn(hf: Mapping[str, Any], params: Mapping[str, Any]) -> RopeScaling:
    original = _original_max_position(hf, params)
    factor = params.get("factor") or hf["max_position_embeddings"] / original
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    attention_factor = params.get("attention_factor")
    if attention_factor is None:  # transformers' _compute_yarn_parameters, key presence included
        attention_factor = (_get_mscale(factor, mscale) / _get_mscale(factor, mscale_all_dim)
                            if mscale and mscale_all_dim else _get_mscale(factor))
    return RopeScaling("yarn", float(factor), original_max_position=original,
                       beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
                       mscale=float(1.0 if mscale is None else mscale), mscale_all_dim=float(mscale_all_dim or 0.0),
                       attention_factor=float(attention_factor), truncate=bool(params.get("truncate", True)))


def read_rope(hf: Mapping[str, Any], *, default_theta: float = 10000.0,
              default_partial: float = 1.0) -> tuple[float, RopeScaling | None]:
    """`(rope_theta, rope_scaling)` of a config.json; UnsupportedCheckpoint for partial rotary or other types."""
    params = rope_dict(hf)
    theta = float(params.get("rope_theta") or hf.get("rope_theta") or default_theta)
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", default_partial))
    if partial is not None and partial != 1.0:  # None: transformers rotates the whole head
        raise UnsupportedCheckpoint(f"partial_rotary_factor={partial}: jaxattn rotates whole heads (1.0) only")
    kind = rope_type(params)
    if kind not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedCheckpoint(f"rope_type={kind!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
    if kind == "default":
        return theta, None
    if kind == "linear":
        return theta, RopeScaling("linear", float(params["factor"]))
    if kind == "llama3":
        return theta, RopeScaling("llama3", float(params["factor"]),
                                  original_max_position=_original_max_position(hf, params),
                                  low_freq_factor=float(params["low_freq_factor"]),
                                  high_freq_factor=float(params["high_freq_factor"]))
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
