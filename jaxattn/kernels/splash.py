"""Pallas's TPU splash attention ("splash"): block-sparse flash attention from `jax.experimental.pallas`.

Contract: `jaxattn.scaled_dot_product_attention`'s for the calls `refusal` accepts;
any other call runs the reference ("xla") with a one-line `KernelFallbackWarning`.
Reverse mode only. On a TPU it compiles with Mosaic; anywhere else it runs in
Pallas's interpret mode (slow: for tests, which is how CPU CI checks it against
the reference, tests/kernels/test_auto_attention.py).

Layout: the splash MQA kernel takes the G query heads of one key/value head
(`[G, T, H]` against `[S, H]`), so it is vmapped over (B, K) and keys and values
are never repeated. T and S are padded to whole blocks; the end-aligned causal
or window mask (an `offset` of S - T) hides padded keys from every real query,
and where a real query could reach them (no causal mask, and no window or one reaching
right) a key segment id hides them. Windows `(left, right)` are splash's `LocalMask`
with the same end-aligned offset. The queries are scaled before the kernel, which has
no `scale` argument (one rounding in the input dtype); the soft cap is splash's
`attn_logits_soft_cap`, applied to those scaled logits as here (docs/theory.md §17).
Sinks and the residual are refused (the reference runs).

Segment ids of packed rows (docs/theory.md §27; self-attention, T == S) are splash's own
`SegmentIds`, per batch row: the padded tokens past T get an id of their own (-1), which no real
token has. Splash needs a visible key in every row, and it has one: each token sees itself
(its own id, and the diagonal is inside every causal mask and window), padding (id 0) included;
padding queries, which attend to nothing in jaxattn's convention, are zeroed after the kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxattn.kernels._call import AttentionCall, reference_unless
from jaxattn.kernels._grouping import heads_major, heads_minor
from jax.experimental.pallas.ops.tpu.splash_attention import SegmentIds

from jaxattn.masks import key_offsets


def refusal(call: AttentionCall) -> str | None:
    """Why splash cannot take `call` here (None: it can)."""
    _, hi = key_offsets(call.is_causal, call.window)
    if hi is not None and call.T - call.S > hi:  # the first query sits at S - T and sees up to S - T + hi
        structure = " and ".join(([] if call.window is None else [f"the window {call.window}"])
                                 + (["the causal mask"] if call.is_causal else []))
        return f"T={call.T} > S={call.S} with {structure} leaves query rows with no key"
    if call.lengths:
        return "key_value_seq_lengths (not passed to splash as segment ids here)"
    if call.sinks:
        return "attention sinks (splash has none)"
    if call.residual:
        return "the logsumexp residual (not returned by splash here)"
    return call.common_refusal("splash")


def block_size(length: int) -> int:
    """Rows per block: 128 for short sequences, else 512 (what splash's TPU tiling wants)."""
    return 128 if length <= 512 else 512


def _round_up(n: int, block: int) -> int:
    return -(-n // block) * block


def _kernel(G: int, Tp: int, Sp: int, T: int, S: int, is_causal: bool, window, soft_cap, block: int,
            interpret: bool):
    """The splash MQA kernel for one key/value head's G query heads (built per trace: it holds arrays)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa
    shape = (Tp, Sp)
    if window is not None:  # causality cuts the right side to 0
        head_mask = sa.LocalMask(shape, window_size=(window[0], 0 if is_causal else window[1]), offset=S - T)
    elif is_causal:
        head_mask = sa.CausalMask(shape, offset=S - T)
    else:
        head_mask = sa.FullMask(shape)
    sizes = dict.fromkeys(("block_q", "block_kv", "block_kv_compute", "block_q_dkv", "block_kv_dkv",
                           "block_kv_dkv_compute", "block_q_dq", "block_kv_dq"), block)
    return sa.make_splash_mqa(sa.MultiHeadMask([head_mask] * G), block_sizes=sa.BlockSizes(**sizes),
                              head_shards=1, q_seq_shards=1, attn_logits_soft_cap=soft_cap, interpret=interpret)


@reference_unless(refusal, warn_as="splash")
def attention(query, key, value, *, mask, bias, is_causal, scale, dropout_rate, dropout_rng,
              return_weights, local_window_size=None, key_value_seq_lengths=None, logits_soft_cap=None,
              sinks=None, return_residual=False, segment_ids=None, interpret=None):
    """Same arguments and results as `jaxattn.kernels.xla.attention`; `interpret` None: unless on a TPU."""
    interpret = jax.default_backend() != "tpu" if interpret is None else interpret
    T, S, G = query.shape[1], key.shape[1], query.shape[2] // key.shape[2]
    block = block_size(max(T, S))
    Tp, Sp = _round_up(T, block), _round_up(S, block)
    window = None if local_window_size is None else tuple(int(w) for w in local_window_size)
    soft_cap = None if logits_soft_cap is None else float(logits_soft_cap)
    kernel = _kernel(G, Tp, Sp, T, S, is_causal, window, soft_cap, block, interpret)
    scaled = (query.astype(jnp.float32) * scale).astype(query.dtype)
    q, k, v = heads_major(scaled, key, value.astype(query.dtype))  # [B,K,G,T,H], [B,K,S,H], [B,K,S,H]
    q = jnp.pad(q, [(0, 0)] * 3 + [(0, Tp - T), (0, 0)])
    k, v = (jnp.pad(x, [(0, 0), (0, 0), (0, Sp - S), (0, 0)]) for x in (k, v))
    B = q.shape[0]
    reaches_right = not is_causal and (window is None or window[1] > 0)  # a real query could see a padded key
    if segment_ids is not None:  # T == S, so Tp == Sp: the padded tokens are one more document, -1
        ids = jnp.pad(segment_ids.astype(jnp.int32), ((0, 0), (0, Tp - T)), constant_values=-1)  # [B, Tp]
        q_ids, kv_ids = ids, ids
    elif reaches_right and Sp != S:  # padded keys get their own segment, which no query is in
        q_ids = jnp.zeros((B, Tp), jnp.int32)
        kv_ids = jnp.broadcast_to((jnp.arange(Sp) >= S).astype(jnp.int32).reshape(1, Sp), (B, Sp))
    else:
        q_ids = kv_ids = None

    def per_kv_head(q, k, v, q_ids, kv_ids):  # [G, Tp, H], [Sp, H], [Sp, H], [Tp], [Sp]
        segments = None if q_ids is None else SegmentIds(q=q_ids, kv=kv_ids)
        return kernel(q, k, v, segment_ids=segments)
    per_row = jax.vmap(per_kv_head, in_axes=(0, 0, 0, None, None))  # over K: one row's ids for every head
    out = jax.vmap(per_row)(q, k, v, q_ids, kv_ids)[:, :, :, :T]  # [B, K, G, T, H]
    if segment_ids is not None:  # padding (id 0) attends to nothing: zeros, as in the reference
        real = (segment_ids != 0).reshape(B, 1, 1, T, 1)
        out = jnp.where(real, out, jnp.zeros((), out.dtype))
    return heads_minor(out, query.dtype), None, None
