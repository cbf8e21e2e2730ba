"""Flax building blocks every layer is made of: linear maps, norms and the MLP.

Every module is built from one `ModelConfig` (the maths) and one
`jaxattn.kernels.Kernels` (which implementations run; the default is the
reference). Dense projections run as 2-D matmuls on `[B*T, D]`.

Every parameter carries the logical names of its axes (`nn.with_logical_partitioning`
through `logical`; the names are `jaxattn.axes`'s constants: "embed", "heads",
"kv_heads", "qkv", "head_dim", "mlp", "vocab", "latent", "expert", "position"),
so `init` returns `nn.LogicallyPartitioned` boxes (`nn.unbox` gives the arrays;
`apply` takes either). `jaxattn.axes.RULES` maps the names onto a device mesh.
The attention layers built from these are `jaxattn.layers.gqa` and `jaxattn.layers.mla`
(their shared steps: `jaxattn.layers.attention_layer`).
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxattn import kernels as kernels_lib
from jaxattn import axes
from jaxattn.config import ModelConfig
from jaxattn.kernels import Kernels
from jaxattn.lora import is_lora, is_slots, lora_delta, slot_delta
from jaxattn.quantization import is_quantized


def residual_init_std(config: ModelConfig) -> float:
    """nanoGPT/GPT-2: projections into the residual stream get std / sqrt(2 * layers)."""
    return config.init_std / math.sqrt(2 * config.num_layers)


def leading_ones(v: jnp.ndarray, ndim: int) -> jnp.ndarray:
    """`v` with leading axes of size 1 up to `ndim` axes: broadcasting made explicit, as the library is
    rank-promotion clean (`jax.numpy_rank_promotion("raise")` accepts it)."""
    return v.reshape((1,) * (ndim - v.ndim) + v.shape)


def logical(init, *names: str | None):
    """`init` whose output carries the logical axis names `names` (one per axis; keys of
    `jaxattn.axes.RULES`, or None for an axis never split)."""
    return nn.with_logical_partitioning(init, names)


class Linear(nn.Module):
    """`y = x W + b` with `W [D_in, features]`, computed as one 2-D matmul.

    Attributes:
      features: output width.
      axes: logical names of W's (input, output) axes; the bias has the output's.
      use_bias: add a bias (initialised to zeros).
      init_std: the kernel is initialised normal(0, init_std).
      dtype: compute dtype; param_dtype: storage dtype.
      matmul: a name of `jaxattn.kernels.choices("matmul")`: "xla" multiplies
        in `dtype` with float32 sums, "bfloat16"/"bfloat16_cpu" round both
        operands to bfloat16 (docs/theory.md §15).
      quantized: a name of `jaxattn.kernels.choices("quantized")`, the matmul that runs when the
        given kernel is a `jaxattn.quantization.QuantizedWeight` (`jaxattn.quantization.quantize`).

    A kernel given as a `jaxattn.lora.LoraWeight` (`jaxattn.lora.add_lora`) runs its base as above
    (float or quantized) plus the low-rank delta `scale * (dropout(x) a) b` of each adapted part, zeros
    elsewhere; the adapters' dropout runs only when the module has a "dropout" rng (see `jaxattn.lora`).
    A kernel given as a `jaxattn.lora.LoraSlots` (`jaxattn.lora.empty_slots`) runs its base likewise plus
    `jaxattn.lora.slot_delta`: each token row's own adapter, chosen by its slot (none for -1).
    """

    features: int
    axes: tuple[str | None, str | None] = (None, None)
    use_bias: bool = False
    init_std: float = 0.02
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    matmul: str = "xla"
    quantized: str = "xla"

    @nn.compact
    def __call__(self, x: jnp.ndarray, columns: slice | None = None) -> jnp.ndarray:
        """`[..., D_in] -> [..., features]`, or only the output `columns` of W (cross-attention)."""
        columns = slice(None) if columns is None else columns
        rows = x.reshape(-1, x.shape[-1]).astype(self.dtype)  # [B*T, D_in]
        # A quantized kernel is read as given: flax's param would compare its packed shape with W's.
        stored = self.get_variable("params", "kernel") if self.has_variable("params", "kernel") else None
        if is_lora(stored):
            # A dropout rng (training with dropout on) drops the adapters' input, as PEFT's lora_dropout.
            key = self.make_rng("dropout") if stored.dropout > 0 and self.has_rng("dropout") else None
            delta = lora_delta(rows, stored, kernels_lib.matmul_kernel(self.matmul), key)  # [B*T, out]
            y = (self._frozen(rows, stored.base) + delta)[:, columns]  # [B*T, features]
        elif is_slots(stored):  # each token row its own adapter, or none
            y = (self._frozen(rows, stored.base) + slot_delta(rows, stored))[:, columns]  # [B*T, features]
        elif is_quantized(stored):
            matmul = kernels_lib.quantized_matmul_kernel(self.quantized)
            y = matmul(rows, stored)[:, columns].astype(self.dtype)  # [B*T, features]
        else:
            kernel = self.param("kernel", logical(nn.initializers.normal(self.init_std), *self.axes),
                                (x.shape[-1], self.features), self.param_dtype)
            matmul = kernels_lib.matmul_kernel(self.matmul)
            y = matmul(rows, kernel[:, columns].astype(self.dtype)).astype(self.dtype)  # [B*T, features]
        if self.use_bias:
            bias = self.param("bias", logical(nn.initializers.zeros, self.axes[1]), (self.features,),
                              self.param_dtype)
            y = y + bias[None, columns].astype(self.dtype)  # [1, features]
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def _frozen(self, rows: jnp.ndarray, base) -> jnp.ndarray:
        """`rows [M, D_in]` times an adapted kernel's frozen base (float or quantized) -> `[M, out]`."""
        if is_quantized(base):
            return kernels_lib.quantized_matmul_kernel(self.quantized)(rows, base).astype(self.dtype)
        return kernels_lib.matmul_kernel(self.matmul)(rows, base.astype(self.dtype)).astype(self.dtype)


