"""The record each Hugging Face family is, and the checks that decide whether a `ModelConfig` exports to it.

A family (`jaxattn.hf.families.<name>`) is one `Family`: how its config.json
becomes `ModelConfig` fields (`read`) and back (`write`), why a config has no
counterpart in it (`refusal`), its tensors (`layout`), and which biases its
transformers class has (`biases`, one rule used by the reader, the writer and
the layout alike). The generic machinery (`jaxattn.hf.architectures`,
`jaxattn.hf.export`, `jaxattn.hf.layouts`) loops over the registry
(`jaxattn.hf.families.FAMILIES`) and never names a family.

`refusal(c)` lists `Problem`s: empty means the family computes exactly what
`c` computes. Most of it is `features(c, architecture, **needs)`: every model
feature in `FEATURES` must have the value a family without it computes unless
the family says otherwise, so a feature added to `FEATURES` is refused by
every family until one implements it. `layers(c, ...)` checks the per-layer
attention (windows and RoPE) the same way. Every other `ModelConfig` field is
in `CONVERTED`: each family writes it, converts it, or it does not change the
function (tests/hf/test_hf_families.py checks that every field is in one of the two).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

from jaxattn.config import AttentionSpec, ModelConfig
from jaxattn.hf.fields import Fields
from jaxattn.hf.weights import Entry

ROTARY_BUFFER = r"rotary_emb\.inv_freq$"  # older checkpoints store RoPE's frequencies: a buffer, not a parameter


@dataclasses.dataclass(frozen=True)
class Problem:
    """Why a config does not export to one family: `ModelConfig.field` is `value`, the family computes `why`.

    `major`: the architecture differs in kind (attention, positions, norm, MLP, block
    layout); export reports the families with the fewest major, then fewest problems.
    """

    field: str
    value: Any
    why: str
    major: bool = False


@dataclasses.dataclass(frozen=True)
class Need:
    """A feature value a family accepts: `test(value, config)`, described as `text` ("learned positions"),
    or, `of_field`, as the field's value ("'swiglu' or 'geglu'")."""

    test: Callable[[Any, ModelConfig], bool]
    text: str
    of_field: bool = False


def one_of(*values) -> Need:
    return Need(lambda v, c: v in values, " or ".join(repr(v) for v in values), of_field=True)


ANY = Need(lambda v, c: True, "anything")
_DEFAULT_SCALE = Need(lambda v, c: v is None or math.isclose(v, c.head_dim ** -0.5, rel_tol=1e-12),
                      "the softmax scale 1/sqrt(head_dim)")

# field: (what a family without the feature computes, whether a mismatch is one of kind).
FEATURES: dict[str, tuple[Any, bool]] = {
    "mla": (None, True),
    "moe": (None, True),
    "positions": ("rope", True),
    "norm": ("rmsnorm", True),
    "mlp": (one_of("swiglu", "geglu"), True),
    "norm_placement": ("pre", True),
    "residual": ("sequential", True),
    "qk_norm": ("none", False),
    "norm_unit_offset": (False, False),
    "embed_multiplier": (1.0, False),
    "attn_logits_soft_cap": (None, False),
    "final_logits_soft_cap": (None, False),
    "attn_scale": (_DEFAULT_SCALE, False),
    "attn_sinks": (False, False),
    "rotary_fraction": (1.0, False),
    "value_embeddings": (0, False),  # modded-nanoGPT's; no transformers family has them
}
# The fields families write, convert (interleaved RoPE by renaming dims, fused q/k/v by splitting)
# or check themselves (sizes, biases, windows by `layers`), and those without effect on the function.
CONVERTED = ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim", "rope_theta",
             "rope_interleaved", "rope_scaling", "norm_eps", "gelu_approximate", "mlp_hidden", "use_bias",
             "qkv_bias", "out_bias", "mlp_bias", "sliding_window", "layer_pattern", "fused_qkv", "max_seq_len",
             "tie_embeddings", "dtype", "param_dtype", "dropout", "init_std", "zero_init_out",
             "dense_layers",  # without moe always empty; a family with moe checks it
             "scan_layers")  # the params' layout, not the function: saving unstacks them (jaxattn.scan_plan)


def describe_need(field: str, need: Any) -> str:
    """How a problem names what a family computes: "field=value", "field='a' or 'b'", or a `Need`'s text."""
    if not isinstance(need, Need):
        return f"{field}={need!r}"
    return f"{field}={need.text}" if need.of_field else need.text


