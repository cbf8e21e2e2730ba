"""One frozen dataclass describes a decoder LM's maths; every module is built from it.

`ModelConfig` says *what* is computed. *How* it is computed on a given machine
(which kernels run) is a separate `jaxattn.kernels.Kernels` value, so a config
and a checkpoint mean the same model on every CPU, GPU or TPU.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Mapping

from jaxattn.rope import RopeScaling

PositionKind = Literal["learned", "sinusoidal", "rope", "none"]
NormKind = Literal["layernorm", "rmsnorm"]
MlpKind = Literal["gelu", "swiglu", "geglu"]
DType = Literal["float32", "bfloat16"]

_CHOICES = {
    "positions": ("learned", "sinusoidal", "rope", "none"),
    "norm": ("layernorm", "rmsnorm"),
    "mlp": ("gelu", "swiglu", "geglu"),
    "dtype": ("float32", "bfloat16"),
    "param_dtype": ("float32", "bfloat16"),
}
# Fields that None derives from others; `replace` derives them again unless they are given.
_DERIVED = ("num_kv_heads", "head_dim", "mlp_hidden", "qkv_bias", "out_bias", "mlp_bias")
_BIASES = ("qkv_bias", "out_bias", "mlp_bias")


def _require_positive_int(owner: str, name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{owner}.{name} must be a positive integer, got {value!r}")


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """Multi-head Latent Attention's sizes (DeepSeek-V2/V3, docs/theory.md §6).

    Attributes:
      kv_lora_rank: R, the joint key/value latent (what the cache stores per token, with E).
      q_lora_rank: Q, the query compression rank (None = queries projected directly).
      qk_nope_head_dim: P, per-head query/key dims that carry no position.
      qk_rope_head_dim: E, the decoupled rotary dims (one rotary key shared by all heads).
      v_head_dim: per-head value dim.
    """

    kv_lora_rank: int = 64
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32

    def __post_init__(self):
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            _require_positive_int("MLAConfig", name, getattr(self, name))
        if self.q_lora_rank is not None:
            _require_positive_int("MLAConfig", "q_lora_rank", self.q_lora_rank)
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"MLAConfig.qk_rope_head_dim must be even (RoPE rotates pairs), "
                             f"got {self.qk_rope_head_dim}")

    def replace(self, **changes) -> "MLAConfig":
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder-only LM. Defaults are nanoGPT's CPU "baby" Shakespeare model.

    Attributes:
      vocab_size: number of token ids.
      d_model: D, the residual stream width.
      num_layers: number of transformer blocks.
      num_heads: N, query heads.
      num_kv_heads: K, key/value heads: N is MHA, 1 MQA, between GQA (None = N).
      head_dim: H, the head dim of standard attention (None = d_model // num_heads).
      mla: Multi-head Latent Attention's sizes; None = standard attention (MHA/MQA/GQA).
      positions: "learned" (GPT-2 wpe), "sinusoidal", "rope" or "none".
      rope_theta: RoPE base.
      rope_interleaved: RoPE pairing, True = (x[2i], x[2i+1]), False = half-split.
      rope_scaling: optional context extension of RoPE.
      norm: "layernorm" or "rmsnorm" (pre-norm blocks).
      norm_eps: epsilon of the norms.
      mlp: "gelu" (Linear-GELU-Linear), "swiglu" (silu(x W_gate) * x W_up, then W_down)
        or "geglu" (the same gated MLP with GELU).
      gelu_approximate: every GELU in the tanh form (GPT-2's "gelu_new") when True,
        the exact erf form (Hugging Face's "gelu") when False.
      mlp_hidden: MLP hidden width (None = 4 * d_model).
      use_bias: biases in the linear layers and LayerNorm; `qkv_bias`, `out_bias`
        and `mlp_bias` (None = follow `use_bias`) override it per projection group:
        queries/keys/values (MLA: the down-projections `wq_a`, `wkv_a`), the
        attention output, the MLP (Qwen2: q/k/v biases only).
      qk_norm: RMSNorm (own scale per head dim) on every query and key head after
        projection, before RoPE (Qwen3); standard attention only.
      sliding_window: None, or W: each query sees itself and the W - 1 tokens
        before it (Mistral), in whole sequences and in cached decoding.
      fused_qkv: one QKV projection matrix instead of three (same maths).
      dropout: attention-weight and residual dropout rate (training only).
      max_seq_len: longest sequence (learned position table, cache length).
      tie_embeddings: lm_head shares the token embedding matrix.
      dtype: compute dtype; softmax and losses stay float32.
      param_dtype: parameter storage dtype.
      init_std: standard deviation of the weight initialisation.

    `num_kv_heads`, `head_dim`, `mlp_hidden` and the three bias switches given as
    None are derived when the config is built, so they always read as integers
    and booleans; `replace` derives them again from the new values unless they
    are given explicitly.
    """

    vocab_size: int = 65
    d_model: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int | None = None
    head_dim: int | None = None
    mla: MLAConfig | None = None
    positions: PositionKind = "learned"
    rope_theta: float = 10000.0
    rope_interleaved: bool = False
    rope_scaling: RopeScaling | None = None
    norm: NormKind = "layernorm"
    norm_eps: float = 1e-5
    mlp: MlpKind = "gelu"
    gelu_approximate: bool = True
    mlp_hidden: int | None = None
    use_bias: bool = False
    qkv_bias: bool | None = None
    out_bias: bool | None = None
    mlp_bias: bool | None = None
    qk_norm: bool = False
    sliding_window: int | None = None
    fused_qkv: bool = True
    dropout: float = 0.0
    max_seq_len: int = 64
    tie_embeddings: bool = True
    dtype: DType = "float32"
    param_dtype: DType = "float32"
    init_std: float = 0.02

    def __post_init__(self):
        for name, choices in _CHOICES.items():
            if getattr(self, name) not in choices:
                raise ValueError(f"ModelConfig.{name} must be one of {choices}, got {getattr(self, name)!r}")
        for name in ("vocab_size", "d_model", "num_layers", "num_heads", "max_seq_len"):
            _require_positive_int("ModelConfig", name, getattr(self, name))
        if self.mla is not None and not isinstance(self.mla, MLAConfig):
            raise TypeError(f"ModelConfig.mla must be a jaxattn.MLAConfig or None, got {type(self.mla).__name__}")
        self._derive()
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"ModelConfig.num_heads={self.num_heads} must be a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        if self.positions == "rope" and self.mla is None and self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {self.head_dim}")
        if self.sliding_window is not None:
            _require_positive_int("ModelConfig", "sliding_window", self.sliding_window)
        if self.qk_norm and self.mla is not None:
            raise ValueError("ModelConfig.qk_norm applies to standard attention; MLA normalises its latents instead")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"ModelConfig.dropout must be in [0, 1), got {self.dropout}")

    def _derive(self) -> None:
        """Fills the None-means-derived fields and remembers which were derived."""
        derived = frozenset(name for name in _DERIVED if getattr(self, name) is None)
        object.__setattr__(self, "_derived_fields", derived)  # not a field: not compared or saved
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        if self.head_dim is None:
            if self.d_model % self.num_heads:
                raise ValueError(f"ModelConfig.d_model={self.d_model} is not divisible by "
                                 f"num_heads={self.num_heads}; set head_dim explicitly")
            object.__setattr__(self, "head_dim", self.d_model // self.num_heads)
        if self.mlp_hidden is None:
            object.__setattr__(self, "mlp_hidden", 4 * self.d_model)
        for name in _BIASES:
            if getattr(self, name) is None:
                object.__setattr__(self, name, self.use_bias)
        for name in ("num_kv_heads", "head_dim", "mlp_hidden"):
            _require_positive_int("ModelConfig", name, getattr(self, name))
        for name in ("use_bias", "gelu_approximate", "qk_norm", *_BIASES):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"ModelConfig.{name} must be true or false, got {getattr(self, name)!r}")

    @property
    def attention(self) -> Literal["standard", "mla"]:
        """"mla" when `mla` is set, else "standard" (MHA/MQA/GQA)."""
        return "standard" if self.mla is None else "mla"

    def replace(self, **changes) -> "ModelConfig":
        """A copy with `changes`; fields that were derived are derived again from the new values."""
        again = {name: None for name in self._derived_fields if name not in changes}
        return dataclasses.replace(self, **again, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "ModelConfig":
        """Builds a config from plain values (as `to_dict` writes them); unknown keys are an error."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown ModelConfig keys {unknown}; known keys: {sorted(known)}")
        values = dict(values)
        for name, kind in (("rope_scaling", RopeScaling), ("mla", MLAConfig)):
            if isinstance(values.get(name), Mapping):
                values[name] = kind(**values[name])
        return cls(**values)
