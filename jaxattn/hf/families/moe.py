"""Mixture-of-experts MLPs in Hugging Face checkpoints: config.json <-> `MoEConfig` and `dense_layers`, and tensors.

Shared by the families with routed experts (DeepSeek-V2/V3, Qwen2/Qwen3-MoE, Mixtral); each
family says which of its layers are mixtures of experts and how its router scores, this module
does the rest:

* reading: `fields(hf, architecture, layers, **moe)` -> `moe` (a `MoEConfig`) and `dense_layers`
  (every layer not in `layers`), or no `moe` when no layer has experts; `layer_list` reads a
  list-of-layers key (Qwen's `mlp_only_layers`); `aux_loss_coef` the training weight.
* refusing: `problems(c, architecture, **needs)`: the `MoEConfig` fields (as `moe.<field>`) the
  architecture does not compute, each against `PLAIN` (a softmax top-K router with nothing else)
  unless the family's `needs` say otherwise (a value, a `Need` or `ANY`).
* writing: `router_config` (top-K, renormalisation, the training loss weight).
* tensors: `router`, `experts`, `shared` entries and `block`, a Llama block whose MLP is the
  family's MoE entries on its MoE layers.

How checkpoints store routed experts: hub checkpoints, and transformers 5.23's `save_pretrained`
(which reverses its conversion mapping when saving), hold one tensor per expert and projection,
`{experts}.{e}.gate_proj.weight [F, D]`, `up_proj [F, D]`, `down_proj [D, F]` (Mixtral: `w1`,
`w3`, `w2`); exporting writes that form. transformers 5's modules hold them fused,
`{fused}.gate_up_proj [E, 2F, D]` (gate rows first) and `{fused}.down_proj [E, D, F]`: a
checkpoint written from the module's own state dict holds those, and loads too.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from jaxattn._validate import is_int
from jaxattn.config import ModelConfig
from jaxattn.hf import weights as w
from jaxattn.hf.families import common
from jaxattn.hf.family import ANY, Need, Problem, unmet
from jaxattn.hf.fields import Fields
from jaxattn.hf.weights import Entry
from jaxattn.config.moe import MoEConfig

# The MoEConfig of a plain top-K softmax router, field by field (fields not here are written, or do not
# change the function: swiglu_* without the clamped activation, the training losses' weights).
PLAIN: dict[str, Any] = dict(scoring="softmax", softmax_after_topk=False, n_group=1, topk_group=1, group_score=ANY,
                             correction_bias=False, norm_topk_prob=False, routed_scaling_factor=1.0,
                             router_bias=False, num_shared_experts=0, shared_expert_hidden=ANY, shared_gate=False,
                             activation="swiglu", expert_bias=False, gate_up_interleaved=False)
PRESENT = Need(lambda v, c: v is not None, "mixture-of-experts MLPs")  # `features(..., moe=PRESENT)`

# ---------------------------------------------------------------- reading config.json


def layer_list(hf: Fields, key: str) -> list[int]:
    """A list of layer indices (absent or null: none); InvalidCheckpoint naming `key` otherwise."""
    value = hf.get(key)
    if value is None:
        return []
    if not isinstance(value, list) or not all(is_int(i, numpy=False) for i in value):
        raise hf.invalid(key, f"expected a list of layer indices, got {value!r}")
    return value


def aux_loss_coef(hf: Fields) -> float:
    """The load-balancing loss weight transformers trains with: `router_aux_loss_coef` when
    `output_router_logits` (else transformers adds no such loss: 0)."""
    if not hf.flag("output_router_logits", False):
        return 0.0
    return hf.number("router_aux_loss_coef", 0.001, positive=False)


def fields(hf: Fields, architecture: str, layers: Sequence[int], **moe) -> dict[str, Any]:
    """`moe` (`MoEConfig(**moe)`) and `dense_layers` (the layers not in `layers`); no `moe` without MoE layers.

    The experts share the dense MLPs' `hidden_act`: anything but SiLU is refused naming the key.
    """
    n = hf.integer("num_hidden_layers")
    layers = sorted(set(layers) & set(range(n)))
    if not layers or not moe.get("num_experts"):
        return dict(moe=None, dense_layers=())
    act = hf.text("hidden_act", "silu")
    if act not in common.SILU:
        common.reject(architecture, "hidden_act", act, "jaxattn's routed experts are SwiGLU (silu)")
    return dict(moe=MoEConfig(**moe), dense_layers=tuple(i for i in range(n) if i not in layers))


def refuse_ignored(hf: Fields, architecture: str, key: str, computed: Any) -> None:
    """UnsupportedCheckpoint when config.json's `key` says other than the `computed` value transformers
    uses whatever the key says (the checkpoint was made for other maths than transformers computes)."""
    value = hf.get(key)
    if value is not None and value != computed:
        common.reject(architecture, key, value, f"transformers' {architecture} ignores it and computes {computed!r}")


# ---------------------------------------------------------------- refusing and writing


def problems(c: ModelConfig, architecture: str, **needs) -> list[Problem]:
    """Problems (fields `moe.<field>`) of the `MoEConfig` fields `architecture` does not compute.

    `needs[field]` overrides `PLAIN[field]`: a value (equality), a `Need` (tested with the value and
    `c`) or `ANY`. Experts other than SwiGLU with a gated SiLU `mlp` are refused too (transformers'
    experts and dense MLPs share `hidden_act`). No problems without `c.moe`.
    """
    if c.moe is None:
        return []
    unknown = set(needs) - set(PLAIN)
    if unknown:
        raise AssertionError(f"{architecture}: no such MoEConfig need {sorted(unknown)}")
    found = unmet(c, architecture, {**PLAIN, **needs}, lambda field: getattr(c.moe, field), prefix="moe.")
    if c.moe.activation == "swiglu" and c.mlp != "swiglu":
        found.append(Problem("mlp", c.mlp, f"{architecture}'s experts share the dense MLPs' activation (SwiGLU "
                             "experts: mlp='swiglu')", major=True))
    return found


def router_config(m: MoEConfig) -> dict[str, Any]:
    """`num_experts_per_tok`, `norm_topk_prob` and the training loss weight (`output_router_logits` when set)."""
    return dict(num_experts_per_tok=m.experts_per_token, norm_topk_prob=m.norm_topk_prob,
                router_aux_loss_coef=m.aux_loss_coef, output_router_logits=m.aux_loss_coef > 0)


# ---------------------------------------------------------------- tensors


def router(path: tuple[str, ...], name: str, c: ModelConfig, *, correction: bool | None = None,
           fused: str | None = None) -> list[Entry]:
    """`{name}.weight [E, D]` (+ `.bias [E]` with `router_bias`, + `.e_score_correction_bias [E]` with
    `correction`, by default `correction_bias`; zeros exported for a config without one). `fused`: the
    router's name beside fused experts where it differs (Mixtral's `mlp.gate`), also read."""
    m, E = c.moe, c.moe.num_experts
    other = () if fused is None else (Entry(path + ("router_kernel",), (f"{fused}.weight",), ((E, c.d_model),),
                                            w.LINEAR),)
    entries = [Entry(path + ("router_kernel",), (f"{name}.weight",), ((E, c.d_model),), w.LINEAR, alternatives=other)]
    if m.router_bias:
        entries.append(Entry(path + ("router_bias",), (f"{name}.bias",), ((E,),)))
    if m.correction_bias if correction is None else correction:
        entries.append(Entry(path + ("router_correction_bias",), (f"{name}.e_score_correction_bias",), ((E,),),
                             zero_fill=True))
    return entries


def experts(path: tuple[str, ...], name: str, c: ModelConfig, *, projections=("gate_proj", "up_proj", "down_proj"),
            fused: str | None = None) -> list[Entry]:
    """SwiGLU routed experts stored one per expert, `{name}.{e}.{gate|up|down}.weight` (`projections`), or
    fused as `{fused}.gate_up_proj [E, 2F, D]` and `{fused}.down_proj [E, D, F]` (`fused` defaults to `name`)."""
    m, D = c.moe, c.d_model
    E, F, (gate, up, down), fused = m.num_experts, m.expert_hidden, projections, fused or name
    gate_up = Entry(path + ("experts_gate_up",), tuple(f"{name}.{e}.{p}.weight" for p in (gate, up) for e in range(E)),
                    ((F, D),) * (2 * E), w.stacked_gate_up(E),
                    alternatives=(Entry(path + ("experts_gate_up",), (f"{fused}.gate_up_proj",), ((E, 2 * F, D),),
                                        w.FUSED),))
    down_ = Entry(path + ("experts_down",), tuple(f"{name}.{e}.{down}.weight" for e in range(E)), ((D, F),) * E,
                  w.STACKED, alternatives=(Entry(path + ("experts_down",), (f"{fused}.down_proj",), ((E, D, F),),
                                                 w.FUSED),))
    return [gate_up, down_]


def shared(path: tuple[str, ...], name: str, c: ModelConfig, *, gate: str | None = None) -> list[Entry]:
    """The shared experts as one gated MLP `{name}.gate_proj|up_proj|down_proj` of width `shared_hidden`
    (+ Qwen2-MoE's `{gate}.weight [1, D]`, the sigmoid gate, when `gate` is given)."""
    S, D = c.moe.shared_hidden, c.d_model
    entries = [Entry(path + ("shared_gate_up", "kernel"), (f"{name}.gate_proj.weight", f"{name}.up_proj.weight"),
                     ((S, D), (S, D)), w.GATE_UP), *w.linear(path + ("shared_down",), f"{name}.down_proj", S, D,
                                                             bias=False)]
    return entries + ([] if gate is None else w.linear(path + ("shared_expert_gate",), gate, D, 1, bias=False))


def block(moe_mlp: Callable[[ModelConfig, int], list[Entry]]) -> Callable[[ModelConfig, int, dict], list[Entry]]:
    """`common.llama_block` whose MLP is `moe_mlp(c, i)` on the MoE layers (`ModelConfig.layer_is_moe`)."""
    def build(c: ModelConfig, i: int, b: dict[str, bool]) -> list[Entry]:
        if not c.layer_is_moe(i):
            return common.llama_block(c, i, b)
        h = f"model.layers.{i}"
        return (common.norm(c, i, "attn_norm", f"{h}.input_layernorm") + common.attention(c, i, b, f"{h}.self_attn")
                + common.norm(c, i, "mlp_norm", f"{h}.post_attention_layernorm") + moe_mlp(c, i))
    return build
