"""One frozen dataclass describes a decoder LM; every module is built from it."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Mapping

from jaxattn.rope import RopeScaling

AttentionKind = Literal["standard", "mla"]
PositionKind = Literal["learned", "sinusoidal", "rope", "none"]
NormKind = Literal["layernorm", "rmsnorm"]
MlpKind = Literal["gelu", "swiglu"]
DType = Literal["float32", "bfloat16"]

_CHOICES = {
    "attention": ("standard", "mla"),
    "positions": ("learned", "sinusoidal", "rope", "none"),
    "norm": ("layernorm", "rmsnorm"),
    "mlp": ("gelu", "swiglu"),
    "dtype": ("float32", "bfloat16"),
    "param_dtype": ("float32", "bfloat16"),
    "mla_path": ("naive", "absorb"),
    "matmul_dtype": ("float32", "bfloat16", "auto"),
    "attention_impl": ("xla", "custom_vjp"),
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder-only LM. Defaults are nanoGPT's CPU "baby" Shakespeare model.

    Attributes:
      vocab_size: number of token ids.
      d_model: D, the residual stream width.
      num_layers: number of transformer blocks.
      num_heads: N, query heads.
      num_kv_heads: K, key/value heads (None = N: MHA; 1: MQA; between: GQA).
      head_dim: H (None = d_model // num_heads).
      attention: "standard" (MHA/MQA/GQA) or "mla" (Multi-head Latent Attention).
      kv_lora_rank: MLA latent size of the joint key/value compression.
      q_lora_rank: MLA query compression rank (None = no query compression).
      qk_nope_head_dim: MLA per-head key/query dims that carry no position.
      qk_rope_head_dim: MLA decoupled rotary dims (one rotary key shared by all heads).
      v_head_dim: MLA per-head value dim.
      mla_path: "naive" (decompress K and V) or "absorb" (attend in latent space)
        for full-sequence forward passes; cached decoding always absorbs.
      positions: "learned" (GPT-2 wpe), "sinusoidal", "rope" or "none".
      rope_theta: RoPE base.
      rope_interleaved: RoPE pairing, True = (x[2i], x[2i+1]), False = half-split.
      rope_scaling: optional context extension of RoPE.
      norm: "layernorm" or "rmsnorm" (pre-norm blocks).
      norm_eps: epsilon of the norms.
      mlp: "gelu" (Linear-GELU-Linear) or "swiglu".
      mlp_hidden: MLP hidden width (None = 4 * d_model).
      use_bias: biases in the linear layers and LayerNorm.
      fused_qkv: one QKV projection matrix instead of three (same maths).
      dropout: attention-weight and residual dropout rate (training only).
      max_seq_len: longest sequence (learned position table, cache length).
      tie_embeddings: lm_head shares the token embedding matrix.
      dtype: compute dtype; softmax and losses stay float32.
      param_dtype: parameter storage dtype.
      matmul_dtype: operand dtype of the dense projections; "bfloat16" rounds
        the operands and accumulates in float32 (`jaxattn.matmul`: ~3x faster
        on CPUs with AMX-BF16, slower on CPUs without it; reverse-mode autodiff
        only); "auto" picks by hardware when the model is built
        (`jaxattn.matmul.fast_operand_dtype`).
      attention_impl: "xla" (autodiff of the attention maths, any order and
        mode) or "custom_vjp" (hand-written backward, reverse mode only,
        faster for training; see `scaled_dot_product_attention`).
      init_std: standard deviation of the weight initialisation.
    """

    vocab_size: int = 65
    d_model: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int | None = None
    head_dim: int | None = None
    attention: AttentionKind = "standard"
    kv_lora_rank: int = 64
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    mla_path: Literal["naive", "absorb"] = "naive"
    positions: PositionKind = "learned"
    rope_theta: float = 10000.0
    rope_interleaved: bool = False
    rope_scaling: RopeScaling | None = None
    norm: NormKind = "layernorm"
    norm_eps: float = 1e-5
    mlp: MlpKind = "gelu"
    mlp_hidden: int | None = None
    use_bias: bool = False
    fused_qkv: bool = True
    dropout: float = 0.0
    max_seq_len: int = 64
    tie_embeddings: bool = True
    dtype: DType = "float32"
    param_dtype: DType = "float32"
    matmul_dtype: Literal["float32", "bfloat16", "auto"] = "float32"
    attention_impl: Literal["xla", "custom_vjp"] = "xla"
    init_std: float = 0.02

    def __post_init__(self):
        for name, choices in _CHOICES.items():
            if getattr(self, name) not in choices:
                raise ValueError(f"ModelConfig.{name} must be one of {choices}, got {getattr(self, name)!r}")
        for name in ("vocab_size", "d_model", "num_layers", "num_heads", "max_seq_len",
                     "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads={self.num_heads} must be a multiple of "
                f"num_kv_heads={self.kv_heads}")
        if self.head_dim is None and self.d_model % self.num_heads:
            raise ValueError(
                f"ModelConfig.d_model={self.d_model} is not divisible by num_heads={self.num_heads}; "
                "set head_dim explicitly")
        if self.positions == "rope" and self.attention == "standard" and self.dim_per_head % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {self.dim_per_head}")
        if self.attention == "mla" and self.qk_rope_head_dim % 2:
            raise ValueError(f"MLA's qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"ModelConfig.dropout must be in [0, 1), got {self.dropout}")

    @property
    def kv_heads(self) -> int:
        """K, the number of key/value heads."""
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def dim_per_head(self) -> int:
        """H, the head dim of standard attention."""
        return self.d_model // self.num_heads if self.head_dim is None else self.head_dim

    @property
    def hidden_dim(self) -> int:
        """The MLP hidden width."""
        return 4 * self.d_model if self.mlp_hidden is None else self.mlp_hidden

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "ModelConfig":
        """Builds a config from plain values; unknown keys are an error."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown ModelConfig keys {unknown}; known keys: {sorted(known)}")
        values = dict(values)
        if isinstance(values.get("rope_scaling"), Mapping):
            values["rope_scaling"] = RopeScaling(**values["rope_scaling"])
        return cls(**values)
