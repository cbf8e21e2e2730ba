"""DeepSeek-V3 (`DeepseekV3ForCausalLM`): MLA, RoPE pairs interleaved or half-split (`rope_interleave`), routed experts.

See `jaxattn.hf.families.mla`. Multi-token-prediction layers stored after the
model's (`num_nextn_predict_layers`) are not part of it and are ignored. V3's router, as
transformers 5.23 computes it ("noaux_tc"): sigmoid scores; the experts chosen by the scores
plus `e_score_correction_bias` (a float32 buffer, stored as `mlp.gate.e_score_correction_bias`),
only from the `topk_group` best of `n_group` groups (each ranked by its two best), the gates the
plain scores renormalised when `norm_topk_prob` (default True), times `routed_scaling_factor`
(default 2.5). A `scoring_func` other than "sigmoid" or a `topk_method` other than "noaux_tc"
(both ignored by transformers) is refused. A config without a correction bias exports zeros.
"""

from __future__ import annotations

from typing import Any

from jaxattn.config import ModelConfig
from jaxattn.hf.families import mla, moe
from jaxattn.hf.family import ANY, Biases, Family, Need, Problem, Switch
from jaxattn.hf.fields import Fields
from jaxattn.hf.weights import Entry

ARCH = "DeepseekV3ForCausalLM"
BIASES = Biases(qkv=Switch("attention_bias"), out=Switch("attention_bias"))


def _router(hf: Fields) -> dict[str, Any]:
    moe.refuse_ignored(hf, ARCH, "scoring_func", "sigmoid")
    moe.refuse_ignored(hf, ARCH, "topk_method", "noaux_tc")
    return dict(scoring="sigmoid", correction_bias=True, group_score="top2_sum", n_group=hf.integer("n_group", 8),
                topk_group=hf.integer("topk_group", 4), norm_topk_prob=hf.flag("norm_topk_prob", True))


def read(hf: Fields) -> dict[str, Any]:
    experts = mla.experts(hf, ARCH, first_dense=3, count=256, shared=1, hidden=2048, k=8, scale=2.5,
                          router=lambda: _router(hf))
    return dict(mla.read(hf, ARCH, max_positions=4096), rope_interleaved=hf.flag("rope_interleave", True), **experts)


def write(c: ModelConfig) -> dict[str, Any]:
    return dict(mla.write(c), rope_interleave=c.rope_interleaved, num_nextn_predict_layers=0)


def refusal(c: ModelConfig) -> list[Problem]:
    return mla.refusal(c, ARCH) + mla.experts_refusal(
        c, ARCH, scoring="sigmoid", correction_bias=ANY, n_group=ANY, topk_group=ANY, norm_topk_prob=ANY,
        group_score=Need(lambda v, c: v == "top2_sum" or c.moe.topk_group == c.moe.n_group,
                         "group_score='top2_sum'", of_field=True))


def layout(c: ModelConfig) -> list[Entry]:
    return mla.layout(c, BIASES, correction=True)


FAMILY = Family("deepseek_v3", ARCH, read, write, refusal, layout, BIASES, reads_experts=True,
                extra_layers=lambda hf: hf.integer("num_nextn_predict_layers", 0, minimum=0))
