"""Mixtral (`MixtralForCausalLM`): Mistral (no biases, one `sliding_window` or none) with every MLP routed experts.

Each layer: a softmax router over `num_local_experts`, the top `num_experts_per_tok` always
renormalised, experts of width `intermediate_size`; no shared expert, no dense layer. Checkpoints
store them as `block_sparse_moe.gate` and `block_sparse_moe.experts.{e}.w1|w3|w2` (gate, up,
down; hub and transformers 5.23's save_pretrained alike), or fused as transformers 5's modules
(`mlp.gate`, `mlp.experts.gate_up_proj|down_proj`). `router_jitter_noise` acts in training only
and is not read; `router_aux_loss_coef` as Qwen2-MoE (`jaxattn.hf.families.qwen2_moe`).
"""

from __future__ import annotations

from typing import Any

from jaxattn.config import ModelConfig
from jaxattn.hf.families import common, moe
from jaxattn.hf.family import Biases, Family, Problem, features, layers
from jaxattn.hf.fields import Fields
from jaxattn.hf.weights import Entry

ARCH = "MixtralForCausalLM"
BIASES = Biases()


def read(hf: Fields) -> dict[str, Any]:
    experts = moe.fields(hf, ARCH, range(hf.integer("num_hidden_layers")),
                         num_experts=hf.integer("num_local_experts", 8, minimum=0),
                         experts_per_token=hf.integer("num_experts_per_tok", 2),
                         expert_hidden=hf.integer("intermediate_size"), norm_topk_prob=True,
                         aux_loss_coef=moe.aux_loss_coef(hf))
    common.one_layer_type(hf, ARCH)
    fields = common.llama_fields(hf, ARCH, max_positions=131072, kv_heads=8, theta=1e6, eps=1e-5)
    return dict(fields, sliding_window=hf.integer("sliding_window", None, null=None), **experts)


def write(c: ModelConfig) -> dict[str, Any]:
    m = c.moe
    return dict(common.llama_config(c), intermediate_size=m.expert_hidden, sliding_window=c.sliding_window,
                num_local_experts=m.num_experts, **moe.router_config(m))


def refusal(c: ModelConfig) -> list[Problem]:
    problems = features(c, ARCH, moe=moe.PRESENT) + layers(c, ARCH, windows="uniform")
    if c.dense_layers:
        problems.append(Problem("dense_layers", c.dense_layers, f"{ARCH} routes every layer's MLP"))
    return problems + moe.problems(c, ARCH, norm_topk_prob=True)


def _moe_mlp(c: ModelConfig, i: int) -> list[Entry]:
    p, h = (f"blocks_{i}", "mlp"), f"model.layers.{i}"
    return (moe.router(p, f"{h}.block_sparse_moe.gate", c, fused=f"{h}.mlp.gate")
            + moe.experts(p, f"{h}.block_sparse_moe.experts", c, projections=("w1", "w3", "w2"),
                          fused=f"{h}.mlp.experts"))


def layout(c: ModelConfig) -> list[Entry]:
    return common.decoder_layout(c, BIASES, moe.block(_moe_mlp), embed="model.embed_tokens.weight", final="model.norm")


FAMILY = Family("mixtral", ARCH, read, write, refusal, layout, BIASES, reads_experts=True)