def unmet(c: ModelConfig, architecture: str, wanted: dict[str, Any], value_of: Callable[[str], Any], *,
          prefix: str = "", major: frozenset[str] = frozenset()) -> list[Problem]:
    """A `Problem` (field `prefix + field`) for each field whose value `value_of(field)` fails its need in
    `wanted`: a value (equality) or a `Need` (tested with the value and `c`); `major`: mismatches of kind."""
    problems = []
    for field, need in wanted.items():
        value = value_of(field)
        if not (need.test(value, c) if isinstance(need, Need) else value == need):
            problems.append(Problem(prefix + field, value, f"{architecture} computes {describe_need(field, need)}",
                                    field in major))
    return problems


def features(c: ModelConfig, architecture: str, **needs) -> list[Problem]:
    """Problems of every `FEATURES` field whose value `architecture` does not compute.

    `needs[field]` overrides the plain value: a value (equality), a `Need`, or `ANY`.
    """
    unknown = set(needs) - set(FEATURES)
    if unknown:
        raise AssertionError(f"{architecture}: no such feature {sorted(unknown)}")
    wanted = {field: needs.get(field, plain) for field, (plain, _) in FEATURES.items()}
    return unmet(c, architecture, wanted, lambda field: getattr(c, field),
                 major=frozenset(field for field, (_, major) in FEATURES.items() if major))


def specs(c: ModelConfig) -> list[AttentionSpec]:
    """Every layer's resolved attention."""
    return [c.layer_attention(i) for i in range(c.num_layers)]


def _rope_of(spec: AttentionSpec) -> tuple:
    return spec.rope_theta, spec.rope_scaling, spec.rotary_fraction


def layers(c: ModelConfig, architecture: str, *, windows: str = "none", rope: str = "uniform") -> list[Problem]:
    """Problems of the per-layer attention (`ModelConfig.layer_attention`) `architecture` cannot express.

    windows: "none" (no sliding window), "uniform" (one window, or none, for every
      layer) or "any" (each layer global or local, as config.json's `layer_types`).
    rope: "uniform" (every layer rotated with the model's RoPE: `rope_theta`,
      `rope_scaling`, `rotary_fraction`), "by_window" (the global layers so, the
      local ones all with one RoPE of their own but the same fraction, Gemma 3) or
      "nope" (a layer may go without RoPE, the others with the model's, SmolLM3).
    """
    all_specs, problems = specs(c), []
    found = {spec.window for spec in all_specs}
    if windows == "none" and found != {None}:
        problems.append(Problem("sliding_window", c.sliding_window, f"{architecture} attends to the whole context"))
    if windows == "uniform" and len(found) > 1:
        problems.append(Problem("layer_pattern", c.layer_pattern, f"{architecture} has one window for every layer"))
    if c.positions != "rope":
        return problems
    if rope != "nope" and not all(spec.rope for spec in all_specs):
        problems.append(Problem("layer_pattern", c.layer_pattern, f"{architecture} rotates every layer (no NoPE "
                                "layers)"))
    model = (c.rope_theta, c.rope_scaling, c.rotary_fraction)
    rotated = [spec for spec in all_specs if spec.rope]
    own = [spec for spec in rotated if rope == "by_window" and spec.window is not None]
    if any(_rope_of(spec) != model for spec in rotated if spec not in own):
        which = "global layer" if rope == "by_window" else "rotated layer"
        problems.append(Problem("layer_pattern", c.layer_pattern, f"{architecture} rotates every {which} with the "
                                "model's rope_theta, rope_scaling and rotary_fraction"))
    if len({_rope_of(spec) for spec in own}) > 1 or any(spec.rotary_fraction != c.rotary_fraction for spec in own):
        problems.append(Problem("layer_pattern", c.layer_pattern, f"{architecture} rotates every local layer alike "
                                "(one rope_theta and rope_scaling, the model's rotary_fraction)"))
    return problems


def rope_spec(c: ModelConfig, local: bool | None = None) -> AttentionSpec:
    """The spec of the first rotated layer (of the local or global ones when `local` is given): its RoPE."""
    candidates = [s for s in specs(c) if s.rope and (local is None or (s.window is not None) == local)]
    return candidates[0] if candidates else c.layer_attention(0)


@dataclasses.dataclass(frozen=True)
class Switch:
    """A bias group present exactly when config.json's boolean `key` says so (`default` when absent)."""

    key: str
    default: bool = False


