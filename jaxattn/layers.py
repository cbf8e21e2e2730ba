"""Flax building blocks: linear maps, norms, the MLP and one attention layer for MHA/MQA/GQA.

Every module is built from one `ModelConfig` (the maths) and one
`jaxattn.kernels.Kernels` (which implementations run; the default is the
reference). Dense projections run as 2-D matmuls on `[B*T, D]`, heads stay in
the `[B, T, N, H]` layout with no transpose, and the attention maths is
`jaxattn.scaled_dot_product_attention` (docs/theory.md §4-§5).

Every parameter carries the logical names of its axes (`nn.with_logical_partitioning`:
"embed", "heads", "kv_heads", "qkv", "head_dim", "mlp", "vocab", "latent", "position"),
so `init` returns `nn.LogicallyPartitioned` boxes (`nn.unbox` gives the arrays;
`apply` takes either). `jaxattn.sharding` maps the names onto a device mesh.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxattn import kernels as kernels_lib
from jaxattn.attention import cached_attention, scaled_dot_product_attention
from jaxattn.cache import KVCache, write_rows
from jaxattn.config import ModelConfig
from jaxattn.kernels import Kernels
from jaxattn.masks import sliding_window_mask
from jaxattn.rope import apply_rope, rope_attention_factor, rope_frequencies


def residual_init_std(config: ModelConfig) -> float:
    """nanoGPT/GPT-2: projections into the residual stream get std / sqrt(2 * layers)."""
    return config.init_std / math.sqrt(2 * config.num_layers)


def logical(init, *names: str | None):
    """`init` whose output carries the logical axis names `names` (one per axis)."""
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
    """

    features: int
    axes: tuple[str | None, str | None] = (None, None)
    use_bias: bool = False
    init_std: float = 0.02
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    matmul: str = "xla"

    @nn.compact
    def __call__(self, x: jnp.ndarray, columns: slice | None = None) -> jnp.ndarray:
        """`[..., D_in] -> [..., features]`, or only the output `columns` of W (cross-attention)."""
        kernel = self.param("kernel", logical(nn.initializers.normal(self.init_std), *self.axes),
                            (x.shape[-1], self.features), self.param_dtype)
        columns = slice(None) if columns is None else columns
        rows = x.reshape(-1, x.shape[-1]).astype(self.dtype)  # [B*T, D_in]
        matmul = kernels_lib.matmul_kernel(self.matmul)
        y = matmul(rows, kernel[:, columns].astype(self.dtype)).astype(self.dtype)  # [B*T, features]
        if self.use_bias:
            bias = self.param("bias", logical(nn.initializers.zeros, self.axes[1]), (self.features,),
                              self.param_dtype)
            y = y + bias[columns].astype(self.dtype)
        return y.reshape(*x.shape[:-1], y.shape[-1])


class RMSNorm(nn.Module):
    """`x / rms(x) * scale`, statistics in float32; `axis`: the logical name of the scale's axis."""

    eps: float = 1e-6
    axis: str | None = "embed"
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        scale = self.param("scale", logical(nn.initializers.ones, self.axis), (x.shape[-1],), self.param_dtype)
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (y * scale.astype(jnp.float32)).astype(self.dtype)


