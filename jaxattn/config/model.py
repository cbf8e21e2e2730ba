"""One frozen dataclass describes a decoder LM's maths; every module is built from it.

`ModelConfig` says *what* is computed. *How* it is computed on a given machine
(which kernels run) is a separate `jaxattn.kernels.Kernels` value, so a config
and a checkpoint mean the same model on every CPU, GPU or TPU.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Mapping

from jaxattn._validate import (is_int, require_field_fraction, require_field_positive_int,
                               require_field_positive_number)
from jaxattn.config.attention import AttentionSpec, LayerKind, MLAConfig
from jaxattn.config.moe import MoEConfig
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
      moe: a `MoEConfig`: the MLP of every layer not in `dense_layers` is a mixture of
        experts (routed, and shared when it says so) instead of `mlp`; None = every MLP dense.
      dense_layers: with `moe`, the layers that keep the dense `mlp` of width `mlp_hidden`
        (DeepSeek's first_k_dense_replace and moe_layer_freq, Qwen-MoE's mlp_only_layers).
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
      scan_layers: run the repeated layers under one scan, compiled once, with their parameters
        stacked on a leading "layers" axis (`jaxattn.scan_plan`); the same maths, another
        parameter layout (`jaxattn.scan_plan.stack_params` / `unstack_params` convert).

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
    moe: MoEConfig | None = None
    dense_layers: tuple[int, ...] = ()
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
    scan_layers: bool = False

    def __post_init__(self):
        if isinstance(self.qk_norm, bool):  # older configs: a switch of the per-head norm
            object.__setattr__(self, "qk_norm", "head" if self.qk_norm else "none")
        for name, choices in _CHOICES.items():
            if getattr(self, name) not in choices:
                raise ValueError(f"ModelConfig.{name} must be one of {choices}, got {getattr(self, name)!r}")
        for name in ("vocab_size", "d_model", "num_layers", "num_heads", "max_seq_len"):
            require_field_positive_int("ModelConfig", name, getattr(self, name))
        if self.mla is not None and not isinstance(self.mla, MLAConfig):
            raise TypeError(f"ModelConfig.mla must be a jaxattn.MLAConfig or None, got {type(self.mla).__name__}")
        self._derive()
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"ModelConfig.num_heads={self.num_heads} must be a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        if self.positions == "rope" and self.mla is None and self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {self.head_dim}")
        if self.sliding_window is not None:
            require_field_positive_int("ModelConfig", "sliding_window", self.sliding_window)
        if self.qk_norm != "none" and self.mla is not None:
            raise ValueError("ModelConfig.qk_norm applies to standard attention; MLA normalises its latents instead")
        self._check_layer_features()
        self._check_moe()
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
            require_field_positive_int("ModelConfig", name, getattr(self, name))
        for name in ("use_bias", "gelu_approximate", "attn_sinks", "norm_unit_offset", "scan_layers", *_BIASES):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"ModelConfig.{name} must be true or false, got {getattr(self, name)!r}")

    def _check_layer_features(self) -> None:
        """The per-layer pattern and the newer models' switches (rotary fraction, soft caps, scales, norm
        offset, value embeddings), each with one error naming the field."""
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
        require_field_fraction("ModelConfig", "rotary_fraction", self.rotary_fraction, none_ok=False)
        for name in ("attn_logits_soft_cap", "final_logits_soft_cap", "attn_scale"):
            require_field_positive_number("ModelConfig", name, getattr(self, name))
        require_field_positive_number("ModelConfig", "embed_multiplier", self.embed_multiplier, none_ok=False)
        if self.norm_unit_offset and self.norm != "rmsnorm":
            raise ValueError(f"ModelConfig.norm_unit_offset scales RMSNorm by (1 + w); norm={self.norm!r}")
        fractions = {self.rotary_fraction} | {k.rotary_fraction for k in pattern if k.rotary_fraction is not None}
        if self.mla is not None and fractions != {1.0}:
            raise ValueError(f"ModelConfig.rotary_fraction applies to standard attention; MLA's rotary dims are "
                             f"already separate (mla.qk_rope_head_dim), got rotary_fraction {sorted(fractions)}")
        E, mla = self.value_embeddings, self.mla is not None
        if not is_int(E, numpy=False) or not 0 <= 2 * E <= self.num_layers or (E and mla):
            raise ValueError(f"ModelConfig.value_embeddings must be an integer with 0 <= 2 * value_embeddings <= "
                             f"num_layers={self.num_layers}, and 0 with MLA (mla is {'set' if mla else 'None'}: "
                             f"its values come from the latent), got {E!r}")
        if self.positions == "rope" and self.mla is None:
            for fraction in fractions:
                if rotary_dims(self.head_dim, fraction) == 0:
                    raise ValueError(f"ModelConfig.rotary_fraction={fraction} of head_dim={self.head_dim} "
                                     "rotates no pair of dims")

    def _check_moe(self) -> None:
        if self.moe is not None and not isinstance(self.moe, MoEConfig):
            raise TypeError(f"ModelConfig.moe must be a jaxattn.MoEConfig or None, got {type(self.moe).__name__}")
        layers = self.dense_layers
        if isinstance(layers, list):
            object.__setattr__(self, "dense_layers", layers := tuple(layers))
        if not isinstance(layers, tuple) or any(not is_int(i, numpy=False) or not 0 <= i < self.num_layers
                                                for i in layers) \
                or list(layers) != sorted(set(layers)) or (layers and self.moe is None):
            raise ValueError(f"ModelConfig.dense_layers must be increasing distinct layers in [0, num_layers="
                             f"{self.num_layers}), and empty without moe, got {layers!r}")

    def layer_is_moe(self, i: int) -> bool:
        """Whether layer i's MLP is a mixture of experts (`moe` set and i not in `dense_layers`)."""
        return self.moe is not None and i not in self.dense_layers

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The layers whose MLP is a mixture of experts (empty: a dense model)."""
        return tuple(i for i in range(self.num_layers) if self.layer_is_moe(i))

    @property
    def idle_expert_params(self) -> int:
        """The routed experts' parameters one token does not touch: in each MoE layer, the E - K
        experts it is not sent to (0 for a dense model)."""
        if self.moe is None:
            return 0
        m = self.moe
        return len(self.moe_layers) * (m.num_experts - m.experts_per_token) * m.expert_params(self.d_model)

    def layer_attention(self, i: int) -> AttentionSpec:
        """Layer i's attention: the model's settings with `layer_pattern[i % len]` applied."""
        if not is_int(i, numpy=False) or not 0 <= i < self.num_layers:
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
        if not is_int(layer, numpy=False) or not 0 <= layer < L:
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
        if isinstance(values.get("moe"), Mapping):
            values["moe"] = MoEConfig.upgrade(values["moe"])
        for name, kind in (("rope_scaling", RopeScaling), ("mla", MLAConfig), ("moe", MoEConfig)):
            if isinstance(values.get(name), Mapping):
                values[name] = kind(**values[name])
        if isinstance(values.get("layer_pattern"), (list, tuple)):
            values["layer_pattern"] = tuple(LayerKind(**kind) if isinstance(kind, Mapping) else kind
                                            for kind in values["layer_pattern"])
        return cls(**values)