@dataclasses.dataclass(frozen=True)
class Biases:
    """Which biases a transformers architecture has, decided once for loading, exporting and the layout.

    Each group (`qkv`: query/key/value or MLA's down-projections; `out`: attention
    output; `mlp`; `norm`: LayerNorm) is True (always there: a config without it
    exports zeros), False (never: a config with it has no counterpart) or a
    `Switch` (config.json's key says; groups sharing a key share its value).
    """

    qkv: bool | Switch = False
    out: bool | Switch = False
    mlp: bool | Switch = False
    norm: bool | Switch = False

    GROUPS = ("qkv", "out", "mlp", "norm")

    def read(self, hf: Fields) -> dict[str, bool]:
        """The ModelConfig bias fields of a config.json (`use_bias` is the LayerNorm's)."""
        value = {g: rule if isinstance(rule, bool) else hf.flag(rule.key, rule.default)
                 for g in self.GROUPS for rule in (getattr(self, g),)}
        return dict(use_bias=value["norm"], qkv_bias=value["qkv"], out_bias=value["out"], mlp_bias=value["mlp"])

    def _has(self, c: ModelConfig, group: str) -> bool:
        return c.use_bias if group == "norm" else getattr(c, f"{group}_bias")

    def write(self, c: ModelConfig) -> dict[str, bool]:
        """config.json's switches: on when any group they cover has its bias in `c`."""
        keys: dict[str, bool] = {}
        for group in self.GROUPS:
            rule = getattr(self, group)
            if isinstance(rule, Switch):
                keys[rule.key] = keys.get(rule.key, False) or self._has(c, group)
        return keys

    def flags(self, c: ModelConfig) -> dict[str, bool]:
        """Which groups' biases the checkpoint of `c` holds (the layout's)."""
        written = self.write(c)
        return {g: rule if isinstance(rule, bool) else written[rule.key]
                for g in self.GROUPS for rule in (getattr(self, g),)}

    def problems(self, c: ModelConfig, architecture: str) -> list[Problem]:
        """A bias `c` has where the architecture has none (RMSNorm has no bias whatever `use_bias` says)."""
        return [Problem(f"{g}_bias", True, f"{architecture} has no {g} bias") for g in ("qkv", "out", "mlp")
                if getattr(self, g) is False and getattr(c, f"{g}_bias")] + \
            ([Problem("use_bias", True, f"{architecture} has no LayerNorm bias")]
             if self.norm is False and c.norm == "layernorm" and c.use_bias else [])


@dataclasses.dataclass(frozen=True)
class Family:
    """One Hugging Face model family, both ways.

    Attributes:
      model_type: config.json's `model_type`, the registry key.
      architecture: the transformers class read and written, e.g. "LlamaForCausalLM".
      read: config.json (as `Fields`) -> ModelConfig fields, biases and dtypes aside;
        UnsupportedCheckpoint naming the key for what jaxattn would compute otherwise.
      write: ModelConfig -> this family's config.json keys (the shared ones, biases
        and token ids are added by `jaxattn.hf.export`).
      refusal: ModelConfig -> the `Problem`s that keep it from exporting here ([]: it exports).
      layout: ModelConfig -> every tensor, in model order (`jaxattn.hf.weights.Entry`).
      biases: the bias rule of `read`, `write`, `refusal` and `layout`.
      prefix: the base model's name prefix (hub files saved from the base model lack it).
      ignore: patterns of stored tensors that are buffers, not parameters.
      aliases: legacy tensor name -> current name.
      fused_qkv: the checkpoint stores q, k and v as one projection (export fuses them).
      experts: config.json -> (its experts key, the number of experts, the layers that
        hold mixture-of-experts MLPs), for a family whose checkpoints may keep some
        layers dense (DeepSeek); None: any of `jaxattn.hf.architectures.MOE_KEYS` set
        makes every layer mixture-of-experts.
      extra_layers: config.json -> how many stored layers beyond num_hidden_layers are not
        part of the model (DeepSeek-V3's multi-token prediction).
      reads_experts: `read` turns the family's mixture-of-experts layers into `ModelConfig.moe`
        and `dense_layers` (and `layout` holds their tensors); False: they are refused.
      quantized: the `quantization_config.quant_method`s whose checkpoints the family reads
        (its layout holds the packed forms as `Entry.packed` alternatives, e.g. "mxfp4");
        any other quantization_config is refused (`jaxattn.hf.architectures`).
    """

    model_type: str
    architecture: str
    read: Callable[[Fields], dict[str, Any]]
    write: Callable[[ModelConfig], dict[str, Any]]
    refusal: Callable[[ModelConfig], list[Problem]]
    layout: Callable[[ModelConfig], list[Entry]]
    biases: Biases
    prefix: str = "model."
    ignore: tuple[str, ...] = (ROTARY_BUFFER,)
    aliases: tuple[tuple[str, str], ...] = ()
    fused_qkv: bool = False
    experts: Callable[[Fields], tuple[str, int, list[int]]] | None = None
    extra_layers: Callable[[Fields], int] = lambda hf: 0
    reads_experts: bool = False
    quantized: tuple[str, ...] = ()
