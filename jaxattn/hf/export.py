"""A `ModelConfig` -> the transformers architecture and config.json that compute the same function.

`export_family` picks the one family that reproduces the config exactly, or
raises `UnsupportedCheckpoint` naming the field that no transformers
architecture matches; `hf_config` writes that family's config.json (the form
transformers 5.23 reads, checked in tests/test_hf.py by loading it with
`AutoModelForCausalLM`). The choice, in order:

| jaxattn config | exports to |
| --- | --- |
| MLA (rope, rmsnorm, gated MLP, norm_eps 1e-6) | DeepSeek-V3 (DeepSeek-V2 for MLP biases, interleaved RoPE) |
| learned positions, LayerNorm, GELU MLP, MHA | GPT-2 (zero biases where the config has none) |
| RoPE, LayerNorm, GELU MLP, MHA | GPT-NeoX (sequential residual, zero MLP and norm biases) |
| RoPE, RMSNorm, gated MLP, qk_norm | Qwen3 |
| ... with a sliding window | Mistral (no biases) or Qwen2 (q/k/v biases only) |
| RoPE, RMSNorm, gated MLP | Llama (SmolLM when tied) |

Interleaved RoPE exports to the half-split families by renaming head dims
(`jaxattn.hf.weights.half_split_columns`).
"""

from __future__ import annotations

from typing import Any

from jaxattn.config import ModelConfig
from jaxattn.hf.architectures import ARCHITECTURES, DEEPSEEK_LATENT_EPS
from jaxattn.hf.errors import UnsupportedCheckpoint
from jaxattn.hf.layouts import bias_flags
from jaxattn.hf.rope_params import write_rope


def _no(field: str, value, why: str):
    raise UnsupportedCheckpoint(f"ModelConfig.{field}={value!r} has no transformers counterpart: {why}")


def _require_mha(c: ModelConfig, family: str) -> None:
    if c.num_kv_heads != c.num_heads:
        _no("num_kv_heads", c.num_kv_heads, f"{family} has as many key/value heads as query heads")
    if c.head_dim * c.num_heads != c.d_model:
        _no("head_dim", c.head_dim, f"{family} has head_dim = d_model / num_heads")


def _require_standard(c: ModelConfig, family: str) -> None:
    """No sliding window or qk norm (only the RMSNorm families have them); a plain GELU MLP."""
    if c.sliding_window is not None:
        _no("sliding_window", c.sliding_window, f"{family} attends to the whole context")
    if c.qk_norm:
        _no("qk_norm", c.qk_norm, f"{family} has no query/key norm")
    if c.mlp != "gelu":
        _no("mlp", c.mlp, f"{family} ({c.norm}, {c.positions} positions) has a plain GELU MLP")
    _require_mha(c, family)


def _mla_family(c: ModelConfig) -> str:
    if c.positions != "rope":
        _no("positions", c.positions, "DeepSeek's MLA rotates its decoupled dims with RoPE")
    if c.norm != "rmsnorm" or c.mlp == "gelu":
        _no("norm" if c.norm != "rmsnorm" else "mlp", c.norm if c.norm != "rmsnorm" else c.mlp,
            "DeepSeek has RMSNorm and a gated MLP")
    if c.norm_eps != DEEPSEEK_LATENT_EPS:
        _no("norm_eps", c.norm_eps, f"transformers' DeepSeek latent norms use eps {DEEPSEEK_LATENT_EPS}")
    if c.sliding_window is not None:
        _no("sliding_window", c.sliding_window, "DeepSeek attends to the whole context")
    if c.mlp_bias and not c.rope_interleaved:
        _no("mlp_bias", c.mlp_bias, "DeepSeek-V2 (MLP biases) pairs RoPE dims interleaved only")
    return "deepseek_v2" if c.mlp_bias else "deepseek_v3"


def _rmsnorm_family(c: ModelConfig) -> str:
    if c.mlp == "gelu":
        _no("mlp", c.mlp, "the RMSNorm families (Llama, Mistral, Qwen) have gated MLPs (swiglu, geglu)")
    if c.qk_norm:
        if c.mlp_bias:
            _no("mlp_bias", c.mlp_bias, "Qwen3 (qk_norm) has no MLP biases")
        return "qwen3"
    if c.sliding_window is None:
        return "llama"
    if not (c.qkv_bias or c.out_bias or c.mlp_bias):
        return "mistral"
    if c.out_bias or c.mlp_bias:
        _no("out_bias" if c.out_bias else "mlp_bias", True,
            "the sliding-window families have no bias there (Mistral none, Qwen2 q/k/v only)")
    return "qwen2"