class LayerNorm(nn.Module):
    """`(x - mean) / std * scale (+ bias)`, statistics in float32."""

    eps: float = 1e-5
    use_bias: bool = True
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        scale = self.param("scale", logical(nn.initializers.ones, "embed"), (x.shape[-1],), self.param_dtype)
        xf = x.astype(jnp.float32)
        mean = jnp.mean(xf, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
        y = (xf - mean) * jax.lax.rsqrt(var + self.eps) * scale.astype(jnp.float32)
        if self.use_bias:
            y = y + self.param("bias", logical(nn.initializers.zeros, "embed"), (x.shape[-1],),
                               self.param_dtype).astype(jnp.float32)
        return y.astype(self.dtype)


def make_norm(config: ModelConfig, name: str | None = None) -> nn.Module:
    """The config's norm (pre-norm blocks and the final norm)."""
    dtypes = dict(dtype=jnp.dtype(config.dtype), param_dtype=jnp.dtype(config.param_dtype))
    if config.norm == "rmsnorm":
        return RMSNorm(eps=config.norm_eps, name=name, **dtypes)
    return LayerNorm(eps=config.norm_eps, use_bias=config.use_bias, name=name, **dtypes)


def make_linear(config: ModelConfig, kernels: Kernels, features: int, axes: tuple[str | None, str | None], *,
                residual: bool = False, use_bias: bool | None = None, name: str | None = None) -> Linear:
    """A `Linear` with the config's dtypes and init (`residual`: scaled init), the kernels' matmul
    and W's logical axis names `axes` (input, output)."""
    return Linear(features, axes=tuple(axes), use_bias=config.use_bias if use_bias is None else use_bias,
                  init_std=residual_init_std(config) if residual else config.init_std,
                  dtype=jnp.dtype(config.dtype), param_dtype=jnp.dtype(config.param_dtype),
                  matmul=kernels.matmul, name=name)


class MLP(nn.Module):
    """Plain (`c_fc`, GELU, `c_proj`) or gated (`gate_up`, act(gate) * up, `down`) MLP, then dropout.

    `config.mlp`: "gelu" plain, "swiglu" gated with SiLU, "geglu" gated with GELU;
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
            self.gate_up = make_linear(c, k, 2 * c.mlp_hidden, ("embed", "mlp"), **bias)
            self.down = make_linear(c, k, c.d_model, ("mlp", "embed"), residual=True, **bias)
        else:
            self.c_fc = make_linear(c, k, c.mlp_hidden, ("embed", "mlp"), **bias)
            self.c_proj = make_linear(c, k, c.d_model, ("mlp", "embed"), residual=True, **bias)
        self.dropout = nn.Dropout(c.dropout)

    @property
    def gated(self) -> bool:
        return self.config.mlp in ("swiglu", "geglu")

    def activation(self, x: jnp.ndarray) -> jnp.ndarray:
        if self.config.mlp == "swiglu":
            return nn.silu(x)
        # GPT-2's tanh form by default; nanoGPT and transformers' "gelu" use erf (differ by < 1e-3).
        return nn.gelu(x, approximate=self.config.gelu_approximate)

    def __call__(self, x: jnp.ndarray, *, deterministic: bool = True) -> jnp.ndarray:
        """`[B, T, D] -> [B, T, D]`."""
        if self.gated:
            gate, up = jnp.split(self.gate_up(x), 2, axis=-1)  # [B, T, F] each
            y = self.down(self.activation(gate) * up)
        else:
            y = self.c_proj(self.activation(self.c_fc(x)))
        return self.dropout(y, deterministic=deterministic)


def window_mask(config: ModelConfig, q_len: int, kv_len: int) -> jnp.ndarray | None:
    """`[T, S]` sliding-window mask of causal self-attention, or None without `config.sliding_window`."""
    if config.sliding_window is None:
        return None
    return sliding_window_mask(q_len, kv_len, config.sliding_window)


def check_config(config, kernels) -> None:
    """TypeError unless `config` is a `ModelConfig` and `kernels` a `Kernels`; ValueError for an
    unresolved "auto" attention (`jaxattn.kernels.resolve_kernels` resolves it for a platform)."""
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config must be a jaxattn.ModelConfig, got {type(config).__name__}")
    if not isinstance(kernels, Kernels):
        raise TypeError(f"kernels must be a jaxattn.Kernels, got {type(kernels).__name__}")
    kernels_lib.attention_kernel(kernels.attention)  # "auto" must be resolved first: a model never detects hardware


class Attention(nn.Module):
    """Multi-head attention with N query heads and K key/value heads.

    K = N is MHA, K = 1 MQA, anything between GQA; H = `config.head_dim`
    need not equal D / N. Parameters: fused `qkv` (kernel `[D, (N + 2K) H]`,
    columns `[Q | K | V]` like nanoGPT's `c_attn`) or separate `query`, `key`,
    `value` (biases when `config.qkv_bias`); output projection `out`
    (`[N H, D]`, bias when `config.out_bias`); `q_norm`, `k_norm` (RMSNorm
    over H) when `config.qk_norm`. Positions: RoPE when `config.positions ==
    "rope"`, else none here (absolute positions are added to the embeddings
    by the model). With `config.sliding_window` W, causal self-attention and
    the cache show each query only itself and the W - 1 tokens before it.

    `__call__` processes whole sequences (self- or cross-attention);
    `extend` appends tokens to a `KVCache` and attends to everything cached.
    Both are the same named steps: project, rotate, (update cache), attend,
    project out.
    """

    config: ModelConfig
    kernels: Kernels = Kernels()

    def setup(self):
        c, k = self.config, self.kernels
        check_config(c, k)
        N, K, H = c.num_heads, c.num_kv_heads, c.head_dim
        if c.fused_qkv:
            self.qkv = make_linear(c, k, (N + 2 * K) * H, ("embed", "qkv"), use_bias=c.qkv_bias)
        else:
            self.query = make_linear(c, k, N * H, ("embed", "heads"), use_bias=c.qkv_bias)
            self.key = make_linear(c, k, K * H, ("embed", "kv_heads"), use_bias=c.qkv_bias)
            self.value = make_linear(c, k, K * H, ("embed", "kv_heads"), use_bias=c.qkv_bias)
        if c.qk_norm:
            dtypes = dict(dtype=jnp.dtype(c.dtype), param_dtype=jnp.dtype(c.param_dtype), axis="head_dim")
            self.q_norm = RMSNorm(eps=c.norm_eps, **dtypes)
            self.k_norm = RMSNorm(eps=c.norm_eps, **dtypes)
        self.out = make_linear(c, k, c.d_model, ("heads", "embed"), residual=True, use_bias=c.out_bias)
        self.resid_dropout = nn.Dropout(c.dropout)
        self.use_rope = c.positions == "rope"
        if self.use_rope:
            self.inv_freq = rope_frequencies(H, theta=c.rope_theta, scaling=c.rope_scaling)
        # YaRN sharpens the softmax by its attention factor squared; 1 otherwise.
        self.scale = rope_attention_factor(c.rope_scaling if self.use_rope else None) ** 2 / math.sqrt(H)

    # -- the named steps -------------------------------------------------------------------

    def project(self, x: jnp.ndarray, context: jnp.ndarray | None = None):
        """Queries from x `[B, T, D]`, keys/values from context `[B, S, D]` (default x).

        Returns q `[B, T, N, H]`, k `[B, S, K, H]`, v `[B, S, K, H]`.
        """
        c = self.config
        N, K, H = c.num_heads, c.num_kv_heads, c.head_dim
        B, T = x.shape[:2]
        if c.fused_qkv and context is None:
            q, k, v = jnp.split(self.qkv(x), [N * H, (N + K) * H], axis=-1)  # one matmul
        elif c.fused_qkv:
            q = self.qkv(x, columns=slice(0, N * H))
            k, v = jnp.split(self.qkv(context, columns=slice(N * H, None)), 2, axis=-1)
        else:
            source = x if context is None else context
            q, k, v = self.query(x), self.key(source), self.value(source)
        S = k.shape[1]
        q, k = self.normalize(q.reshape(B, T, N, H), k.reshape(B, S, K, H))
        return q, k, v.reshape(B, S, K, H)

    def normalize(self, q, k):
        """Qwen3's per-head RMSNorm of queries and keys (before RoPE); identity without `qk_norm`."""
        if not self.config.qk_norm:
            return q, k
        return self.q_norm(q), self.k_norm(k)

    def rotate(self, q, k, q_positions, k_positions):
        """RoPE on queries and keys (never values); identity without RoPE."""
        if not self.use_rope:
            return q, k
        rope = dict(interleaved=self.config.rope_interleaved, inv_freq=self.inv_freq)
        return apply_rope(q, q_positions, **rope), apply_rope(k, k_positions, **rope)

    def update_cache(self, cache: KVCache, k, v, starts) -> KVCache:
        """Writes the new k, v `[B, T, K, H]` of row b at slots `starts[b] + arange(T)` of the `[B, K, L, H]` cache."""
        write = dict(axis=2, implementation=self.kernels.decode)
        heads_major = lambda x: jnp.swapaxes(x, 1, 2)  # [B, T, K, H] -> [B, K, T, H]  # noqa: E731
        return KVCache(k=write_rows(cache.k, heads_major(k), starts, **write),
                       v=write_rows(cache.v, heads_major(v), starts, **write))

    def attend(self, q, k, v, *, mask=None, is_causal=False, window=None, deterministic=True,
               return_weights=False):
        """`scaled_dot_product_attention` -> `[B, T, N, H]` (and weights `[B, N, T, S]`).

        `window` is passed as its structural `local_window_size`, so a blockwise
        kernel can skip the blocks it hides.
        """
        rate = 0.0 if deterministic else self.config.dropout
        rng = self.make_rng("dropout") if rate > 0.0 else None
        return scaled_dot_product_attention(
            q, k, v, mask=mask, is_causal=is_causal, local_window_size=window, scale=self.scale,
            dropout_rate=rate, dropout_rng=rng, return_weights=return_weights,
            implementation=self.kernels.attention)

    def project_out(self, out: jnp.ndarray, *, deterministic: bool = True) -> jnp.ndarray:
        """Merges heads `[B, T, N, H] -> [B, T, N*H]` (a free reshape) and applies W_O -> `[B, T, D]`."""
        B, T = out.shape[:2]
        y = self.out(out.reshape(B, T, -1))
        return self.resid_dropout(y, deterministic=deterministic)

    # -- whole sequences and cached extension ----------------------------------------------

    def __call__(self, x, context=None, *, positions=None, context_positions=None, mask=None,
                 is_causal=False, deterministic=True, return_weights=False):
        """Self-attention over x, or cross-attention from x to `context`.

        Args:
          x: `[B, T, D]` queries' inputs.
          context: `[B, S, D]` keys'/values' inputs (None: self-attention).
          positions: `[B, T]` or `[T]` query positions for RoPE (default arange(T)).
          context_positions: `[B, S]` or `[S]` key positions (default: `positions`
            for self-attention, arange(S) for cross-attention).
          mask: boolean, True = attend, broadcastable to `[B, N, T, S]`
            (e.g. a padding mask `[B, 1, 1, S]`).
          is_causal: hide keys after each query (aligned to the end of the keys).
          deterministic: no dropout when True; else needs rngs={'dropout': key}.
          return_weights: also return the attention weights `[B, N, T, S]` float32.

        Returns:
          `[B, T, D]`, or `(out, weights)`.
        """
        self._check_inputs(x, context)
        T = x.shape[1]
        positions = jnp.arange(T) if positions is None else positions
        if context_positions is None:
            context_positions = positions if context is None else jnp.arange(context.shape[1])
        q, k, v = self.project(x, context)
        q, k = self.rotate(q, k, positions, context_positions)
        window = self.config.sliding_window if is_causal and context is None else None
        result = self.attend(q, k, v, mask=mask, is_causal=is_causal, window=window,
                             deterministic=deterministic, return_weights=return_weights)
        out, weights = result if return_weights else (result, None)
        y = self.project_out(out, deterministic=deterministic)
        return (y, weights) if return_weights else y

    def extend(self, x, cache: KVCache, starts):
        """Appends the T tokens of x to the cache and attends causally to all of row b's tokens.

        Args:
          x: `[B, T, D]`; token t of row b sits at absolute position `starts[b] + t`.
          cache: this layer's `KVCache` (`[B, K, L, H]`), `starts[b] + T <= L`.
          starts: `[B]` int, tokens of each row already in the cache.

        Returns:
          `([B, T, D], new_cache)`. Deterministic (no dropout).
        """
        self._check_inputs(x, None)
        positions = starts[:, None] + jnp.arange(x.shape[1])  # [B, T] absolute
        q, k, v = self.project(x)
        q, k = self.rotate(q, k, positions, positions)
        cache = self.update_cache(cache, k, v, starts)
        out = cached_attention(q, cache.k, cache.v, positions, scale=self.scale,
                               window=self.config.sliding_window,
                               implementation=self.kernels.decode)  # [B, T, N, H]
        return self.project_out(out), cache

    def _check_inputs(self, x, context):
        if not hasattr(x, "ndim") or x.ndim != 3:
            raise ValueError(f"x must be [B, T, D], got shape {getattr(x, 'shape', type(x))}")
        if context is None:
            return
        if context.ndim != 3 or context.shape[0] != x.shape[0]:
            raise ValueError(f"context must be [B, S, D] with B = {x.shape[0]}, got {context.shape}")
        if self.config.fused_qkv and context.shape[-1] != x.shape[-1]:
            raise ValueError(
                f"fused QKV shares one input width; x {x.shape} and context {context.shape} differ "
                "(use fused_qkv=False for cross-attention from another width)")


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
        fused["bias"] = jnp.concatenate([p["bias"] for p in parts])
    params["qkv"] = fused
    return params
