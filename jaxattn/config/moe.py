"""The config of a mixture-of-experts MLP (`MoEConfig`), a frozen dataclass checked when built.

It imports nothing of the model, so the layer that computes it (`jaxattn.layers.moe`), its kernels and the
model's config (`jaxattn.config.model`) can all read it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal, Mapping

from jaxattn._validate import (is_int, require_field_positive_int,
                               require_field_positive_number)


ACTIVATIONS = ("swiglu", "clamped_swiglu")  # `MoEConfig.activation`: the routed experts' gated units


def _bad(name: str, must: str, value) -> ValueError:
    return ValueError(f"MoEConfig.{name} must be {must}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """The maths of one MoE MLP, field by field as transformers 5.23 implements each family.

    Attributes:
      num_experts: E, the routed experts (`n_routed_experts`, `num_experts`, `num_local_experts`).
      experts_per_token: K (`num_experts_per_tok`).
      expert_hidden: F, one routed expert's hidden width (`moe_intermediate_size`; Mixtral and
        GPT-OSS: `intermediate_size`).
      scoring: "softmax" over the E logits (DeepSeek-V2, Qwen2/3-MoE, Mixtral, GPT-OSS) or an
        independent "sigmoid" per expert (DeepSeek-V3).
      softmax_after_topk: GPT-OSS's order: the top K logits, then a softmax over those K. False:
        scores over all E, then the top K of them (every other family; Mixtral then renormalises,
        `norm_topk_prob`, which equals GPT-OSS's order up to rounding). Needs scoring "softmax".
      n_group, topk_group: DeepSeek's group-limited selection: the E experts in `n_group` equal groups,
        the top K chosen only from the `topk_group` best groups (V2 `topk_method=
        "group_limited_greedy"`, V3 always). 1 and 1: no limit (V2 "greedy", every other family).
      group_score: how a group is ranked: "max" of its scores (DeepSeek-V2) or "top2_sum", the sum of
        its two best (DeepSeek-V3, with the correction bias).
      correction_bias: DeepSeek-V3's `e_score_correction_bias` [E]: added to the scores to choose
        the experts (and groups), never to the gates. A parameter the gradient does not reach
        (V3 updates it outside backprop). False for every other family.
      norm_topk_prob: divide the K gates by their sum (+ 1e-20, V3's epsilon, a no-op in float32
        for sums above ~1e-12) (Mixtral always; Qwen2/3-MoE and DeepSeek-V3 as their config says;
        DeepSeek-V2 never: its router ignores the config's flag; GPT-OSS: False, its softmax over
        K already sums to 1).
      routed_scaling_factor: the gates times this, after normalising (DeepSeek-V2/V3; 1 elsewhere).
      router_bias: the router has a bias [E] (GPT-OSS); no other family's does.
      num_shared_experts, shared_expert_hidden: shared experts run on every row, as one SwiGLU MLP
        of width num_shared_experts * shared_expert_hidden (DeepSeek: `n_shared_experts` and
        `moe_intermediate_size`; Qwen2-MoE: 1 and `shared_expert_intermediate_size`; 0 elsewhere).
      shared_gate: the shared expert's output times sigmoid(x w), w [D, 1] (Qwen2-MoE only).
      activation: the routed experts' gated unit: "swiglu", silu(gate) * up, or "clamped_swiglu",
        gate <= limit, |up| <= limit, then (up + 1) * gate * sigmoid(alpha * gate) (GPT-OSS's).
      swiglu_limit, swiglu_alpha: the clamp and the sigmoid's slope of "clamped_swiglu" (GPT-OSS's
        `swiglu_limit` 7.0 and alpha 1.702); unused by "swiglu".
      expert_bias: the routed experts' two projections have biases, `experts_gate_up_bias [E, 2F]`
        and `experts_down_bias [E, D]` (GPT-OSS); no other family's do.
      gate_up_interleaved: how `experts_gate_up`'s 2F columns hold the two halves: False, the gate's
        F columns then the up's; True, gate and up alternating, gate first (GPT-OSS's layout, kept
        as stored).
      aux_loss_coef: the load-balancing loss's weight in `aux["aux_loss"]` (`router_aux_loss_coef`).
      z_loss_coef: the router z-loss's weight there (ST-MoE; no family above trains with one).
    """

    num_experts: int = 8
    experts_per_token: int = 2
    expert_hidden: int = 256
    scoring: Literal["softmax", "sigmoid"] = "softmax"
    softmax_after_topk: bool = False
    n_group: int = 1
    topk_group: int = 1
    group_score: Literal["max", "top2_sum"] = "top2_sum"
    correction_bias: bool = False
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    router_bias: bool = False
    num_shared_experts: int = 0
    shared_expert_hidden: int = 0
    shared_gate: bool = False
    activation: Literal["swiglu", "clamped_swiglu"] = "swiglu"
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    expert_bias: bool = False
    gate_up_interleaved: bool = False
    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0

    def __post_init__(self):
        self._check_types()
        E, K = self.num_experts, self.experts_per_token
        if not 1 <= K <= E:
            raise _bad("experts_per_token", f"in [1, num_experts={E}]", K)
        if E % self.n_group:
            raise _bad("n_group", f"a divisor of num_experts={E}", self.n_group)
        if not 1 <= self.topk_group <= self.n_group:
            raise _bad("topk_group", f"in [1, n_group={self.n_group}]", self.topk_group)
        if K > self.topk_group * (E // self.n_group):
            raise _bad("experts_per_token", f"at most topk_group * experts per group = "
                       f"{self.topk_group * (E // self.n_group)}", K)
        if self.n_group > 1 and self.group_score == "top2_sum" and E // self.n_group < 2:
            raise _bad("group_score", "'max' with one expert per group", self.group_score)
        if self.softmax_after_topk and (self.scoring != "softmax" or self.n_group > 1 or self.correction_bias
                                        or self.norm_topk_prob):
            raise _bad("softmax_after_topk", "False unless scoring='softmax' with no group limit, no "
                       "correction bias and norm_topk_prob=False (its softmax over K already sums to 1)", True)
        if self.num_shared_experts and self.shared_expert_hidden <= 0:
            raise _bad("shared_expert_hidden", "a positive integer with shared experts", self.shared_expert_hidden)
        if self.shared_gate and not self.num_shared_experts:
            raise _bad("shared_gate", "False without shared experts (num_shared_experts=0)", True)

    def _check_types(self) -> None:
        for name in ("num_experts", "experts_per_token", "expert_hidden", "n_group", "topk_group"):
            require_field_positive_int("MoEConfig", name, getattr(self, name))
        for name in ("num_shared_experts", "shared_expert_hidden"):
            if not is_int(getattr(self, name), numpy=False) or getattr(self, name) < 0:
                raise _bad(name, "a non-negative integer", getattr(self, name))
        for name, choices in (("scoring", ("softmax", "sigmoid")), ("group_score", ("max", "top2_sum")),
                              ("activation", ACTIVATIONS)):
            if getattr(self, name) not in choices:
                raise _bad(name, f"one of {choices}", getattr(self, name))
        for name in ("softmax_after_topk", "correction_bias", "norm_topk_prob", "router_bias", "shared_gate",
                     "expert_bias", "gate_up_interleaved"):
            if not isinstance(getattr(self, name), bool):
                raise _bad(name, "True or False", getattr(self, name))
        for name in ("routed_scaling_factor", "swiglu_limit", "swiglu_alpha"):
            require_field_positive_number("MoEConfig", name, getattr(self, name), none_ok=False)
        for name in ("aux_loss_coef", "z_loss_coef"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise _bad(name, "a finite number >= 0", value)

    @property
    def shared_hidden(self) -> int:
        """The shared MLP's width (0: none)."""
        return self.num_shared_experts * self.shared_expert_hidden

    def expert_params(self, d_model: int) -> int:
        """The parameters of one routed expert: `gate_up [D, 2F]`, `down [F, D]` and their biases."""
        F = self.expert_hidden
        return 3 * d_model * F + (2 * F + d_model if self.expert_bias else 0)

    @classmethod
    def upgrade(cls, values: Mapping[str, Any]) -> dict[str, Any]:
        """The fields of a saved config written before the routed experts' function was named by its
        maths: `activation="gptoss"` (with `gptoss_limit`, `gptoss_alpha`) meant the clamped SwiGLU
        with biased projections and interleaved columns, as GPT-OSS has them."""
        values = dict(values)
        legacy = {"gptoss_limit": "swiglu_limit", "gptoss_alpha": "swiglu_alpha"}
        for old, new in legacy.items():
            if old in values:
                values[new] = values.pop(old)
        if values.get("activation") == "gptoss":
            values.update(activation="clamped_swiglu", expert_bias=True, gate_up_interleaved=True)
        return values

    def replace(self, **changes) -> "MoEConfig":
        return dataclasses.replace(self, **changes)
