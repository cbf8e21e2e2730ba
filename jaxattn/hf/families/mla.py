"""DeepSeek-V2/V3's shared reading, writing and tensors: MLA attention with dense gated MLPs.

Multi-head Latent Attention (`ModelConfig.mla`, docs/theory.md §6): queries
with or without a latent (`q_lora_rank`), one joint key/value latent, decoupled
rotary dims. The latent norms (`q_a_layernorm`, `kv_a_layernorm`) are built
with eps 1e-6 whatever `rms_norm_eps` says, so only that eps loads. Layers with
routed experts are refused (`experts`), the first `first_k_dense_replace` and
those off `moe_layer_freq` being dense.
"""

from __future__ import annotations

from typing import Any

from jaxattn.config import MLAConfig, ModelConfig
from jaxattn.hf import weights as w
from jaxattn.hf.families import common
from jaxattn.hf.family import Need, Problem, features, layers
from jaxattn.hf.fields import Fields
from jaxattn.hf.rope_params import read_rope, rope_dict, rope_type
from jaxattn.hf.weights import Entry

LATENT_EPS = 1e-6


def experts(hf: Fields, *, first_dense: int, count: int) -> tuple[str, int, list[int]]:
    """(key, routed experts, mixture-of-experts layers) with the family's defaults."""
    count = hf.integer("n_routed_experts", count, null=0, minimum=0)  # null: no experts
    first = hf.integer("first_k_dense_replace", first_dense, minimum=0)
    every = hf.integer("moe_layer_freq", 1)
    layers = range(hf.integer("num_hidden_layers"))
    return "n_routed_experts", count, [i for i in layers if i >= first and i % every == 0]


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
                rope_parameters=common.rope_parameters(c), first_k_dense_replace=c.num_layers)


def refusal(c: ModelConfig, architecture: str) -> list[Problem]:
    problems = features(c, architecture, mla=Need(lambda v, c: v is not None, "MLA")) + layers(c, architecture)
    if c.norm_eps != LATENT_EPS:
        problems.append(Problem("norm_eps", c.norm_eps, f"transformers' {architecture} latent norms use eps "
                                f"{LATENT_EPS}"))
    return problems


def block(c: ModelConfig, i: int, b: dict[str, bool]) -> list[Entry]:
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
            + w.gated_mlp((f"blocks_{i}", "mlp"), f"{layer}.mlp", c, bias=b["mlp"]))


def layout(c: ModelConfig, biases) -> list[Entry]:
    return common.decoder_layout(c, biases, block, embed="model.embed_tokens.weight", final="model.norm")
