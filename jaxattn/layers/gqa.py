"""Multi-head attention with N query and K key/value heads: MHA (K = N), GQA, MQA (K = 1).

The steps of `jaxattn.layers.attention_layer.AttentionLayer` for standard attention: the
projections run as 2-D matmuls on `[B*T, D]`, heads stay in the `[B, T, N, H]` layout
with no transpose, and the attention maths is `jaxattn.scaled_dot_product_attention`
(docs/theory.md §4-§5) or `cached_attention` against a `KVCache`.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax.numpy as jnp

from jaxattn.attention import cached_attention
from jaxattn.layers.attention_layer import AttentionLayer
from jaxattn.cache.containers import CacheField, KVCache
from jaxattn.layers.primitives import check_config, logical, make_linear, make_rms_norm
from jaxattn.cache.int8 import as_float
from jaxattn.rope import apply_rope, rotary_dims
from jaxattn.axes import EMBED, HEAD_DIM, HEADS, KV_HEADS, QKV


class Attention(AttentionLayer):
    """Multi-head attention with N query heads and K key/value heads, for one layer of a model.

    K = N is MHA, K = 1 MQA, anything between GQA; H = `config.head_dim` need
    not equal D / N. Parameters: fused `qkv` (kernel `[D, (N + 2K) H]`, columns
    `[Q | K | V]` like nanoGPT's `c_attn`) or separate `query`, `key`, `value`
    (biases when `config.qkv_bias`); output projection `out` (`[N H, D]`, bias
    when `config.out_bias`); `q_norm`, `k_norm` when `config.qk_norm` is "head"
    (RMSNorm over H, scale `[H]`) or "full" (over the whole N*H / K*H projection,
    scale `[N*H]` / `[K*H]`); `sinks` `[N]` when `config.attn_sinks`; `value_lambdas` `[2]`
    (initialised to 1/2 each) in a layer with a value-embedding table (`config.value_embedding_table`).

    Its `AttentionSpec` (`config.layer_attention(layer)`) decides the rest: RoPE on
    the first `rotary_dims(H, rotary_fraction)` dims with this layer's base and
    scaling, or none (NoPE, and every layer unless `positions == "rope"`);
    absolute positions are added to the embeddings by the model. A local layer's
    window W shows each query of causal self-attention and of the cache only
    itself and the W - 1 tokens before it. Softmax scale `attn_scale` (default
    1/sqrt(H)), times YaRN's attention factor squared when every dim is rotated
    (else the factor multiplies the rotated dims of queries and keys, as
    transformers multiplies cos and sin).
    """

    cache_type = KVCache

    @staticmethod
    def cache_fields(config) -> dict[str, CacheField]:
        """Keys and values, `[K, H]` per token each, heads-major in the dense cache (`[B, K, L, H]`)."""
        kv = CacheField(shape=(config.num_kv_heads, config.head_dim), axes=(KV_HEADS, HEAD_DIM), slot_axis=1)
        return {"k": kv, "v": kv}

    def setup(self):
        c, k = self.config, self.kernels
        check_config(c, k)
        spec = self.spec
        N, K, H = c.num_heads, c.num_kv_heads, c.head_dim
        if c.fused_qkv:
            self.qkv = make_linear(c, k, (N + 2 * K) * H, (EMBED, QKV), use_bias=c.qkv_bias)
        else:
            self.query = make_linear(c, k, N * H, (EMBED, HEADS), use_bias=c.qkv_bias)
            self.key = make_linear(c, k, K * H, (EMBED, KV_HEADS), use_bias=c.qkv_bias)
            self.value = make_linear(c, k, K * H, (EMBED, KV_HEADS), use_bias=c.qkv_bias)
        if c.qk_norm != "none":
            full = c.qk_norm == "full"
            self.q_norm = make_rms_norm(c, HEADS if full else HEAD_DIM)
            self.k_norm = make_rms_norm(c, KV_HEADS if full else HEAD_DIM)
        self.out = make_linear(c, k, c.d_model, (HEADS, EMBED), residual=True, use_bias=c.out_bias)
        if c.value_embedding_table(self.layer) is not None:
            self.value_lambdas = self.param("value_lambdas", logical(nn.initializers.constant(0.5), None), (2,),
                                            jnp.dtype(c.param_dtype))
        self.rotary = rotary_dims(H, spec.rotary_fraction) if spec.rope else 0
        self.setup_rope_sinks_dropout(N, self.rotary, all_rotated=self.rotary == H)
        if c.attn_scale is None:
            self.scale = self.scale_factor / math.sqrt(H)
        else:
            self.scale = self.scale_factor * c.attn_scale

    # -- the named steps -------------------------------------------------------------------

    def project(self, x, context=None):
        """Queries from x `[B, T, D]`, keys/values from context `[B, S, D]` (default x).

        Returns `(q [B, T, N, H], (k [B, S, K, H], v [B, S, K, H]))`.
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
        return q.reshape(B, T, N, H), (k.reshape(B, S, K, H), v.reshape(B, S, K, H))

    def mix_values(self, kv, value_embedding):
        """Value embeddings (modded-nanoGPT, docs/theory.md §23): v `[B, S, K, H]` ->
        `lam[0] * v + lam[1] * value_embedding` (`[B, S, K, H]`, lam = `value_lambdas`), in v's dtype.

        Identity for None; a ValueError for one of another shape or in a layer without a table.
        """
        if value_embedding is None:
            return kv
        k, v = kv
        if self.config.value_embedding_table(self.layer) is None:
            raise ValueError(f"value_embedding: layer {self.layer} has no value-embedding table "
                             f"(value_embeddings={self.config.value_embeddings}, num_layers={self.config.num_layers})")
        if getattr(value_embedding, "shape", None) != v.shape:
            raise ValueError(f"value_embedding must be [B, S, K, H] = {v.shape}, "
                             f"got {getattr(value_embedding, 'shape', type(value_embedding))}")
        lam = self.value_lambdas.astype(v.dtype)
        return k, lam[0] * v + lam[1] * value_embedding.astype(v.dtype)

    def normalise(self, q, kv):
        """q/k RMSNorm before RoPE: per head (Qwen3, Gemma 3) or over the whole projection (OLMo 2)."""
        qk_norm = self.config.qk_norm
        if qk_norm == "none":
            return q, kv
        k, v = kv
        if qk_norm == "head":
            return self.q_norm(q), (self.k_norm(k), v)
        whole = lambda norm, x: norm(x.reshape(*x.shape[:2], -1)).reshape(x.shape)  # noqa: E731  (free reshapes)
        return whole(self.q_norm, q), (whole(self.k_norm, k), v)

    def rotate(self, q, kv, q_positions, k_positions):
        """RoPE on queries and keys (never values); identity for a layer without RoPE."""
        if not self.spec.rope:
            return q, kv
        k, v = kv
        rope = dict(interleaved=self.config.rope_interleaved, inv_freq=self.inv_freq)
        q, k = apply_rope(q, q_positions, **rope), apply_rope(k, k_positions, **rope)
        if self.rope_factor != 1.0:  # YaRN's factor on the rotated dims only (partial rotary)
            R = self.rotary
            scaled = lambda x: jnp.concatenate([x[..., :R] * self.rope_factor, x[..., R:]], -1)  # noqa: E731
            q, k = scaled(q), scaled(k)
        return q, (k, v)

    def attend(self, q, kv, *, mask=None, is_causal=False, window=None, deterministic=True,
               return_weights=False, segment_ids=None):
        """`(out [B, T, N, H], weights [B, N, T, S] or None)` of q against kv = (k, v) (`attend_heads`)."""
        k, v = kv
        return self.attend_heads(q, k, v, mask=mask, is_causal=is_causal, window=window,
                                 deterministic=deterministic, return_weights=return_weights, segment_ids=segment_ids)

    def attend_cached(self, q, cache: KVCache, positions):
        """`cached_attention` of q `[B, T, N, H]` at `positions` against the `[B, K, L, H]` cache
        (an int8 cache dequantized to q's dtype first: the reference)."""
        k, v = as_float(cache.k, q.dtype), as_float(cache.v, q.dtype)
        return cached_attention(q, k, v, positions, scale=self.scale, window=self.spec.window,
                                implementation=self.kernels.decode, **self.cap_and_sinks())

    def paged_operands(self, q, pool: KVCache):
        """q `[R, C, N, H]` against the `[P, ps, K, H]` key and value pools: one key part (int8 pools stay
        int8: the kernel dequantizes the pages it gathers)."""
        return (q,), (pool.k,), pool.v

    def project_out(self, out, *, deterministic=True):
        """Merges heads `[B, T, N, H] -> [B, T, N*H]` (a free reshape) and applies W_O -> `[B, T, D]`."""
        B, T = out.shape[:2]
        return self.resid_dropout(self.out(out.reshape(B, T, -1)), deterministic=deterministic)

    def check_inputs(self, x, context) -> None:
        super().check_inputs(x, context)
        if context is not None and self.config.fused_qkv and context.shape[-1] != x.shape[-1]:
            raise ValueError(
                f"fused QKV shares one input width; x {x.shape} and context {context.shape} differ "
                "(use fused_qkv=False for cross-attention from another width)")
