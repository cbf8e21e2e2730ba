"""Multi-head Latent Attention (DeepSeek-V2/V3): attention through a low-rank latent (docs/theory.md §6).

Letters (beyond B, T, S, N, D): R = kv_lora_rank (the latent), P =
qk_nope_head_dim (per-head key/query dims without position), E =
qk_rope_head_dim (decoupled rotary dims), V = v_head_dim, Q = q_lora_rank.

    queries:  x -> [W_DQ -> RMSNorm -> W_UQ] -> q_nope [B,T,N,P], q_rope [B,T,N,E]
    keys:     x -> W_DKV -> c_kv [B,S,R] (RMSNorm), k_rope [B,S,E] (one key, all heads)
    naive:    c_kv -> W_UKV -> k_nope [B,S,N,P], v [B,S,N,V];
              attention of [q_nope, q_rope] on [k_nope, k_rope], values v
    absorb:   q_nope W_UK -> q_latent [B,T,N,R] attends c_kv directly; the
              output o_latent [B,T,N,R] goes through W_UV -> [B,T,N,V]

The two are the same numbers: q_nope . (c W_UK) = (q_nope W_UK^T) . c, and
sum_s w_s (c_s W_UV) = (sum_s w_s c_s) W_UV. Absorbed, the cache holds only
c_kv and k_rope, R + E numbers per token and layer.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax.numpy as jnp

from jaxattn import kernels as kernels_lib
from jaxattn.layers.attention_layer import AttentionLayer
from jaxattn.cache.containers import CacheField, LatentCache
from jaxattn.lora import float_param  # a quantized or LoRA weight read as float
from jaxattn.masks import causal_mask, combine_masks, segment_mask, sliding_window_mask, visible_cache_slots
from jaxattn.layers.primitives import check_config, logical, make_linear, make_rms_norm
from jaxattn.cache.int8 import as_float, is_quantized, leading
from jaxattn.rope import apply_rope, yarn_softmax_mscale
from jaxattn.axes import EMBED, HEAD_DIM, HEADS, LATENT
from jaxattn.softmax import dropout_weights, masked_softmax, soft_cap


def latent_attention(q_latent, q_rope, c_kv, k_rope, *, scale, mask=None, is_causal=False, window=None,
                     logits_soft_cap=None, sinks=None, dropout_rate=0.0, dropout_rng=None):
    """Softmax attention of absorbed queries against the latent cache, as einsums.

    The latent acts as one key/value head shared by every query head (MQA with
    K = 1): keys are `[c_kv, k_rope]`, values are `c_kv`.

    Args:
      q_latent: `[B, T, N, R]` queries with W_UK absorbed.
      q_rope: `[B, T, N, E]` rotated rotary queries.
      c_kv: `[B, S, R]` latents; k_rope: `[B, S, E]` rotated shared rotary keys.
      scale: softmax scale; mask: bool, True = attend, broadcastable to `[B, N, T, S]`;
      is_causal: also `causal_mask(T, S)`.
      window: W: each query sees itself and the W - 1 keys before it (end-aligned,
        `sliding_window_mask(T, S, W)`; causal by itself).
      logits_soft_cap: c: logits become `c * tanh(logits / c)` after the scale, before
        the masks (docs/theory.md §17).
      sinks: `[N]` one logit per head in every softmax's denominator (docs/theory.md §18).

    Returns:
      `(o_latent [B, T, N, R], weights [B, N, T, S] float32)`; a query with no
      visible key gets zeros.
    """
    f32 = jnp.float32
    logits = (jnp.einsum("BTNR,BSR->BNTS", q_latent, c_kv, preferred_element_type=f32)
              + jnp.einsum("BTNE,BSE->BNTS", q_rope, k_rope, preferred_element_type=f32)) * scale
    logits = soft_cap(logits, logits_soft_cap)
    T, S = logits.shape[-2:]
    structure = sliding_window_mask(T, S, window) if window is not None else causal_mask(T, S) if is_causal else None
    allowed = combine_masks(mask, structure)
    sinks = None if sinks is None else jnp.asarray(sinks, f32)[:, None]  # [N, 1]: the logits' [B, N, T] less S
    weights = dropout_weights(masked_softmax(logits, allowed, sinks=sinks), dropout_rate, dropout_rng)
    o_latent = jnp.einsum("BNTS,BSR->BTNR", weights.astype(c_kv.dtype), c_kv)
    return o_latent, weights


class MultiHeadLatentAttention(AttentionLayer):
    """MLA with N heads, for one layer of a model. Parameters (biases only where `qkv_bias`/`out_bias`
    ask, on `wq_a`, `wkv_a`, `wo`, as DeepSeek's `attention_bias`):

    `wq` `[D, N(P+E)]`, or with query compression `wq_a` `[D, Q]`, `q_norm`,
    `wq_b` `[Q, N(P+E)]`; `wkv_a` `[D, R+E]`; `kv_norm`; `wkv_b` `[R, N, P+V]`
    (W_UK and W_UV side by side); `wo` `[N V, D]`; `sinks` `[N]` when
    `config.attn_sinks`.

    RoPE rotates only the E decoupled dims (partial rotary is built in, so
    `rotary_fraction` is refused by the config) and only when this layer's
    `AttentionSpec` has RoPE. Under YaRN, as DeepSeek's reference code and
    transformers: the rotated dims are multiplied by the attention factor (on
    queries and keys, so their logits by its square) and the softmax scale
    `1/sqrt(P+E)` (or `attn_scale`) by `mscale(factor, mscale_all_dim)^2`
    (docs/theory.md §8). Full sequences run `kernels.mla` ("naive" or
    "absorb", equal in the tests); cached decoding always absorbs. A local
    layer's window goes structurally to either (`local_window_size`, or the
    window of `latent_attention`). Self-attention only.
    """

    cache_type = LatentCache

    @staticmethod
    def cache_fields(config) -> dict[str, CacheField]:
        """The normalised latent `[R]` and the shared rotary key `[E]` per token, nothing per head (kept
        whole on a mesh: every head reads all of it)."""
        m = config.mla
        return {"c_kv": CacheField(shape=(m.kv_lora_rank,), axes=(None,)),
                "k_rope": CacheField(shape=(m.qk_rope_head_dim,), axes=(None,))}

    def setup(self):
        c, k = self.config, self.kernels
        check_config(c, k)
        m, spec = c.mla, self.spec
        if m is None:
            raise ValueError("MultiHeadLatentAttention needs ModelConfig.mla (a jaxattn.MLAConfig)")
        N, P, E, V, R = c.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank
        if m.q_lora_rank is None:
            self.wq = make_linear(c, k, N * (P + E), (EMBED, HEADS), use_bias=False)
        else:
            self.wq_a = make_linear(c, k, m.q_lora_rank, (EMBED, LATENT), use_bias=c.qkv_bias)
            self.q_norm = make_rms_norm(c, LATENT)
            self.wq_b = make_linear(c, k, N * (P + E), (LATENT, HEADS), use_bias=False)
        # [c_kv | k_rope] columns: "latent" (never split over the tensor axis: every head reads all of it).
        self.wkv_a = make_linear(c, k, R + E, (EMBED, LATENT), use_bias=c.qkv_bias)
        self.kv_norm = make_rms_norm(c, LATENT)
        # A 3-D parameter because both paths use it: as one [R, N(P+V)] matmul
        # (naive) and split per head into W_UK, W_UV (absorb).
        # Quantized (`jaxattn.quantize`: as the [R, N(P + V)] matmul), it is dequantized here: the reference.
        self.wkv_b = float_param(self, "wkv_b", logical(nn.initializers.normal(c.init_std), LATENT, HEADS, HEAD_DIM),
                                 (R, N, P + V), jnp.dtype(c.param_dtype))
        self.wo = make_linear(c, k, c.d_model, (HEADS, EMBED), residual=True, use_bias=c.out_bias)
        self.setup_rope_sinks_dropout(N, E, all_rotated=False)  # the factor stays on the rotary dims
        mscale = yarn_softmax_mscale(spec.rope_scaling) ** 2
        self.scale = mscale / math.sqrt(P + E) if c.attn_scale is None else mscale * c.attn_scale

    # -- the named steps -------------------------------------------------------------------

    def project_query(self, x):
        """x `[B, T, D]` -> q_nope `[B, T, N, P]`, q_rope `[B, T, N, E]` (not yet rotated)."""
        m = self.config.mla
        B, T = x.shape[:2]
        q = self.wq(x) if m.q_lora_rank is None else self.wq_b(self.q_norm(self.wq_a(x)))
        q = q.reshape(B, T, self.config.num_heads, m.qk_nope_head_dim + m.qk_rope_head_dim)
        return q[..., :m.qk_nope_head_dim], q[..., m.qk_nope_head_dim:]

    def compress_kv(self, x):
        """x `[B, S, D]` -> c_kv `[B, S, R]` (normalised), k_rope `[B, S, E]` (not yet rotated)."""
        kv = self.wkv_a(x)  # [B, S, R + E]
        R = self.config.mla.kv_lora_rank
        return self.kv_norm(kv[..., :R]), kv[..., R:]

    def project(self, x, context=None):
        """x `[B, T, D]` -> `((q_nope, q_rope), (c_kv, k_rope))`; the latent norms are part of it."""
        return self.project_query(x), self.compress_kv(x)

    def rotate(self, q, kv, q_positions, k_positions):
        """RoPE on the `[B, T, N, E]` rotary queries and the shared `[B, S, E]` rotary key (one head);
        identity for a layer without RoPE."""
        (q_nope, q_rope), (c_kv, k_rope) = q, kv
        if not self.spec.rope:
            return q, kv
        rope = dict(interleaved=self.config.rope_interleaved, inv_freq=self.inv_freq)
        k_rope = apply_rope(k_rope[:, :, None, :], k_positions, **rope)[:, :, 0, :]
        q_rope = apply_rope(q_rope, q_positions, **rope)
        if self.rope_factor != 1.0:  # YaRN's temperature, applied where transformers applies it
            q_rope, k_rope = q_rope * self.rope_factor, k_rope * self.rope_factor
        return (q_nope, q_rope), (c_kv, k_rope)

    def attend(self, q, kv, *, mask=None, is_causal=False, window=None, deterministic=True,
               return_weights=False, segment_ids=None):
        """`kernels.mla`'s path: `attend_naive` or `attend_absorbed` -> `(out [B, T, N, V], weights or None)`."""
        path = kernels_lib.check_mla_path(self.kernels.mla)
        attend = self.attend_naive if path == "naive" else self.attend_absorbed
        return attend(q, kv, mask=mask, is_causal=is_causal, window=window, deterministic=deterministic,
                      return_weights=return_weights, segment_ids=segment_ids)

    def attend_naive(self, q, kv, *, mask=None, is_causal=False, window=None, deterministic=True,
                     return_weights=False, segment_ids=None):
        """Decompresses per-head keys and values, then `scaled_dot_product_attention` (K = N)."""
        (q_nope, q_rope), (c_kv, k_rope) = q, kv
        c = self.config
        B, S, R = c_kv.shape
        N, P = c.num_heads, c.mla.qk_nope_head_dim
        wkv_b = self.wkv_b.astype(c_kv.dtype).reshape(R, -1)
        kv = (c_kv.reshape(B * S, R) @ wkv_b).reshape(B, S, N, -1)  # [B, S, N, P + V]
        k_nope, v = kv[..., :P], kv[..., P:]
        k_rope = jnp.broadcast_to(k_rope[:, :, None, :], (B, S, N, k_rope.shape[-1]))
        q = jnp.concatenate([q_nope, q_rope], axis=-1)  # [B, T, N, P + E]
        k = jnp.concatenate([k_nope, k_rope.astype(k_nope.dtype)], axis=-1)  # [B, S, N, P + E]
        return self.attend_heads(q, k, v, mask=mask, is_causal=is_causal, window=window,
                                 deterministic=deterministic, return_weights=return_weights, segment_ids=segment_ids)

    def attend_absorbed(self, q, kv, *, mask=None, is_causal=False, window=None, deterministic=True,
                        return_weights=False, segment_ids=None):
        """W_UK folded into the query, `latent_attention` on the latent, W_UV applied after: `[B, T, N, V]`.

        `latent_attention` is einsums, not a kernel: packed rows' `segment_ids` reach it as their mask."""
        (q_nope, q_rope), (c_kv, k_rope) = q, kv
        P = self.config.mla.qk_nope_head_dim
        w_uk = self.wkv_b[..., :P].astype(q_nope.dtype)  # [R, N, P]
        w_uv = self.wkv_b[..., P:].astype(q_nope.dtype)  # [R, N, V]
        q_latent = jnp.einsum("BTNP,RNP->BTNR", q_nope, w_uk)
        rate, rng = self.dropout(deterministic)
        if segment_ids is not None:  # [B, 1, T, S]: each token within its own document
            mask = combine_masks(mask, segment_mask(segment_ids, segment_ids))
        o_latent, weights = latent_attention(
            q_latent, q_rope, c_kv.astype(q_nope.dtype), k_rope.astype(q_nope.dtype), scale=self.scale,
            mask=mask, is_causal=is_causal, window=window, dropout_rate=rate, dropout_rng=rng, **self.cap_and_sinks())
        out = jnp.einsum("BTNR,RNV->BTNV", o_latent, w_uv)
        return out, (weights if return_weights else None)

    def attend_cached(self, q, cache: LatentCache, positions):
        """Absorbed attention of queries at `positions [B, T]` to the slots they may see (window included);
        an int8 cache dequantized first (the reference)."""
        mask = visible_cache_slots(positions, cache.c_kv.shape[1], self.spec.window)  # [B, 1, T, L]
        dtype = q[0].dtype
        return self.attend_absorbed(q, (as_float(cache.c_kv, dtype), as_float(cache.k_rope, dtype)), mask=mask)[0]

    def paged_operands(self, q, pool: LatentCache):
        """Absorbed attention against the latent pages, as MQA (one kv head) over two parts: W_UK folded
        into the query, the latent `[P, ps, R]` (keys and values at once) and the rotary key `[P, ps, E]`
        (int8 pools stay int8: the kernel dequantizes what it gathers)."""
        (q_nope, q_rope), P = q, self.config.mla.qk_nope_head_dim
        q_latent = jnp.einsum("BTNP,RNP->BTNR", q_nope, self.wkv_b[..., :P].astype(q_nope.dtype))

        def one_head(pages):  # [P, ps, X] -> [P, ps, 1, X]; an int8 pool's scales [P, ps] -> [P, ps, 1]
            pages = leading(lambda a: a[:, :, None], pages)
            return pages if is_quantized(pages) else pages.astype(q_nope.dtype)
        latent = one_head(pool.c_kv)
        return (q_latent, q_rope), (latent, one_head(pool.k_rope)), latent

    def paged_output(self, out):
        """The latent result `[R, C, N, R_kv]` through W_UV -> `[R, C, N, V]`."""
        P = self.config.mla.qk_nope_head_dim
        return jnp.einsum("BTNR,RNV->BTNV", out, self.wkv_b[..., P:].astype(out.dtype))

    def project_out(self, out, *, deterministic=True):
        """`[B, T, N, V] -> [B, T, D]` through W_O, then residual dropout."""
        B, T = out.shape[:2]
        return self.resid_dropout(self.wo(out.reshape(B, T, -1)), deterministic=deterministic)

    def check_inputs(self, x, context) -> None:
        super().check_inputs(x, context)
        if context is not None:
            raise ValueError("MultiHeadLatentAttention is self-attention only; context must be None")
