"""DeepSeek-V2 (`DeepseekV2ForCausalLM`): MLA, RoPE pairs always interleaved, optional MLP biases, routed experts.

See `jaxattn.hf.families.mla`. V2's router, as transformers 5.23 computes it: a softmax over the
E experts, then `topk_method` "greedy" (the top K) or "group_limited_greedy" (the top K of the
`topk_group` groups, of `n_group`, with the best maximum score); never renormalised (the router
ignores `norm_topk_prob`: True is refused), times `routed_scaling_factor` (default 1). Other
topk_methods ("noaux_tc" is V3's) and a `scoring_func` other than "softmax" are refused, as is
`mlp_bias` with experts (transformers would give the shared experts biases).
"""

from __future__ import annotations

from typing import Any

from jaxattn.config import ModelConfig
from jaxattn.hf.families import common, mla, moe
from jaxattn.hf.family import ANY, Biases, Family, Need, Problem, Switch
from jaxattn.hf.fields import Fields
from jaxattn.hf.weights import Entry

ARCH = "DeepseekV2ForCausalLM"
BIASES = Biases(qkv=Switch("attention_bias"), out=Switch("attention_bias"), mlp=Switch("mlp_bias"))
METHODS = ("greedy", "group_limited_greedy")


def _router(hf: Fields) -> dict[str, Any]:
    method = hf.text("topk_method", "greedy")
    if method not in METHODS:
        common.reject(ARCH, "topk_method", method, f"transformers' {ARCH} implements {METHODS}")
    moe.refuse_ignored(hf, ARCH, "scoring_func", "softmax")
    moe.refuse_ignored(hf, ARCH, "norm_topk_prob", False)
    if hf.flag("mlp_bias", False):
        common.reject(ARCH, "mlp_bias", True, "with experts its shared experts have biases, jaxattn's none")
    if method == "greedy":
        return dict(scoring="softmax")
    return dict(scoring="softmax", n_group=hf.integer("n_group"), topk_group=hf.integer("topk_group"),
                group_score="max")


def read(hf: Fields) -> dict[str, Any]:
    experts = mla.experts(hf, ARCH, first_dense=0, count=64, shared=2, hidden=1407, k=None, scale=1.0,
                          router=lambda: _router(hf))
    return dict(mla.read(hf, ARCH, max_positions=2048), rope_interleaved=True, **experts)


def write(c: ModelConfig) -> dict[str, Any]:
    limited = c.moe is not None and c.moe.n_group > 1
    return dict(mla.write(c), **({} if c.moe is None else dict(
        topk_method="group_limited_greedy" if limited else "greedy")))


def refusal(c: ModelConfig) -> list[Problem]:
    problems = mla.refusal(c, ARCH) + mla.experts_refusal(
        c, ARCH, n_group=ANY, topk_group=ANY, group_score=Need(
            lambda v, c: v == "max" or c.moe.topk_group == c.moe.n_group, "group_score='max'", of_field=True))
    if c.positions == "rope" and not c.rope_interleaved:
        problems.append(Problem("rope_interleaved", False, f"{ARCH} pairs RoPE dims interleaved only"))
    return problems


def layout(c: ModelConfig) -> list[Entry]:
    return mla.layout(c, BIASES)


FAMILY = Family("deepseek_v2", ARCH, read, write, refusal, layout, BIASES, reads_experts=True)
