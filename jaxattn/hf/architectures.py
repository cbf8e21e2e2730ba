"""A Hugging Face config.json -> the `ModelConfig` that computes the same function.

One reader per family turns the transformers config of that family into
`ModelConfig` fields, with transformers 5.23's class defaults for keys a
config.json leaves out. Anything jaxattn would compute differently raises
`UnsupportedCheckpoint` naming the architecture or the field, before any
tensor is read. The tensor names that go with each family are in
`jaxattn.hf.weights`; the way back (ModelConfig -> config.json) is in
`jaxattn.hf.export`.

Choices made on load: standard attention loads with separate `query`, `key`,
`value` (as the checkpoints store them) except GPT-2 and GPT-NeoX, whose
checkpoints fuse them (`fused_qkv=True`); both are the same maths.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from jaxattn.config import MLAConfig, ModelConfig
from jaxattn.hf.errors import UnsupportedCheckpoint
from jaxattn.hf.rope_params import read_rope, rope_dict, rope_type

# The transformers classes each family is read from and exported to.
ARCHITECTURES = {
    "gpt2": "GPT2LMHeadModel",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "gpt_neox": "GPTNeoXForCausalLM",
}
TANH_GELU = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
ERF_GELU = ("gelu",)
SILU = ("silu", "swish")
# DeepSeek's latent norms (q_a_layernorm, kv_a_layernorm) are built with this eps whatever rms_norm_eps says.
DEEPSEEK_LATENT_EPS = 1e-6


def family_of(hf: Mapping[str, Any]) -> str:
    """The family key of a config.json (its `model_type`), checked against `architectures`."""
    family = hf.get("model_type")
    named = list(hf.get("architectures") or [])
    if family not in ARCHITECTURES:
        raise UnsupportedCheckpoint(f"unsupported architecture: model_type={family!r} architectures={named}; "
                                    f"supported: {sorted(ARCHITECTURES.values())}")
    if named and ARCHITECTURES[family] not in named:
        raise UnsupportedCheckpoint(f"unsupported architecture {named} for model_type={family!r}: only "
                                    f"{ARCHITECTURES[family]} (a causal LM with its head) is read")
    return family


def _reject(hf: Mapping[str, Any], field: str, value, why: str) -> None:
    raise UnsupportedCheckpoint(f"{ARCHITECTURES[hf['model_type']]}: {field}={value!r} is not supported ({why})")


def _gelu_approximate(hf: Mapping[str, Any], field: str, default: str) -> bool:
    act = hf.get(field) or default
    if act not in TANH_GELU + ERF_GELU:
        _reject(hf, field, act, f"GELU MLPs take {TANH_GELU + ERF_GELU}")
    return act in TANH_GELU


def _gated_mlp(hf: Mapping[str, Any]) -> dict[str, Any]:
    """`mlp` and `gelu_approximate` of a gated (gate/up/down) MLP from `hidden_act`."""
    act = hf.get("hidden_act") or "silu"
    if act in SILU:
        return dict(mlp="swiglu")
    if act in TANH_GELU + ERF_GELU:
        return dict(mlp="geglu", gelu_approximate=act in TANH_GELU)
    _reject(hf, "hidden_act", act, f"gated MLPs take {SILU + TANH_GELU + ERF_GELU}")


def _common(hf: Mapping[str, Any], *, max_positions: int, tie: bool) -> dict[str, Any]:
    return dict(vocab_size=int(hf["vocab_size"]), max_seq_len=int(hf.get("max_position_embeddings", max_positions)),
                tie_embeddings=bool(hf.get("tie_word_embeddings", tie)))


def _rope(hf: Mapping[str, Any], **defaults) -> dict[str, Any]:
    theta, scaling = read_rope(hf, **defaults)
    return dict(positions="rope", rope_theta=theta, rope_scaling=scaling, rope_interleaved=False)


def read_gpt2(hf: Mapping[str, Any]) -> dict[str, Any]:
    for field, ok in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                      ("reorder_and_upcast_attn", False), ("add_cross_attention", False)):
        if hf.get(field, ok) != ok:
            _reject(hf, field, hf[field], f"jaxattn computes GPT-2 with {field}={ok}")
    d = int(hf.get("n_embd", 768))
    return dict(vocab_size=int(hf["vocab_size"]), d_model=d, num_layers=int(hf.get("n_layer", 12)),
                num_heads=int(hf.get("n_head", 12)), positions="learned", max_seq_len=int(hf.get("n_positions", 1024)),
                norm="layernorm", norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)), mlp="gelu",
                gelu_approximate=_gelu_approximate(hf, "activation_function", "gelu_new"),
                mlp_hidden=int(hf.get("n_inner") or 4 * d), use_bias=True, fused_qkv=True,
                tie_embeddings=bool(hf.get("tie_word_embeddings", True)))


def _heads(hf: Mapping[str, Any], head_dim_default: int | None = None) -> dict[str, Any]:
    d, n = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    return dict(d_model=d, num_layers=int(hf["num_hidden_layers"]), num_heads=n,
                num_kv_heads=int(hf.get("num_key_value_heads") or n),
                head_dim=int(hf.get("head_dim") or head_dim_default or d // n))


def _layer_window(hf: Mapping[str, Any]) -> int | None:
    """Qwen2/Qwen3: one window for every layer, or none; a mix of full and sliding layers is unsupported."""
    window = hf.get("sliding_window", 4096) if hf.get("use_sliding_window", False) else None
    layers = int(hf["num_hidden_layers"])
    kinds = hf.get("layer_types") or [
        "sliding_attention" if window is not None and i >= hf.get("max_window_layers", 28) else "full_attention"
        for i in range(layers)]
    if set(kinds) - {"full_attention", "sliding_attention"}:
        _reject(hf, "layer_types", sorted(set(kinds)), "only full_attention and sliding_attention layers exist here")
    if len(set(kinds)) > 1:
        _reject(hf, "layer_types", kinds, "a mix of full and sliding-window layers; jaxattn has one window")
    return window if kinds and kinds[0] == "sliding_attention" else None


def _llama_biases(hf: Mapping[str, Any]) -> dict[str, bool]:
    family, attention = hf["model_type"], bool(hf.get("attention_bias", False))
    return {"llama": dict(qkv_bias=attention, out_bias=attention, mlp_bias=bool(hf.get("mlp_bias", False))),
            "mistral": dict(qkv_bias=False, out_bias=False, mlp_bias=False),
            "qwen2": dict(qkv_bias=True, out_bias=False, mlp_bias=False),  # q/k/v biases, none on o_proj
            "qwen3": dict(qkv_bias=attention, out_bias=attention, mlp_bias=False)}[family]


def _window(hf: Mapping[str, Any]) -> int | None:
    family = hf["model_type"]
    if family == "mistral":
        if hf.get("layer_types") and len(set(hf["layer_types"])) > 1:
            _reject(hf, "layer_types", hf["layer_types"], "a mix of full and sliding-window layers "
                    "(transformers' Mistral ignores it); jaxattn has one window")
        return hf.get("sliding_window", 4096)
    return _layer_window(hf) if family in ("qwen2", "qwen3") else None


def read_llama_like(hf: Mapping[str, Any]) -> dict[str, Any]:
    """Llama 1/2/3 (and SmolLM), Mistral, Qwen2, Qwen3: RMSNorm, gated MLP, half-split RoPE."""
    family = hf["model_type"]
    max_positions = {"llama": 2048, "mistral": 131072}.get(family, 32768)
    return dict(**_common(hf, max_positions=max_positions, tie=False),
                **_heads(hf, 128 if family == "qwen3" else None), **_rope(hf), **_gated_mlp(hf),
                **_llama_biases(hf), norm="rmsnorm", norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                mlp_hidden=int(hf["intermediate_size"]), use_bias=False, fused_qkv=False,
                sliding_window=_window(hf), qk_norm=family == "qwen3")


def read_gpt_neox(hf: Mapping[str, Any]) -> dict[str, Any]:
    """GPT-NeoX with sequential residuals and full rotary heads (LayerNorm, plain GELU MLP, biased)."""
    if hf.get("use_parallel_residual", True):
        _reject(hf, "use_parallel_residual", True, "jaxattn blocks are sequential: x + attn, then + mlp")
    d, n = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    attention_bias = bool(hf.get("attention_bias", True))
    rope = _rope(hf, default_theta=float(hf.get("rotary_emb_base", 10000.0)),
                 default_partial=hf.get("rotary_pct", 0.25))
    return dict(**_common(hf, max_positions=2048, tie=False), **rope, d_model=d,
                num_layers=int(hf["num_hidden_layers"]), num_heads=n, norm="layernorm",
                norm_eps=float(hf.get("layer_norm_eps", 1e-5)), mlp="gelu",
                gelu_approximate=_gelu_approximate(hf, "hidden_act", "gelu"),
                mlp_hidden=int(hf.get("intermediate_size") or 4 * d), use_bias=True, qkv_bias=attention_bias,
                out_bias=attention_bias, mlp_bias=True, fused_qkv=True)


def _check_dense(hf: Mapping[str, Any], first_dense_default: int, experts_default: int) -> None:
    experts = hf.get("n_routed_experts", experts_default)
    first_dense, every = hf.get("first_k_dense_replace", first_dense_default), hf.get("moe_layer_freq") or 1
    moe = [i for i in range(int(hf["num_hidden_layers"])) if i >= first_dense and i % every == 0]
    if experts and moe:
        _reject(hf, "n_routed_experts", experts, f"layers {moe} are mixture-of-experts (first_k_dense_replace="
                f"{first_dense}, moe_layer_freq={every}); jaxattn loads dense MLP layers only")


def read_deepseek(hf: Mapping[str, Any]) -> dict[str, Any]:
    """DeepSeek-V2/V3 attention (MLA) with dense gated MLPs."""
    v3 = hf["model_type"] == "deepseek_v3"
    _check_dense(hf, 3 if v3 else 0, 256 if v3 else 64)
    eps = float(hf.get("rms_norm_eps", 1e-6))
    if eps != DEEPSEEK_LATENT_EPS:
        _reject(hf, "rms_norm_eps", eps, f"transformers' latent norms use {DEEPSEEK_LATENT_EPS}, jaxattn one eps")
    params = rope_dict(hf)
    if rope_type(params) not in ("default", "yarn") and params.get("mscale_all_dim"):
        _reject(hf, "rope_parameters.mscale_all_dim", params["mscale_all_dim"], "a softmax mscale outside YaRN")
    q_rank = hf.get("q_lora_rank", 1536)
    mla = MLAConfig(kv_lora_rank=int(hf.get("kv_lora_rank", 512)), q_lora_rank=None if q_rank is None else int(q_rank),
                    qk_nope_head_dim=int(hf.get("qk_nope_head_dim", 128)),
                    qk_rope_head_dim=int(hf.get("qk_rope_head_dim", 64)), v_head_dim=int(hf.get("v_head_dim", 128)))
    bias = bool(hf.get("attention_bias", False))
    fields = dict(**_common(hf, max_positions=4096 if v3 else 2048, tie=False), **_rope(hf), **_gated_mlp(hf),
                  d_model=int(hf["hidden_size"]), num_layers=int(hf["num_hidden_layers"]),
                  num_heads=int(hf["num_attention_heads"]), mla=mla, norm="rmsnorm", norm_eps=eps,
                  mlp_hidden=int(hf["intermediate_size"]), use_bias=False, qkv_bias=bias, out_bias=bias,
                  mlp_bias=bool(hf.get("mlp_bias", False)) and not v3)
    fields["rope_interleaved"] = bool(hf.get("rope_interleave", True)) if v3 else True  # V2 is always interleaved
    return fields


READERS: dict[str, Callable[[Mapping[str, Any]], dict[str, Any]]] = {
    "gpt2": read_gpt2, "llama": read_llama_like, "mistral": read_llama_like, "qwen2": read_llama_like,
    "qwen3": read_llama_like, "deepseek_v2": read_deepseek, "deepseek_v3": read_deepseek,
    "gpt_neox": read_gpt_neox,
}


def config_from_hf(hf: Mapping[str, Any], dtype: str = "float32") -> tuple[str, ModelConfig]:
    """`(family, ModelConfig)` computing what transformers computes for this config.json.

    Raises UnsupportedCheckpoint (naming the architecture or field) for anything else.
    """
    family = family_of(hf)
    fields = READERS[family](hf)
    return family, ModelConfig(**fields, dtype=dtype, param_dtype=dtype, dropout=0.0)
