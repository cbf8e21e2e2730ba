"""Gemma 3 text (`Gemma3ForCausalLM`, model_type gemma3_text): see `jaxattn.hf.families.gemma`, plus
per-head q/k RMSNorm (1 + w) and one RoPE per kind of layer.

Five local layers per global one by default (`layer_types`, or the older
`sliding_window_pattern`). `rope_parameters` holds one dict per layer type:
`full_attention` (base `rope_theta`, default 1e6, with the model's scaling) and
`sliding_attention` (base `rope_local_base_freq`, default 1e4, usually
unscaled); they become the model's RoPE and the local layers' `LayerKind`
(docs/theory.md §21). transformers' Gemma 3 ignores `attn_logit_softcapping`,
and so does jaxattn.
"""

from __future__ import annotations

from typing import Any

from jaxattn.config import ModelConfig
from jaxattn.hf.families import common, gemma
from jaxattn.hf.family import Biases, Family, Problem, Switch, layers, rope_spec
from jaxattn.hf.fields import Fields
from jaxattn.hf.rope_params import read_rope_by_layer_type, write_rope
from jaxattn.hf.weights import Entry

ARCH = "Gemma3ForCausalLM"
BIASES = Biases(qkv=Switch("attention_bias"), out=Switch("attention_bias"))
LEGACY = {common.FULL: ("rope_theta", 1e6), common.SLIDING: ("rope_local_base_freq", 1e4)}


def read(hf: Fields) -> dict[str, Any]:
    ropes = read_rope_by_layer_type(hf, LEGACY)
    full, local = ropes[common.FULL], ropes[common.SLIDING]
    head_dim = hf.integer("head_dim", 256)
    for rope in ropes.values():
        common.rope_fields(ARCH, rope, head_dim)  # refuses partial rotary
    own = dict(rope_theta=None if local.theta == full.theta else local.theta,
               rope_scaling=None if local.scaling == full.scaling else local.scaling or "none")
    return dict(gemma.read(hf, ARCH, max_positions=131072, pattern=hf.integer("sliding_window_pattern", 6),
                           final_cap=None,
                           kinds=lambda is_local: own if is_local else {},
                           rope=common.rope_fields(ARCH, full, head_dim)), qk_norm="head")


def write(c: ModelConfig) -> dict[str, Any]:
    local = rope_spec(c, local=True) if any(k == common.SLIDING for k in common.layer_types(c)) else None
    rope = {common.FULL: write_rope(c.rope_theta, c.rope_scaling),
            common.SLIDING: write_rope(local.rope_theta, local.rope_scaling) if local else
            write_rope(c.rope_theta, c.rope_scaling)}
    return dict(gemma.write(c), rope_parameters=rope, attn_logit_softcapping=None)


def refusal(c: ModelConfig) -> list[Problem]:
    return gemma.refusal(c, ARCH, qk_norm="head") + layers(c, ARCH, windows="any", rope="by_window")


def layout(c: ModelConfig) -> list[Entry]:
    return gemma.layout(c, BIASES)


FAMILY = Family("gemma3_text", ARCH, read, write, refusal, layout, BIASES)