class RMSNorm(nn.Module):
    """`x / rms(x) * scale`, statistics in float32; `axis`: the logical name of the scale's axis.

    `unit_offset`: scales by `(1 + scale)` instead, the scale initialised to 0 (Gemma;
    docs/theory.md §20), so a fresh norm is the identity scaling either way.
    """

    eps: float = 1e-6
    axis: str | None = axes.EMBED
    unit_offset: bool = False
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        init = nn.initializers.zeros if self.unit_offset else nn.initializers.ones
        scale = self.param("scale", logical(init, self.axis), (x.shape[-1],), self.param_dtype)
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        scale = leading_ones(scale.astype(jnp.float32), y.ndim)  # [1, ..., 1, D]
        return (y * (1.0 + scale if self.unit_offset else scale)).astype(self.dtype)


class LayerNorm(nn.Module):
    """`(x - mean) / std * scale (+ bias)`, statistics in float32."""

    eps: float = 1e-5
    use_bias: bool = True
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        scale = self.param("scale", logical(nn.initializers.ones, axes.EMBED), (x.shape[-1],), self.param_dtype)
        xf = x.astype(jnp.float32)
        mean = jnp.mean(xf, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
        y = (xf - mean) * jax.lax.rsqrt(var + self.eps) * leading_ones(scale.astype(jnp.float32), xf.ndim)
        if self.use_bias:
            bias = self.param("bias", logical(nn.initializers.zeros, axes.EMBED), (x.shape[-1],), self.param_dtype)
            y = y + leading_ones(bias.astype(jnp.float32), y.ndim)
        return y.astype(self.dtype)


def make_norm(config: ModelConfig, name: str | None = None) -> nn.Module:
    """The config's norm of the residual stream (the blocks' norms and the final norm)."""
    if config.norm == "rmsnorm":
        return make_rms_norm(config, axes.EMBED, name=name)
    dtypes = dict(dtype=jnp.dtype(config.dtype), param_dtype=jnp.dtype(config.param_dtype))
    return LayerNorm(eps=config.norm_eps, use_bias=config.use_bias, name=name, **dtypes)


def make_rms_norm(config: ModelConfig, axis: str | None, name: str | None = None) -> RMSNorm:
    """An RMSNorm with the config's eps, dtypes and `norm_unit_offset` (every RMSNorm of a model:
    the blocks', q/k norms, MLA's latent norms), its scale's axis named `axis`."""
    return RMSNorm(eps=config.norm_eps, axis=axis, unit_offset=config.norm_unit_offset, name=name,
                   dtype=jnp.dtype(config.dtype), param_dtype=jnp.dtype(config.param_dtype))


def make_linear(config: ModelConfig, kernels: Kernels, features: int, axes: tuple[str | None, str | None], *,
                residual: bool = False, use_bias: bool | None = None, name: str | None = None) -> Linear:
    """A `Linear` with the config's dtypes and init (`residual`: a projection into the residual
    stream, initialised scaled down, or to zero with `zero_init_out`), the kernels' matmul
    and W's logical axis names `axes` (input, output)."""
    return Linear(features, axes=tuple(axes), use_bias=config.use_bias if use_bias is None else use_bias,
                  init_std=(0.0 if config.zero_init_out else residual_init_std(config)) if residual
                  else config.init_std,
                  dtype=jnp.dtype(config.dtype), param_dtype=jnp.dtype(config.param_dtype),
                  matmul=kernels.matmul, quantized=kernels.quantized, name=name)


class MLP(nn.Module):
    """Plain (`c_fc`, act, `c_proj`) or gated (`gate_up`, act(gate) * up, `down`) MLP, then dropout.

    `config.mlp`: "gelu" plain, "relu2" plain with relu(x)**2, "swiglu" gated with SiLU,
    "geglu" gated with GELU;
    GELU is the tanh form when `config.gelu_approximate`, else the exact erf form.
    Biases when `config.mlp_bias`.
    """

    config: ModelConfig
    kernels: Kernels = Kernels()

    def setup(self):
        c, k = self.config, self.kernels
        bias = dict(use_bias=c.mlp_bias)
        if self.gated:
            # One matmul for both; "mlp" is then [gate | up], so a split over the tensor axis is not
            # aligned to the halves (still exact: XLA moves the data, docs/theory.md §16).
            self.gate_up = make_linear(c, k, 2 * c.mlp_hidden, (axes.EMBED, axes.MLP), **bias)
            self.down = make_linear(c, k, c.d_model, (axes.MLP, axes.EMBED), residual=True, **bias)
        else:
            self.c_fc = make_linear(c, k, c.mlp_hidden, (axes.EMBED, axes.MLP), **bias)
            self.c_proj = make_linear(c, k, c.d_model, (axes.MLP, axes.EMBED), residual=True, **bias)
        self.dropout = nn.Dropout(c.dropout)

    @property
    def gated(self) -> bool:
        return self.config.mlp in ("swiglu", "geglu")

    def activation(self, x: jnp.ndarray) -> jnp.ndarray:
        if self.config.mlp == "swiglu":
            return nn.silu(x)
        if self.config.mlp == "relu2":
            return jnp.square(nn.relu(x))
        # GPT-2's tanh form by default; nanoGPT and transformers' "gelu" use erf (differ by < 1e-3).
        return nn.gelu(x, approximate=self.config.gelu_approximate)

    def __call__(self, x: jnp.ndarray, *, padding_mask: jnp.ndarray | None = None,
                 deterministic: bool = True) -> jnp.ndarray:
        """`[B, T, D] -> [B, T, D]`. `padding_mask [B, T]` is the signature every MLP of a block shares
        (a mixture of experts leaves padding out of its losses); a dense MLP has no use for it."""
        if self.gated:
            gate, up = jnp.split(self.gate_up(x), 2, axis=-1)  # [B, T, F] each
            y = self.down(self.activation(gate) * up)
        else:
            y = self.c_proj(self.activation(self.c_fc(x)))
        return self.dropout(y, deterministic=deterministic)


def check_config(config, kernels) -> None:
    """TypeError unless `config` is a `ModelConfig` and `kernels` a `Kernels`; ValueError for an
    unresolved "auto" attention (`jaxattn.kernels.resolve_kernels` resolves it for a platform)."""
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config must be a jaxattn.ModelConfig, got {type(config).__name__}")
    if not isinstance(kernels, Kernels):
        raise TypeError(f"kernels must be a jaxattn.Kernels, got {type(kernels).__name__}")
    kernels_lib.attention_kernel(kernels.attention)  # "auto" must be resolved first: a model never detects hardware


def fused_to_separate_qkv(params: dict, config: ModelConfig) -> dict:
    """Attention params with `qkv` -> with `query`, `key`, `value` (same maths)."""
    N, K, H = config.num_heads, config.num_kv_heads, config.head_dim
    params = dict(params)
    fused = params.pop("qkv")
    cuts = [N * H, (N + K) * H]
    for name, part in zip(("query", "key", "value"), jnp.split(fused["kernel"], cuts, axis=-1)):
        params[name] = {"kernel": part}
    if "bias" in fused:
        for name, part in zip(("query", "key", "value"), jnp.split(fused["bias"], cuts)):
            params[name]["bias"] = part
    return params


def separate_to_fused_qkv(params: dict) -> dict:
    """Attention params with `query`, `key`, `value` -> with one `qkv` (same maths)."""
    params = dict(params)
    parts = [params.pop(name) for name in ("query", "key", "value")]
    fused = {"kernel": jnp.concatenate([p["kernel"] for p in parts], axis=-1)}
    if "bias" in parts[0]:
        fused["bias"] = jnp.concatenate([p["bias"] for p in parts], axis=-1)  # [..., width]: stacked layers too
    params["qkv"] = fused
    return params


def with_fused_qkv(params: dict, config: ModelConfig) -> tuple[dict, ModelConfig]:
    """`(params, config)` with every attention layer's `query`, `key` and `value` projections as one
    `qkv` (`config.fused_qkv`): the same maths and the same numbers, one matmul of the input instead of
    three. Decoding a token is a string of small matmuls, each a call with its own overhead, so
    fewer and wider ones decode faster (docs/performance.md §15). Layers unrolled or stacked for a
    scan alike; `params` unboxed, the inner tree (no "params" key).

    Returned unchanged: a config already fused, MLA (no q/k/v projections), or projections that are
    not plain arrays (quantized or with adapters, in slots too: fuse before `jaxattn.quantize` and after merging).
    """
    if config.fused_qkv or config.mla is not None:
        return params, config
    separate = list(_attention_params(params))
    wrapped = lambda x: is_quantized(x) or is_lora(x) or is_slots(x)  # noqa: E731
    if any(wrapped(leaf) for attn in separate for leaf in jax.tree.leaves(attn, is_leaf=wrapped)):
        return params, config

    def walk(tree):
        if not hasattr(tree, "items"):
            return tree
        return {name: separate_to_fused_qkv(dict(value)) if _is_separate_attention(name, value) else walk(value)
                for name, value in tree.items()}
    return walk(params), config.replace(fused_qkv=True)


def _is_separate_attention(name: str, value) -> bool:
    return name == "attn" and hasattr(value, "items") and {"query", "key", "value"} <= set(value)


def _attention_params(tree):
    """Each `attn` subtree of `tree` with separate `query`, `key` and `value`."""
    for name, value in tree.items():
        if _is_separate_attention(name, value):
            yield value
        elif hasattr(value, "items"):
            yield from _attention_params(value)
