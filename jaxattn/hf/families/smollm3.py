"""SmolLM3 (`SmolLM3ForCausalLM`): Llama whose layers may go without RoPE (NoPE), and optional windows.

`no_rope_layers[i]` is 1 for a rotated layer and 0 for a NoPE one (by default
every `no_rope_layer_interval`-th layer, counting from 1, is NoPE);
`layer_types` marks sliding-window layers (by default, with
`use_sliding_window`, the NoPE ones). Both become a `layer_pattern` of
`LayerKind(rope=..., local=...)` with the shortest period (docs/theory.md §21).
A model without positions (`positions="none"`) is SmolLM3 with every layer NoPE.
"""

from __future__ import annotations

from typing import Any

from jaxattn.config import ModelConfig
from jaxattn.hf.families import common
from jaxattn.hf.family import Biases, Family, Problem, Switch, features, layers, one_of, specs
from jaxattn.hf.fields import Fields
from jaxattn.hf.weights import Entry

ARCH = "SmolLM3ForCausalLM"
BIASES = Biases(qkv=Switch("attention_bias"), out=Switch("attention_bias"), mlp=Switch("mlp_bias"))


def _rotated(hf: Fields) -> list[bool]:
    n = hf.integer("num_hidden_layers")
    interval = hf.integer("no_rope_layer_interval", 4)
    flags = hf.get("no_rope_layers")
    if flags is None:
        return [(i + 1) % interval != 0 for i in range(n)]
    if not isinstance(flags, list) or any(flag not in (0, 1) or isinstance(flag, float) for flag in flags):
        raise hf.invalid("no_rope_layers", f"expected an array of 0 and 1, got {flags!r}"[:120])
    if len(flags) != n:
        raise hf.invalid("no_rope_layers", f"has {len(flags)} entries for num_hidden_layers={n}")
    return [bool(flag) for flag in flags]


def read(hf: Fields) -> dict[str, Any]:
    rotated = _rotated(hf)
    window = hf.integer("sliding_window", None, null=None)
    default = hf.flag("use_sliding_window", False) and window is not None
    kinds = common.read_layer_types(hf, lambda n: [common.SLIDING if default and not rotated[i] else common.FULL
                                                   for i in range(n)], ARCH)
    if window is None and common.SLIDING in kinds:
        common.reject(ARCH, "sliding_window", None, "its sliding_attention layers need a window")
    return dict(common.llama_fields(hf, ARCH, max_positions=32768, kv_heads=4, theta=2e6, tie=True),
                **common.layer_fields([kind == common.SLIDING for kind in kinds], window,
                                      [dict(rope=flag) for flag in rotated]))


def write(c: ModelConfig) -> dict[str, Any]:
    return dict(common.llama_config(c), use_sliding_window=c.sliding_window is not None,
                sliding_window=c.sliding_window, layer_types=common.layer_types(c),
                no_rope_layers=[int(spec.rope) for spec in specs(c)], no_rope_layer_interval=4)


def refusal(c: ModelConfig) -> list[Problem]:
    return features(c, ARCH, positions=one_of("rope", "none")) + layers(c, ARCH, windows="any", rope="nope")


def layout(c: ModelConfig) -> list[Entry]:
    return common.decoder_layout(c, BIASES, common.llama_block, embed="model.embed_tokens.weight", final="model.norm")


FAMILY = Family("smollm3", ARCH, read, write, refusal, layout, BIASES)
