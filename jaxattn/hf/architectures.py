"""A Hugging Face config.json -> the `ModelConfig` that computes the same function.

One reader per family turns the transformers config of that family into
`ModelConfig` fields, with transformers 5.23's class defaults for keys a
config.json leaves out. Every value is read through `jaxattn.hf.fields`: a
missing required key, a value of the wrong JSON type or an impossible size
raises `InvalidCheckpoint` naming the file and key. Anything jaxattn would
compute differently raises `UnsupportedCheckpoint` naming the architecture or
the field. Both come before any tensor is read. The tensor names that go with each family are in
`jaxattn.hf.weights`; the way back (ModelConfig -> config.json) is in
`jaxattn.hf.export`.

Choices made on load: standard attention loads with separate `query`, `key`,
`value` (as the checkpoints store them) except GPT-2 and GPT-NeoX, whose
checkpoints fuse them (`fused_qkv=True`); both are the same maths.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from jaxattn.config import MLAConfig, ModelConfig
from jaxattn.hf.errors import HFCheckpointError, InvalidCheckpoint, UnsupportedCheckpoint
from jaxattn.hf.fields import Fields
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


def family_of(hf: Fields) -> str:
    """The family key of a config.json (its `model_type`), checked against `architectures`."""
    family, named = hf.text("model_type"), hf.texts("architectures", [])
    quantization = hf.section("quantization_config")
    if quantization:  # GPTQ, AWQ, FP8 ...: integer or 8-bit tensors with scales jaxattn does not apply
        method = quantization.get("quant_method", "?")
        raise UnsupportedCheckpoint(f"a quantized checkpoint (quantization_config.quant_method={method!r}) is not "
                                    "read: jaxattn loads F32, F16, BF16 or F64 weights; dequantize it first")
    if family not in ARCHITECTURES:
        raise UnsupportedCheckpoint(f"unsupported architecture: model_type={family!r} architectures={named}; "
                                    f"supported: {sorted(ARCHITECTURES.values())}")
    if named and ARCHITECTURES[family] not in named:
        raise UnsupportedCheckpoint(f"unsupported architecture {named} for model_type={family!r}: only "
                                    f"{ARCHITECTURES[family]} (a causal LM with its head) is read")
    return family


def _reject(hf: Fields, field: str, value, why: str) -> None:
    raise UnsupportedCheckpoint(f"{ARCHITECTURES[hf['model_type']]}: {field}={value!r} is not supported ({why})")


def _gelu_approximate(hf: Fields, field: str, default: str) -> bool:
    act = hf.text(field, default)
    if act not in TANH_GELU + ERF_GELU:
        _reject(hf, field, act, f"GELU MLPs take {TANH_GELU + ERF_GELU}")
    return act in TANH_GELU


def _gated_mlp(hf: Fields) -> dict[str, Any]:
    """`mlp` and `gelu_approximate` of a gated (gate/up/down) MLP from `hidden_act`."""
    act = hf.text("hidden_act", "silu")
    if act in SILU:
        return dict(mlp="swiglu")
    if act in TANH_GELU + ERF_GELU:
        return dict(mlp="geglu", gelu_approximate=act in TANH_GELU)
    _reject(hf, "hidden_act", act, f"gated MLPs take {SILU + TANH_GELU + ERF_GELU}")


def _common(hf: Fields, *, max_positions: int, tie: bool) -> dict[str, Any]:
    return dict(vocab_size=hf.integer("vocab_size"), max_seq_len=hf.integer("max_position_embeddings", max_positions),
                tie_embeddings=hf.flag("tie_word_embeddings", tie))


def _rope(hf: Fields, **defaults) -> dict[str, Any]:
    theta, scaling = read_rope(hf, **defaults)
    return dict(positions="rope", rope_theta=theta, rope_scaling=scaling, rope_interleaved=False)


def read_gpt2(hf: Fields) -> dict[str, Any]:
    for field, ok in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                      ("reorder_and_upcast_attn", False), ("add_cross_attention", False)):
        if hf.flag(field, ok) != ok:
            _reject(hf, field, hf[field], f"jaxattn computes GPT-2 with {field}={ok}")
    d = hf.integer("n_embd", 768)
    return dict(vocab_size=hf.integer("vocab_size"), d_model=d, num_layers=hf.integer("n_layer", 12),
                num_heads=hf.integer("n_head", 12), positions="learned", max_seq_len=hf.integer("n_positions", 1024),
                norm="layernorm", norm_eps=hf.number("layer_norm_epsilon", 1e-5), mlp="gelu",
                gelu_approximate=_gelu_approximate(hf, "activation_function", "gelu_new"),
                mlp_hidden=hf.integer("n_inner", 4 * d), use_bias=True, fused_qkv=True,
                tie_embeddings=hf.flag("tie_word_embeddings", True))


def _heads(hf: Fields, head_dim_default: int | None = None) -> dict[str, Any]:
    d, n = hf.integer("hidden_size"), hf.integer("num_attention_heads")
    return dict(d_model=d, num_layers=hf.integer("num_hidden_layers"), num_heads=n,
                num_kv_heads=hf.integer("num_key_value_heads", n),
                head_dim=hf.integer("head_dim", head_dim_default or d // n))


def _layer_window(hf: Fields) -> int | None:
    """Qwen2/Qwen3: one window for every layer, or none; a mix of full and sliding layers is unsupported."""
    window = hf.integer("sliding_window", 4096, null=None) if hf.flag("use_sliding_window", False) else None
    layers, first_sliding = hf.integer("num_hidden_layers"), hf.integer("max_window_layers", 28, minimum=0)
    kinds = hf.texts("layer_types", None) or [
        "sliding_attention" if window is not None and i >= first_sliding else "full_attention"
        for i in range(layers)]
    if set(kinds) - {"full_attention", "sliding_attention"}:
        _reject(hf, "layer_types", sorted(set(kinds)), "only full_attention and sliding_attention layers exist here")
    if len(set(kinds)) > 1:
        _reject(hf, "layer_types", kinds, "a mix of full and sliding-window layers; jaxattn has one window")
    return window if kinds and kinds[0] == "sliding_attention" else None


def _llama_biases(hf: Fields) -> dict[str, bool]:
    family, attention = hf["model_type"], hf.flag("attention_bias", False)
    return {"llama": dict(qkv_bias=attention, out_bias=attention, mlp_bias=hf.flag("mlp_bias", False)),
            "mistral": dict(qkv_bias=False, out_bias=False, mlp_bias=False),
            "qwen2": dict(qkv_bias=True, out_bias=False, mlp_bias=False),  # q/k/v biases, none on o_proj
            "qwen3": dict(qkv_bias=attention, out_bias=attention, mlp_bias=False)}[family]


def _window(hf: Fields) -> int | None:
    family = hf["model_type"]
    if family == "mistral":
        kinds = hf.texts("layer_types", None)
        if kinds and len(set(kinds)) > 1:
            _reject(hf, "layer_types", kinds, "a mix of full and sliding-window layers "
                    "(transformers' Mistral ignores it); jaxattn has one window")
        return hf.integer("sliding_window", 4096, null=None)
    return _layer_window(hf) if family in ("qwen2", "qwen3") else None


def read_llama_like(hf: Fields) -> dict[str, Any]:
    """Llama 1/2/3 (and SmolLM), Mistral, Qwen2, Qwen3: RMSNorm, gated MLP, half-split RoPE."""
    family = hf["model_type"]
    max_positions = {"llama": 2048, "mistral": 131072}.get(family, 32768)
    return dict(**_common(hf, max_positions=max_positions, tie=False),
                **_heads(hf, 128 if family == "qwen3" else None), **_rope(hf), **_gated_mlp(hf),
                **_llama_biases(hf), norm="rmsnorm", norm_eps=hf.number("rms_norm_eps", 1e-6),
                mlp_hidden=hf.integer("intermediate_size"), use_bias=False, fused_qkv=False,
                sliding_window=_window(hf), qk_norm=family == "qwen3")


def read_gpt_neox(hf: Fields) -> dict[str, Any]:
    """GPT-NeoX with sequential residuals and full rotary heads (LayerNorm, plain GELU MLP, biased)."""
    if hf.flag("use_parallel_residual", True):
        _reject(hf, "use_parallel_residual", True, "jaxattn blocks are sequential: x + attn, then + mlp")
    d, n = hf.integer("hidden_size"), hf.integer("num_attention_heads")
    attention_bias = hf.flag("attention_bias", True)
    rope = _rope(hf, default_theta=hf.number("rotary_emb_base", 10000.0),
                 default_partial=hf.number("rotary_pct", 0.25))
    return dict(**_common(hf, max_positions=2048, tie=False), **rope, d_model=d,
                num_layers=hf.integer("num_hidden_layers"), num_heads=n, norm="layernorm",
                norm_eps=hf.number("layer_norm_eps", 1e-5), mlp="gelu",
                gelu_approximate=_gelu_approximate(hf, "hidden_act", "gelu"),
                mlp_hidden=hf.integer("intermediate_size", 4 * d), use_bias=True, qkv_bias=attention_bias,
                out_bias=attention_bias, mlp_bias=True, fused_qkv=True)


def _check_dense(hf: Fields, first_dense_default: int, experts_default: int) -> None:
    experts = hf.integer("n_routed_experts", experts_default, null=0, minimum=0)  # null: no experts
    first_dense = hf.integer("first_k_dense_replace", first_dense_default, minimum=0)
    every = hf.integer("moe_layer_freq", 1)
    moe = [i for i in range(hf.integer("num_hidden_layers")) if i >= first_dense and i % every == 0]
    if experts and moe:
        _reject(hf, "n_routed_experts", experts, f"layers {moe} are mixture-of-experts (first_k_dense_replace="
                f"{first_dense}, moe_layer_freq={every}); jaxattn loads dense MLP layers only")


def _mla(hf: Fields) -> MLAConfig:
    return MLAConfig(kv_lora_rank=hf.integer("kv_lora_rank", 512),
                     q_lora_rank=hf.integer("q_lora_rank", 1536, null=None),  # null: queries without a latent
                     qk_nope_head_dim=hf.integer("qk_nope_head_dim", 128),
                     qk_rope_head_dim=hf.integer("qk_rope_head_dim", 64), v_head_dim=hf.integer("v_head_dim", 128))


def read_deepseek(hf: Fields) -> dict[str, Any]:
    """DeepSeek-V2/V3 attention (MLA) with dense gated MLPs."""
    v3 = hf["model_type"] == "deepseek_v3"
    _check_dense(hf, 3 if v3 else 0, 256 if v3 else 64)
    eps = hf.number("rms_norm_eps", 1e-6)
    if eps != DEEPSEEK_LATENT_EPS:
        _reject(hf, "rms_norm_eps", eps, f"transformers' latent norms use {DEEPSEEK_LATENT_EPS}, jaxattn one eps")
    params = rope_dict(hf)
    if rope_type(params) not in ("default", "yarn") and params.number("mscale_all_dim", 0.0, positive=False):
        _reject(hf, "rope_parameters.mscale_all_dim", params["mscale_all_dim"], "a softmax mscale outside YaRN")
    bias = hf.flag("attention_bias", False)
    fields = dict(**_common(hf, max_positions=4096 if v3 else 2048, tie=False), **_rope(hf), **_gated_mlp(hf),
                  d_model=hf.integer("hidden_size"), num_layers=hf.integer("num_hidden_layers"),
                  num_heads=hf.integer("num_attention_heads"), mla=_mla(hf), norm="rmsnorm", norm_eps=eps,
                  mlp_hidden=hf.integer("intermediate_size"), use_bias=False, qkv_bias=bias, out_bias=bias,
                  mlp_bias=hf.flag("mlp_bias", False) and not v3)
    fields["rope_interleaved"] = hf.flag("rope_interleave", True) if v3 else True  # V2 is always interleaved
    return fields


READERS: dict[str, Callable[[Fields], dict[str, Any]]] = {
    "gpt2": read_gpt2, "llama": read_llama_like, "mistral": read_llama_like, "qwen2": read_llama_like,
    "qwen3": read_llama_like, "deepseek_v2": read_deepseek, "deepseek_v3": read_deepseek,
    "gpt_neox": read_gpt_neox,
}


def config_from_hf(hf: Mapping[str, Any], dtype: str = "float32") -> tuple[str, ModelConfig]:
    """`(family, ModelConfig)` computing what transformers computes for this config.json.

    `hf` is the parsed config.json, or `Fields` naming the file it came from.
    Raises UnsupportedCheckpoint (naming the architecture or field) for
    anything else, InvalidCheckpoint (naming the file and key) for a key
    that is missing or of the wrong type, and for values that make no model
    (e.g. hidden_size not divisible by num_attention_heads).
    """
    hf = hf if isinstance(hf, Fields) else Fields(hf)
    family = family_of(hf)
    try:
        fields = READERS[family](hf)
        return family, ModelConfig(**fields, dtype=dtype, param_dtype=dtype, dropout=0.0)
    except HFCheckpointError:
        raise
    except (ValueError, TypeError) as err:  # ModelConfig's and RopeScaling's own checks, e.g. divisibility
        raise InvalidCheckpoint(hf.path, None, f"describes no model jaxattn can build: {err}") from None
