"""DeepSeek-V2/V3's shared reading, writing and tensors: MLA attention, dense first layers, then routed experts.

Multi-head Latent Attention (`ModelConfig.mla`, docs/theory.md §6): queries
with or without a latent (`q_lora_rank`), one joint key/value latent, decoupled
rotary dims. The latent norms (`q_a_layernorm`, `kv_a_layernorm`) are built
with eps 1e-6 whatever `rms_norm_eps` says, so only that eps loads.

Mixture of experts (`ModelConfig.moe`, `jaxattn.hf.families.moe`): in transformers 5.23 every
layer from `first_k_dense_replace` on is MoE when `n_routed_experts` is set (`moe_layer_freq` is
ignored: a value other than 1 is refused), the first ones dense of `intermediate_size`; routed
experts of `moe_intermediate_size`, `n_shared_experts` shared ones as one MLP of
`n_shared_experts * moe_intermediate_size`, gates times `routed_scaling_factor`. The router
itself is each version's (`deepseek_v2`, `deepseek_v3`). Neither version adds a training loss
for its router (`aux_loss_alpha`, `seq_aux` are not read: `MoEConfig.aux_loss_coef` 0).
"""

from __future__ import annotations

from typing import Any, Callable

from jaxattn.config import MLAConfig, ModelConfig
from jaxattn.hf import weights as w
from jaxattn.hf.families import common, moe
from jaxattn.hf.family import ANY, Need, Problem, features, layers
from jaxattn.hf.fields import Fields
from jaxattn.hf.rope_params import read_rope, rope_dict, rope_type
from jaxattn.hf.weights import Entry

LATENT_EPS = 1e-6


