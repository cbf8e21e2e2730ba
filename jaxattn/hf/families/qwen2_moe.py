"""Qwen1.5/Qwen2-MoE (`Qwen2MoeForCausalLM`): Qwen2's attention (q/k/v biases per `qkv_bias`) with routed experts.

MoE layers: those not in `mlp_only_layers` with (i + 1) % `decoder_sparse_step` == 0 (when
`num_experts` > 0); the others keep a dense MLP of `intermediate_size`. The router is a softmax
over the E experts, the top `num_experts_per_tok`, renormalised when `norm_topk_prob`; one shared
expert (`shared_expert_intermediate_size`) runs on every token, times sigmoid(x `shared_expert_gate`).
Windows: `sliding_window` on the layers `layer_types` marks sliding; by default, with
`use_sliding_window`, the even layers below `max_window_layers` (Qwen2-MoE's own default, not
Qwen2's). A sliding layer without `use_sliding_window` (transformers gives it a window of 0) is refused.
Training: `router_aux_loss_coef` becomes `MoEConfig.aux_loss_coef` when `output_router_logits`
(transformers adds the loss then only; it pools every layer's router logits where jaxattn
averages the per-layer losses); export writes it back the same way.
"""

from __future__ import annotations

from typing import Any

from jaxattn.config import ModelConfig
from jaxattn.hf.families import common, moe
from jaxattn.hf.family import ANY, Biases, Family, Need, Problem, Switch, features, layers
from jaxattn.hf.fields import Fields
from jaxattn.hf.weights import Entry

ARCH = "Qwen2MoeForCausalLM"
BIASES = Biases(qkv=Switch("qkv_bias", True))


def _windows(hf: Fields) -> dict[str, Any]:
    use = hf.flag("use_sliding_window", False)
    window = hf.integer("sliding_window", 4096, null=None) if use else None
    below = hf.integer("max_window_layers", 28, minimum=0)
    kinds = common.read_layer_types(hf, lambda n: [common.SLIDING if use and i % 2 == 0 and i < below
                                                   else common.FULL for i in range(n)], ARCH)
    if common.SLIDING in kinds and window is None:
        key = "sliding_window" if use else "use_sliding_window"
        common.reject(ARCH, key, hf.get(key), "sliding layers in layer_types need use_sliding_window and a "
                      "sliding_window (transformers gives them a window of 0 or none)")
    return common.layer_fields([kind == common.SLIDING for kind in kinds], window)


def read(hf: Fields) -> dict[str, Any]:
    count, step = hf.integer("num_experts", 60, minimum=0), hf.integer("decoder_sparse_step", 1)
    dense = moe.layer_list(hf, "mlp_only_layers")
    mixed = [i for i in range(hf.integer("num_hidden_layers")) if i not in dense and (i + 1) % step == 0]
    experts = moe.fields(hf, ARCH, mixed, num_experts=count, experts_per_token=hf.integer("num_experts_per_tok", 4),
                         expert_hidden=hf.integer("moe_intermediate_size", 1408), num_shared_experts=1,
                         shared_expert_hidden=hf.integer("shared_expert_intermediate_size", 5632), shared_gate=True,
                         norm_topk_prob=hf.flag("norm_topk_prob", False), aux_loss_coef=moe.aux_loss_coef(hf))
    return dict(common.llama_fields(hf, ARCH, max_positions=32768, kv_heads=16), **_windows(hf), **experts)


def write(c: ModelConfig) -> dict[str, Any]:
    m = c.moe
    return dict(common.llama_config(c), **common.qwen_layers_config(c), num_experts=m.num_experts,
                moe_intermediate_size=m.expert_hidden, shared_expert_intermediate_size=m.shared_hidden,
                decoder_sparse_step=1, mlp_only_layers=list(c.dense_layers), **moe.router_config(m))


def refusal(c: ModelConfig) -> list[Problem]:
    return (features(c, ARCH, moe=moe.PRESENT) + layers(c, ARCH, windows="any")
            + moe.problems(c, ARCH, norm_topk_prob=ANY, shared_gate=True,
                           num_shared_experts=Need(lambda v, c: v >= 1, "one shared expert")))


def _moe_mlp(c: ModelConfig, i: int) -> list[Entry]:
    p, h = (f"blocks_{i}", "mlp"), f"model.layers.{i}.mlp"
    return (moe.router(p, f"{h}.gate", c) + moe.experts(p, f"{h}.experts", c)
            + moe.shared(p, f"{h}.shared_expert", c, gate=f"{h}.shared_expert_gate"))


def layout(c: ModelConfig) -> list[Entry]:
    return common.decoder_layout(c, BIASES, moe.block(_moe_mlp), embed="model.embed_tokens.weight", final="model.norm")


FAMILY = Family("qwen2_moe", ARCH, read, write, refusal, layout, BIASES, reads_experts=True)
