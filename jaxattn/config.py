"""One frozen dataclass describes a decoder LM's maths; every module is built from it.

`ModelConfig` says *what* is computed. *How* it is computed on a given machine
(which kernels run) is a separate `jaxattn.kernels.Kernels` value, so a config
and a checkpoint mean the same model on every CPU, GPU or TPU.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal, Mapping

from jaxattn.rope import RopeScaling, rotary_dims

PositionKind = Literal["learned", "sinusoidal", "rope", "none"]
NormKind = Literal["layernorm", "rmsnorm"]
MlpKind = Literal["gelu", "relu2", "swiglu", "geglu"]
DType = Literal["float32", "bfloat16"]
QkNormKind = Literal["none", "head", "full"]
ResidualKind = Literal["sequential", "parallel"]
NormPlacement = Literal["pre", "sandwich", "post"]

_CHOICES = {
    "positions": ("learned", "sinusoidal", "rope", "none"),
    "norm": ("layernorm", "rmsnorm"),
    "mlp": ("gelu", "relu2", "swiglu", "geglu"),
    "dtype": ("float32", "bfloat16"),
    "param_dtype": ("float32", "bfloat16"),
    "qk_norm": ("none", "head", "full"),
    "residual": ("sequential", "parallel"),
    "norm_placement": ("pre", "sandwich", "post"),
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


def _require_positive_number(owner: str, name: str, value, *, none_ok: bool = True) -> None:
    if value is None and none_ok:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{owner}.{name} must be a positive number{' or None' if none_ok else ''}, got {value!r}")


def _require_fraction(owner: str, name: str, value, *, none_ok: bool) -> None:
    if value is None and none_ok:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
        raise ValueError(f"{owner}.{name} must be a number in (0, 1]{' or None' if none_ok else ''}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class LayerKind:
    """What may differ between the layers of one model (docs/theory.md §21); None = the model's setting.

    Attributes:
      local: True = a sliding-window layer of `ModelConfig.sliding_window` W (the
        query and the W - 1 tokens before it); False = a global layer.
      rope: False = a layer without positions (NoPE, SmolLM3 and Llama 4 every k-th layer).
      rope_theta: this layer's RoPE base (Gemma 3: 10 000 local, 1 000 000 global).
      rope_scaling: this layer's scaling; "none" = unscaled (Gemma 3's local layers).
      rotary_fraction: the part of each head that is rotated.
    """

    local: bool = False
    rope: bool = True
    rope_theta: float | None = None
    rope_scaling: RopeScaling | Literal["none"] | None = None
    rotary_fraction: float | None = None

    def __post_init__(self):
        for name in ("local", "rope"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"LayerKind.{name} must be true or false, got {getattr(self, name)!r}")
        _require_positive_number("LayerKind", "rope_theta", self.rope_theta)
        if isinstance(self.rope_scaling, Mapping):
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        if not (self.rope_scaling is None or self.rope_scaling == "none" or isinstance(self.rope_scaling, RopeScaling)):
            raise TypeError(f"LayerKind.rope_scaling must be a jaxattn.RopeScaling, \"none\" or None, "
                            f"got {self.rope_scaling!r}")
        _require_fraction("LayerKind", "rotary_fraction", self.rotary_fraction, none_ok=True)


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """One layer's attention, resolved from the model's settings and its `LayerKind` (`ModelConfig.layer_attention`).

    Attributes:
      window: W for a sliding-window layer (the query and W - 1 tokens back), None for a global one.
      rope: RoPE is applied (positions == "rope" and the kind's `rope`).
      rope_theta, rope_scaling, rotary_fraction: the RoPE of this layer (meaningless without `rope`;
        rope_scaling is None there).
      logits_soft_cap: c of `c * tanh(logits / c)` on the attention logits, or None.
      sinks: the layer has a learned sink logit per query head.
    """

    window: int | None
    rope: bool
    rope_theta: float
    rope_scaling: RopeScaling | None
    rotary_fraction: float
    logits_soft_cap: float | None
    sinks: bool


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
      norm: "layernorm" or "rmsnorm" (the norms of the blocks and the final norm).
      norm_eps: epsilon of the norms.
      mlp: "gelu" (Linear-GELU-Linear), "relu2" (Linear-ReLU²-Linear, relu(x)**2: the
        modded-nanoGPT speedrun's; docs/theory.md §23), "swiglu" (silu(x W_gate) * x W_up,
        then W_down) or "geglu" (the same gated MLP with GELU).
      gelu_approximate: every GELU in the tanh form (GPT-2's "gelu_new") when True,
        the exact erf form (Hugging Face's "gelu") when False.
      mlp_hidden: MLP hidden width (None = 4 * d_model).
      use_bias: biases in the linear layers and LayerNorm; `qkv_bias`, `out_bias`
        and `mlp_bias` (None = follow `use_bias`) override it per projection group:
        queries/keys/values (MLA: the down-projections `wq_a`, `wkv_a`), the
        attention output, the MLP (Qwen2: q/k/v biases only).
      qk_norm: RMSNorm of queries and keys after projection, before RoPE; standard
        attention only. "head": over each head's H dims (scale [H], Qwen3, Gemma 3);
        "full": over the whole N*H query and K*H key projection before the head
        split (OLMo 2); "none". true/false (older configs) read as "head"/"none".
      sliding_window: None, or W: each query sees itself and the W - 1 tokens
        before it (Mistral), in whole sequences and in cached decoding. With a
        `layer_pattern`, the window of its local layers only.
      layer_pattern: per-layer `LayerKind`s, layer i being `layer_pattern[i % len]`
        (a repeating period: Gemma 3's five local and one global layer is six
        kinds). Empty: every layer alike, local exactly when `sliding_window` is set.
      rotary_fraction: RoPE on the first int(H * f) dims of each head (rounded
        down to even), the rest passed through (Pythia 0.25, Phi-3; docs/theory.md §19).
      attn_logits_soft_cap: c: attention logits become c * tanh(logits / c) (Gemma 2;
        docs/theory.md §17).
      final_logits_soft_cap: c: the output logits likewise (Gemma 2), in float32.
      attn_scale: the softmax scale (None = 1/sqrt(H), MLA 1/sqrt(P+E); Gemma:
        query_pre_attn_scalar ** -0.5); YaRN's factor still multiplies it.
      attn_sinks: one learned logit per query head (`sinks` [N]) in every
        softmax's denominator (GPT-OSS; docs/theory.md §18).
      residual: "sequential" (x + attn, then + mlp) or "parallel"
        (x + attn(attn_norm(x)) + mlp(mlp_norm(x)), GPT-NeoX).
      norm_placement: "pre" x + f(norm(x)); "sandwich" x + post_norm(f(pre_norm(x)))
        (Gemma 2/3); "post" x + post_norm(f(x)), no pre-norm (OLMo 2) (docs/theory.md §20).
      norm_unit_offset: every RMSNorm scales by (1 + w), w initialised to 0 (Gemma).
      embed_multiplier: token embeddings times this, in the compute dtype (Gemma: sqrt(D)).
      fused_qkv: one QKV projection matrix instead of three (same maths).
      dropout: attention-weight and residual dropout rate (training only).
      max_seq_len: longest sequence (learned position table, cache length).
      tie_embeddings: lm_head shares the token embedding matrix.
      dtype: compute dtype; softmax and losses stay float32.
      param_dtype: parameter storage dtype.
      init_std: standard deviation of the weight initialisation.
      zero_init_out: the matrices that write into the residual stream (attention and MLP
        output projections) and an untied lm_head start at zero (docs/theory.md §23): each
        block starts as the identity and the first logits are uniform.
      value_embeddings: E token tables `[V, K*H]` mixed into the values of the first and last E
        layers (modded-nanoGPT; docs/theory.md §23): v = lam_0 v + lam_1 table[token], layer i's
        table `value_embedding_table(i)`; 0 <= 2E <= num_layers, standard attention only.

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
    qk_norm: QkNormKind | bool = "none"
    sliding_window: int | None = None
    layer_pattern: tuple[LayerKind, ...] = ()
    rotary_fraction: float = 1.0
    attn_logits_soft_cap: float | None = None
    final_logits_soft_cap: float | None = None
    attn_scale: float | None = None
    attn_sinks: bool = False
    residual: ResidualKind = "sequential"
    norm_placement: NormPlacement = "pre"
    norm_unit_offset: bool = False
    embed_multiplier: float = 1.0
    fused_qkv: bool = True
    dropout: float = 0.0
    max_seq_len: int = 64
    tie_embeddings: bool = True
    dtype: DType = "float32"
    param_dtype: DType = "float32"
    init_std: float = 0.02
    zero_init_out: bool = False
    value_embeddings: int = 0

    def __post_init__(self):
        if isinstance(self.qk_norm, bool):  # older configs: a switch of the per-head norm
            object.__setattr__(self, "qk_norm", "head" if self.qk_norm else "none")
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
        if self.qk_norm != "none" and self.mla is not None:
            raise ValueError("ModelConfig.qk_norm applies to standard attention; MLA normalises its latents instead")
        self._check_layer_features()
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
        for name in ("use_bias", "gelu_approximate", "attn_sinks", "norm_unit_offset", *_BIASES):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"ModelConfig.{name} must be true or false, got {getattr(self, name)!r}")

    def _check_layer_features(self) -> None:
        """The per-layer pattern and the features of issue 22, each with one error naming the field."""
        pattern = self.layer_pattern
        if isinstance(pattern, list):
            object.__setattr__(self, "layer_pattern", pattern := tuple(pattern))
        if not isinstance(pattern, tuple) or not all(isinstance(kind, LayerKind) for kind in pattern):
            raise TypeError(f"ModelConfig.layer_pattern must be a tuple of jaxattn.LayerKind, got {pattern!r}")
        if pattern and any(kind.local for kind in pattern) != (self.sliding_window is not None):
            raise ValueError(
                "ModelConfig.layer_pattern has local layers but sliding_window is None; set it to their window"
                if self.sliding_window is None else
                f"ModelConfig.sliding_window={self.sliding_window} but no kind of layer_pattern is local; "
                "mark the local layers LayerKind(local=True) or set sliding_window to None")
        _require_fraction("ModelConfig", "rotary_fraction", self.rotary_fraction, none_ok=False)
        for name in ("attn_logits_soft_cap", "final_logits_soft_cap", "attn_scale"):
            _require_positive_number("ModelConfig", name, getattr(self, name))
        _require_positive_number("ModelConfig", "embed_multiplier", self.embed_multiplier, none_ok=False)
        if self.norm_unit_offset and self.norm != "rmsnorm":
            raise ValueError(f"ModelConfig.norm_unit_offset scales RMSNorm by (1 + w); norm={self.norm!r}")
        fractions = {self.rotary_fraction} | {k.rotary_fraction for k in pattern if k.rotary_fraction is not None}
        if self.mla is not None and fractions != {1.0}:
            raise ValueError(f"ModelConfig.rotary_fraction applies to standard attention; MLA's rotary dims are "
                             f"already separate (mla.qk_rope_head_dim), got rotary_fraction {sorted(fractions)}")
        E, mla = self.value_embeddings, self.mla is not None
        if isinstance(E, bool) or not isinstance(E, int) or not 0 <= 2 * E <= self.num_layers or (E and mla):
            raise ValueError(f"ModelConfig.value_embeddings must be an integer with 0 <= 2 * value_embeddings <= "
                             f"num_layers={self.num_layers}, and 0 with MLA (mla is {'set' if mla else 'None'}: "
                             f"its values come from the latent), got {E!r}")
        if self.positions == "rope" and self.mla is None:
            for fraction in fractions:
                if rotary_dims(self.head_dim, fraction) == 0:
                    raise ValueError(f"ModelConfig.rotary_fraction={fraction} of head_dim={self.head_dim} "
                                     "rotates no pair of dims")

    def layer_attention(self, i: int) -> AttentionSpec:
        """Layer i's attention: the model's settings with `layer_pattern[i % len]` applied."""
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.num_layers:
            raise ValueError(f"layer must be an integer in [0, num_layers={self.num_layers}), got {i!r}")
        pattern = self.layer_pattern
        kind = pattern[i % len(pattern)] if pattern else LayerKind(local=self.sliding_window is not None)
        rope = self.positions == "rope" and kind.rope
        pick = lambda own, model: model if own is None else own  # noqa: E731
        scaling = pick(kind.rope_scaling, self.rope_scaling)
        return AttentionSpec(
            window=self.sliding_window if kind.local else None, rope=rope,
            rope_theta=pick(kind.rope_theta, self.rope_theta),
            rope_scaling=None if not rope or scaling == "none" else scaling,
            rotary_fraction=pick(kind.rotary_fraction, self.rotary_fraction),
            logits_soft_cap=self.attn_logits_soft_cap, sinks=self.attn_sinks)

    def value_embedding_table(self, layer: int) -> int | None:
        """The value-embedding table of `layer` (U-net sharing): i for i < E, i - (L - E) for i >= L - E, else None."""
        E, L = self.value_embeddings, self.num_layers
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < L:
            raise ValueError(f"layer must be an integer in [0, num_layers={L}), got {layer!r}")
        return layer if layer < E else layer - (L - E) if layer >= L - E else None

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
        if isinstance(values.get("layer_pattern"), (list, tuple)):
            values["layer_pattern"] = tuple(LayerKind(**kind) if isinstance(kind, Mapping) else kind
                                            for kind in values["layer_pattern"])
        return cls(**values)