def experts(hf: Fields, architecture: str, *, first_dense: int, count: int, shared: int, hidden: int, k: int | None,
            scale: float, router: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """`moe` and `dense_layers` with the version's defaults (None: the key is required) and `router()`
    (the MoEConfig fields of the version's router, read only when some layer has experts)."""
    count = hf.integer("n_routed_experts", count, null=0, minimum=0)  # null: no experts
    first, n = hf.integer("first_k_dense_replace", first_dense, minimum=0), hf.integer("num_hidden_layers")
    if not count or first >= n:
        return dict(moe=None, dense_layers=())
    moe.refuse_ignored(hf, architecture, "moe_layer_freq", 1)
    shared, hidden = hf.integer("n_shared_experts", shared), hf.integer("moe_intermediate_size", hidden)
    return moe.fields(hf, architecture, range(first, n), num_experts=count, expert_hidden=hidden,
                      experts_per_token=hf.integer("num_experts_per_tok", *([] if k is None else [k])),
                      num_shared_experts=shared, shared_expert_hidden=hidden,
                      routed_scaling_factor=hf.number("routed_scaling_factor", scale), **router())


def experts_config(c: ModelConfig) -> dict[str, Any]:
    """The keys both versions write for `c`'s experts (or for none: every layer dense)."""
    m = c.moe
    if m is None:
        return dict(first_k_dense_replace=c.num_layers)
    return dict(first_k_dense_replace=len(c.dense_layers), n_routed_experts=m.num_experts,
                num_experts_per_tok=m.experts_per_token, moe_intermediate_size=m.expert_hidden,
                n_shared_experts=m.shared_hidden // m.expert_hidden, routed_scaling_factor=m.routed_scaling_factor,
                n_group=m.n_group, topk_group=m.topk_group, norm_topk_prob=m.norm_topk_prob)


SHARED = Need(lambda v, c: v >= 1 and c.moe.shared_hidden % c.moe.expert_hidden == 0,
              "shared experts of n_shared_experts (>= 1) * moe_intermediate_size")


def experts_refusal(c: ModelConfig, architecture: str, **needs) -> list[Problem]:
    """Problems of `c.moe` in DeepSeek's layout (dense layers first, shared experts) and the version's router."""
    if c.moe is None:
        return []
    problems = moe.problems(c, architecture, num_shared_experts=SHARED, routed_scaling_factor=ANY, **needs)
    if c.dense_layers != tuple(range(len(c.dense_layers))):
        problems.append(Problem("dense_layers", c.dense_layers, f"{architecture} keeps dense only its first "
                                "first_k_dense_replace layers"))
    if c.mlp_bias:
        problems.append(Problem("mlp_bias", True, f"{architecture}'s shared experts have the dense MLPs' biases"))
    return problems


def read(hf: Fields, architecture: str, *, max_positions: int) -> dict[str, Any]:
    eps = hf.number("rms_norm_eps", 1e-6)
    if eps != LATENT_EPS:
        common.reject(architecture, "rms_norm_eps", eps,
                      f"transformers' latent norms use {LATENT_EPS}, jaxattn one eps")
    params = rope_dict(hf)
    if rope_type(params) not in ("default", "yarn") and params.number("mscale_all_dim", 0.0, positive=False):
        common.reject(architecture, "rope_parameters.mscale_all_dim", params["mscale_all_dim"],
                      "a softmax mscale outside YaRN")
    mla = MLAConfig(kv_lora_rank=hf.integer("kv_lora_rank", 512),
                    q_lora_rank=hf.integer("q_lora_rank", 1536, null=None),  # null: queries without a latent
                    qk_nope_head_dim=hf.integer("qk_nope_head_dim", 128),
                    qk_rope_head_dim=hf.integer("qk_rope_head_dim", 64), v_head_dim=hf.integer("v_head_dim", 128))
    return dict(**common.vocab(hf, max_positions=max_positions, tie=False),
                **common.rope_fields(architecture, read_rope(hf), mla.qk_rope_head_dim),
                **common.gated_mlp(hf, architecture),
                d_model=hf.integer("hidden_size"), num_layers=hf.integer("num_hidden_layers"),
                num_heads=hf.integer("num_attention_heads"), mla=mla, norm="rmsnorm", norm_eps=eps,
                mlp_hidden=hf.integer("intermediate_size"))


def write(c: ModelConfig) -> dict[str, Any]:
    m = c.mla
    return dict(**common.sizes(c), num_key_value_heads=c.num_heads, kv_lora_rank=m.kv_lora_rank,
                q_lora_rank=m.q_lora_rank, qk_nope_head_dim=m.qk_nope_head_dim, qk_rope_head_dim=m.qk_rope_head_dim,
                v_head_dim=m.v_head_dim, hidden_act=common.gated_act(c), rms_norm_eps=c.norm_eps,
                rope_parameters=common.rope_parameters(c), **experts_config(c))


def refusal(c: ModelConfig, architecture: str) -> list[Problem]:
    problems = features(c, architecture, mla=Need(lambda v, c: v is not None, "MLA"), moe=ANY) + layers(c, architecture)
    if c.norm_eps != LATENT_EPS:
        problems.append(Problem("norm_eps", c.norm_eps, f"transformers' {architecture} latent norms use eps "
                                f"{LATENT_EPS}"))
    return problems


def block(c: ModelConfig, i: int, b: dict[str, bool], correction: bool = False) -> list[Entry]:
    m, D, N, p, h = c.mla, c.d_model, c.num_heads, (f"blocks_{i}", "attn"), f"model.layers.{i}.self_attn"
    width = N * (m.qk_nope_head_dim + m.qk_rope_head_dim)
    R, E, PV = m.kv_lora_rank, m.qk_rope_head_dim, m.qk_nope_head_dim + m.v_head_dim
    if m.q_lora_rank is None:
        query = w.linear(p + ("wq",), f"{h}.q_proj", D, width, bias=False)
    else:
        query = (w.linear(p + ("wq_a",), f"{h}.q_a_proj", D, m.q_lora_rank, bias=b["qkv"])
                 + w.norm(p + ("q_norm",), f"{h}.q_a_layernorm", m.q_lora_rank)
                 + w.linear(p + ("wq_b",), f"{h}.q_b_proj", m.q_lora_rank, width, bias=False))
    kv = (w.linear(p + ("wkv_a",), f"{h}.kv_a_proj_with_mqa", D, R + E, bias=b["qkv"])
          + w.norm(p + ("kv_norm",), f"{h}.kv_a_layernorm", R)
          + [Entry(p + ("wkv_b",), (f"{h}.kv_b_proj.weight",), ((N * PV, R),), w.kv_b(R, N, PV))])
    layer = f"model.layers.{i}"
    return (common.norm(c, i, "attn_norm", f"{layer}.input_layernorm") + query + kv
            + w.linear(p + ("wo",), f"{h}.o_proj", N * m.v_head_dim, D, bias=b["out"])
            + common.norm(c, i, "mlp_norm", f"{layer}.post_attention_layernorm")
            + (_moe_mlp(c, i, correction) if c.layer_is_moe(i)
               else w.gated_mlp((f"blocks_{i}", "mlp"), f"{layer}.mlp", c, bias=b["mlp"])))


def _moe_mlp(c: ModelConfig, i: int, correction: bool) -> list[Entry]:
    p, h = (f"blocks_{i}", "mlp"), f"model.layers.{i}.mlp"
    return (moe.router(p, f"{h}.gate", c, correction=correction) + moe.experts(p, f"{h}.experts", c)
            + moe.shared(p, f"{h}.shared_experts", c))


def layout(c: ModelConfig, biases, *, correction: bool = False) -> list[Entry]:
    """The tensors; `correction`: MoE routers hold `e_score_correction_bias` (V3: zeros exported without one)."""
    return common.decoder_layout(c, biases, lambda c, i, b: block(c, i, b, correction),
                                 embed="model.embed_tokens.weight", final="model.norm")
