"""RoPE settings between a Hugging Face config.json and jaxattn's `rope_theta` and `RopeScaling`.

transformers 5 writes `rope_parameters` (`rope_type`, `rope_theta` and the
scaling keys in one dict); older checkpoints write `rope_theta` beside
`rope_scaling` (with `type` or `rope_type`). Both are read, with transformers'
precedence (`rope_scaling` over `rope_parameters`; a top-level
`original_max_position_embeddings` over the dict's). Only the exported form
is written: `rope_parameters`. Families with one RoPE per kind of layer
(Gemma 3) nest one such dict per layer type (`read_rope_by_layer_type`).

`partial_rotary_factor` f (in the dict, or top-level in older files) is read as
`Rope.fraction`: transformers rotates the first int(head_dim * f) dims, which
jaxattn computes (`ModelConfig.rotary_fraction`, docs/theory.md §19) when that
count is even; the families that rotate whole heads refuse f != 1.

YaRN's attention factor is computed here as transformers computes it and
stored explicitly (`RopeScaling.attention_factor`): transformers derives it
from which keys are *present* (`mscale` and `mscale_all_dim` both non-zero, or
neither), which jaxattn's defaults cannot express.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from jaxattn.hf.errors import UnsupportedCheckpoint
from jaxattn.hf.fields import Fields
from jaxattn.rope import RopeScaling, rope_attention_factor

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclasses.dataclass(frozen=True)
class Rope:
    """One RoPE as config.json describes it: base, scaling and the rotated fraction of each head."""

    theta: float
    scaling: RopeScaling | None
    fraction: float = 1.0


def _nested(params: Fields) -> list[str]:
    return sorted(k for k, v in params.items() if isinstance(v, Mapping))


def rope_dict(hf: Fields) -> Fields:
    """The flat RoPE parameters of a config.json: `rope_scaling`, else `rope_parameters`, else empty."""
    params = hf.section("rope_scaling") or hf.section("rope_parameters") or Fields({}, hf.path, "rope_parameters.")
    if _nested(params):
        raise UnsupportedCheckpoint(f"{hf.get('model_type')}: rope_parameters per layer type {_nested(params)} "
                                    "are not read for this architecture (it has one RoPE for every layer)")
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


def _scaling(hf: Fields, params: Fields) -> RopeScaling | None:
    kind = rope_type(params)
    if kind not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedCheckpoint(f"rope_type={kind!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
    if kind == "default":
        return None
    if kind == "linear":
        return RopeScaling("linear", params.number("factor"))
    if kind == "llama3":
        return RopeScaling("llama3", params.number("factor"), original_max_position=_original_max_position(hf, params),
                           low_freq_factor=params.number("low_freq_factor"),
                           high_freq_factor=params.number("high_freq_factor"))
    return _yarn(hf, params)


def read_rope(hf: Fields, params: Fields | None = None, *, default_theta: float = 10000.0,
              default_partial: float = 1.0) -> Rope:
    """The `Rope` of a config.json (of `params`, one layer type's dict, when given).

    UnsupportedCheckpoint for a RoPE type jaxattn does not compute (dynamic, longrope).
    """
    params = rope_dict(hf) if params is None else params
    theta = params.number("rope_theta", None) or hf.number("rope_theta", None) or default_theta
    partial = params.number("partial_rotary_factor", hf.number("partial_rotary_factor", default_partial, null=None),
                            null=None)
    return Rope(theta, _scaling(hf, params), 1.0 if partial is None else partial)  # None: the whole head


def read_rope_by_layer_type(hf: Fields, legacy: Mapping[str, tuple[str, float]],
                            scaled: str = "full_attention") -> dict[str, Rope]:
    """`{layer type: Rope}` of a config.json holding one RoPE dict per layer type (Gemma 3).

    `legacy[type] = (top-level key, default)` gives each type's base when its dict
    has none (Gemma 3: `rope_theta` 1e6 for full_attention, `rope_local_base_freq`
    1e4 for sliding_attention); a legacy top-level `rope_scaling` applies to the
    `scaled` type only, as transformers' Gemma3TextConfig reads it.
    """
    params = hf.section("rope_parameters")
    if params is not None and set(params) - set(legacy):
        raise UnsupportedCheckpoint(f"{hf.get('model_type')}: rope_parameters must hold one dict per layer type "
                                    f"{sorted(legacy)}, got keys {sorted(params)}")
    ropes = {}
    for kind, (key, default) in legacy.items():
        inner = ((params.section(kind) if params is not None else None)
                 or Fields({}, hf.path, f"rope_parameters.{kind}."))
        legacy_scaling = hf.section("rope_scaling") if kind == scaled else None
        if legacy_scaling is not None:
            inner = Fields({**inner, **legacy_scaling}, hf.path, inner.prefix)
        theta = inner.number("rope_theta", None) or hf.number(key, default)
        ropes[kind] = Rope(theta, _scaling(hf, inner), inner.number("partial_rotary_factor", 1.0, null=None))
    return ropes


def write_rope(theta: float, scaling: RopeScaling | None, fraction: float | None = None) -> dict[str, Any]:
    """The `rope_parameters` dict transformers 5 reads back as the same frequencies and factor.

    `fraction` (given): written as `partial_rotary_factor`.
    """
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": float(theta)}
    if fraction is not None:
        params["partial_rotary_factor"] = float(fraction)
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