def export_family(c: ModelConfig) -> str:
    """The transformers family that computes exactly what `c` computes (UnsupportedCheckpoint if none)."""
    if c.mla is not None:
        return _mla_family(c)
    if c.positions == "learned":
        if c.norm != "layernorm":
            _no("norm", c.norm, "learned positions exist in GPT-2, which has LayerNorm")
        _require_standard(c, "GPT-2")
        return "gpt2"
    if c.positions != "rope":
        _no("positions", c.positions, "the supported architectures use learned positions (GPT-2) or RoPE")
    if c.norm == "layernorm":
        _require_standard(c, "GPT-NeoX")
        return "gpt_neox"
    return _rmsnorm_family(c)


def _gelu_name(c: ModelConfig) -> str:
    return "gelu_pytorch_tanh" if c.gelu_approximate else "gelu"


def _gpt2(c: ModelConfig) -> dict[str, Any]:
    return dict(n_embd=c.d_model, n_layer=c.num_layers, n_head=c.num_heads, n_positions=c.max_seq_len,
                n_inner=c.mlp_hidden, activation_function="gelu_new" if c.gelu_approximate else "gelu",
                layer_norm_epsilon=c.norm_eps, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False)


def _sizes(c: ModelConfig) -> dict[str, Any]:
    return dict(hidden_size=c.d_model, num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
                intermediate_size=c.mlp_hidden, max_position_embeddings=c.max_seq_len, attention_dropout=0.0)


def _gpt_neox(c: ModelConfig) -> dict[str, Any]:
    rope = dict(write_rope(c.rope_theta, c.rope_scaling), partial_rotary_factor=1.0)
    return dict(**_sizes(c), hidden_act=_gelu_name(c), layer_norm_eps=c.norm_eps, use_parallel_residual=False,
                attention_bias=bias_flags("gpt_neox", c)["qkv"], rope_parameters=rope, hidden_dropout=0.0)


def _llama_like(family: str, c: ModelConfig) -> dict[str, Any]:
    fields = dict(**_sizes(c), num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim,
                  hidden_act="silu" if c.mlp == "swiglu" else _gelu_name(c), rms_norm_eps=c.norm_eps,
                  rope_parameters=write_rope(c.rope_theta, c.rope_scaling))
    flags = bias_flags(family, c)
    if family in ("llama", "qwen3"):
        fields["attention_bias"] = flags["qkv"]
    if family == "llama":
        fields["mlp_bias"] = flags["mlp"]
    if family == "mistral":
        fields["sliding_window"] = c.sliding_window
    if family in ("qwen2", "qwen3"):
        window = c.sliding_window is not None
        fields.update(use_sliding_window=window, sliding_window=c.sliding_window, max_window_layers=0,
                      layer_types=["sliding_attention" if window else "full_attention"] * c.num_layers)
    return fields


def _deepseek(family: str, c: ModelConfig) -> dict[str, Any]:
    m = c.mla
    fields = dict(**_sizes(c), num_key_value_heads=c.num_heads, kv_lora_rank=m.kv_lora_rank,
                  q_lora_rank=m.q_lora_rank, qk_nope_head_dim=m.qk_nope_head_dim,
                  qk_rope_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim,
                  hidden_act="silu" if c.mlp == "swiglu" else _gelu_name(c), rms_norm_eps=c.norm_eps,
                  rope_parameters=write_rope(c.rope_theta, c.rope_scaling),
                  attention_bias=bias_flags(family, c)["qkv"], first_k_dense_replace=c.num_layers)
    if family == "deepseek_v3":
        fields.update(rope_interleave=c.rope_interleaved, num_nextn_predict_layers=0)
    else:
        fields["mlp_bias"] = c.mlp_bias
    return fields


def hf_config(c: ModelConfig, eos_token_id: int | None = None) -> tuple[str, dict[str, Any]]:
    """`(family, config.json dict)` of the transformers model equal to `c` (UnsupportedCheckpoint if none)."""
    family = export_family(c)
    if family == "gpt2":
        fields = _gpt2(c)
    elif family == "gpt_neox":
        fields = _gpt_neox(c)
    elif family.startswith("deepseek"):
        fields = _deepseek(family, c)
    else:
        fields = _llama_like(family, c)
    return family, dict(architectures=[ARCHITECTURES[family]], model_type=family, vocab_size=c.vocab_size,
                        **fields, tie_word_embeddings=c.tie_embeddings, dtype=c.param_dtype,
                        torch_dtype=c.param_dtype, bos_token_id=None, eos_token_id=eos_token_id,
                        pad_token_id=None, use_cache=True)
