"""Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen3's attention (per-head q/k RMSNorm, `attention_bias`) with routed experts.

MoE layers as Qwen2-MoE (`jaxattn.hf.families.qwen2_moe`): not in `mlp_only_layers`, (i + 1) %
`decoder_sparse_step` == 0, the others dense of `intermediate_size`; a softmax router, its top
`num_experts_per_tok` renormalised when `norm_topk_prob`; no shared expert. The number of experts
is `num_experts` (transformers 5.23 saves it as `num_local_experts`; both are read). Unlike Qwen3,
one window for every layer: `sliding_window` when `use_sliding_window` (transformers' Qwen3-MoE
ignores `layer_types` and `max_window_layers`; a config.json mixing layer types is refused), and
head_dim defaults to hidden_size / num_attention_heads. Training: `router_aux_loss_coef` as Qwen2-MoE.
"""

from __future__ import annotations

from typing import Any

from jaxattn.config import ModelConfig
from jaxattn.hf.families import common, moe
from jaxattn.hf.family import ANY, Biases, Family, Problem, Switch, features, layers
from jaxattn.hf.fields import Fields
from jaxattn.hf.weights import Entry

ARCH = "Qwen3MoeForCausalLM"
BIASES = Biases(qkv=Switch("attention_bias"), out=Switch("attention_bias"))


def _count(hf: Fields) -> int:
    count = hf.integer("num_local_experts", None, minimum=0)
    named = hf.integer("num_experts", None, minimum=0)
    if count is not None and named is not None and count != named:
        common.reject(ARCH, "num_experts", named, f"it differs from num_local_experts={count}, its other name")
    return next((n for n in (count, named) if n is not None), 128)


def _window(hf: Fields) -> dict[str, Any]:
    """One `sliding_window` for every layer when `use_sliding_window`; mixed `layer_types` refused."""
    common.one_layer_type(hf, ARCH)
    use = hf.flag("use_sliding_window", False)
    return dict(sliding_window=hf.integer("sliding_window", 4096, null=None) if use else None)


def read(hf: Fields) -> dict[str, Any]:
    step, dense = hf.integer("decoder_sparse_step", 1), moe.layer_list(hf, "mlp_only_layers")
    mixed = [i for i in range(hf.integer("num_hidden_layers")) if i not in dense and (i + 1) % step == 0]
    experts = moe.fields(hf, ARCH, mixed, num_experts=_count(hf),
                         experts_per_token=hf.integer("num_experts_per_tok", 8),
                         expert_hidden=hf.integer("moe_intermediate_size", 768),
                         norm_topk_prob=hf.flag("norm_topk_prob", False), aux_loss_coef=moe.aux_loss_coef(hf))
    return dict(common.llama_fields(hf, ARCH, max_positions=32768, kv_heads=4), **_window(hf), qk_norm="head",
                **experts)


def write(c: ModelConfig) -> dict[str, Any]:
    m = c.moe
    return dict(common.llama_config(c), use_sliding_window=c.sliding_window is not None,
                sliding_window=c.sliding_window, num_experts=m.num_experts, moe_intermediate_size=m.expert_hidden,
                decoder_sparse_step=1, mlp_only_layers=list(c.dense_layers), **moe.router_config(m))


def refusal(c: ModelConfig) -> list[Problem]:
    return (features(c, ARCH, moe=moe.PRESENT, qk_norm="head") + layers(c, ARCH, windows="uniform")
            + moe.problems(c, ARCH, norm_topk_prob=ANY))


def _moe_mlp(c: ModelConfig, i: int) -> list[Entry]:
    p, h = (f"blocks_{i}", "mlp"), f"model.layers.{i}.mlp"
    return moe.router(p, f"{h}.gate", c) + moe.experts(p, f"{h}.experts", c)


def layout(c: ModelConfig) -> list[Entry]:
    return common.decoder_layout(c, BIASES, moe.block(_moe_mlp), embed="model.embed_tokens.weight", final="model.norm")


FAMILY = Family("qwen3_moe", ARCH, read, write, refusal, layout, BIASES, reads_experts=True)
