"""Blockwise attention ("chunked"): an online softmax over key blocks, O(T) memory (docs/theory.md §10).

Contract: `jaxattn.scaled_dot_product_attention`'s, reverse mode only (`jax.jvp`
through it raises). Values and gradients equal the reference ("xla") to float32
summation order (tests/kernels/test_chunked.py, tests/kernels/test_chunked_features.py).

Queries are cut into blocks of `block_q` rows and keys into blocks of
`block_k`; T and S are padded up to whole blocks and the padding masked. For
each query block a scan step runs the online softmax (Rabe & Staats 2021,
FlashAttention) over the key blocks that can be visible to it: which block
pairs the causal / window rule (one- or two-sided) hides entirely is known from the static
T, S and window (`jaxattn.kernels.chunked_blocks`, the schedule), so those blocks are never computed,
and key blocks past every row's `key_value_seq_lengths` are skipped at run time. The
inner loop's bounds are per query block, so compile time does not grow with T.

Packed rows (`segment_ids`, docs/theory.md §27) skip the block pairs of different documents at run
time: a pair is computed only if, in some batch row, the range of the query block's nonzero ids
`[min, max]` overlaps the key block's (`chunked_blocks.segment_blocks`; padding, id 0, is left out of both). Two
blocks whose ranges do not overlap share no document, so skipping them is exact for any ids; it
skips all of another document's blocks when each document is one contiguous run and the ids rise
along the row (documents packed one after another, padding anywhere), which is how packed rows are
built: with ids in another order, fewer pairs are skipped, never a needed one. The loop's bounds
are narrowed to the first and last block pair that meet, and a pair in between that does not is
skipped by a `lax.cond`.

The forward keeps per query row only the output and the logsumexp of its
logits; the backward (FlashAttention-2's) walks the key blocks, recomputes each
visible block of weights from that logsumexp and uses dS = P * (dP - rowsum(dO * O)).
A soft cap (docs/theory.md §17) is recomputed per block too: the logits' gradient is dS times
1 - tanh^2, then the scale. Sinks (§18) start each row's running max and sum (max = sink,
sum = 1), so the logsumexp includes them; their gradient is -sum_t exp(sink - lse) * rowsum(dO * O).
Residuals are the inputs, the output and the logsumexp: never a `[T, S]` array
(a full-size `bias` is itself `[T, S]`, and so is its gradient). Heads go in
front (`[B, K, G, T, H]`) as in `custom_vjp`; keys and values are never
repeated for MQA/GQA. Dropout and `return_weights` use the reference. The logsumexp is
returned as the residual on request (`return_residual`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxattn.kernels._call import reference_unless, weights_or_dropout
from jaxattn.kernels._grouping import group_heads, heads_major, heads_minor
from jaxattn.kernels.chunked_blocks import (Plan, key_block_ranges, pad, query_block_ranges, segment_blocks,
                                            when_meets)
from jaxattn.masks import key_offsets
from jaxattn.softmax import softmax_dtype


# Rows per query block and keys per key block: 512 x 256 ran fastest of 128-1024 x 128-512 on a CPU,
# forward and forward+backward, at 1024 and 4096 tokens (docs/performance.md, "Long sequences").
# Compile time does not depend on the number of blocks.
BLOCK_Q = 512
BLOCK_K = 256


@reference_unless(weights_or_dropout)
def attention(query, key, value, *, mask, bias, is_causal, scale, dropout_rate, dropout_rng,
              return_weights, local_window_size=None, key_value_seq_lengths=None, logits_soft_cap=None,
              sinks=None, return_residual=False, segment_ids=None, block_q=BLOCK_Q, block_k=BLOCK_K):
    """Same arguments and results as `jaxattn.kernels.xla.attention`, plus the block sizes.

    `local_window_size` is None or `(left, right)`; `sinks` `[N]`; `segment_ids` `[B, T]` (T == S) or
    None; returns `(out, None, lse or None)`.
    """
    T, N = query.shape[1:3]
    S, K = key.shape[1:3]
    window = None if local_window_size is None else tuple(int(w) for w in local_window_size)
    soft_cap = None if logits_soft_cap is None else float(logits_soft_cap)
    plan = Plan(T, S, min(block_q, T), min(block_k, S), is_causal, window, scale, soft_cap)
    q, k, v = heads_major(query, key, value)  # [B,K,G,T,H], [B,K,S,H], [B,K,S,Hv]
    q, k, v = pad(q, 3, plan.Tp), pad(k, 2, plan.Sp), pad(v, 2, plan.Sp)  # padded to whole blocks
    mask = None if mask is None else _pad_grouped(plan, group_heads(mask, K), False)
    bias = None if bias is None else _pad_grouped(plan, group_heads(bias, K), 0)
    if sinks is not None:  # [N] -> [K, G]: query head n = k * G + g
        sinks = jnp.reshape(jnp.asarray(sinks), (K, N // K)).astype(softmax_dtype(query.dtype))
    segments = None
    if segment_ids is not None:  # the padding to whole blocks is id 0: never attended, attends to nothing
        segments = (pad(segment_ids, 1, plan.Tp), pad(segment_ids, 1, plan.Sp))  # [B, Tp], [B, Sp]
    out, lse = _attention(plan, q, k, v, bias, mask, key_value_seq_lengths, sinks, segments)
    out = heads_minor(out[:, :, :, :T], query.dtype)  # [B,K,G,Tp,Hv] -> [B,T,N,Hv]
    if not return_residual:
        return out, None, None
    B = query.shape[0]
    lse = jax.lax.stop_gradient(lse[:, :, :, :T]).transpose(0, 3, 1, 2).reshape(B, T, N)  # [B,T,N]
    return out, None, lse



def _pad_grouped(plan: Plan, x, value):
    """A grouped mask or bias `[b, k, g, t, s]` padded along T and S where it is not broadcast."""
    x = pad(x, 3, plan.Tp, value) if x.shape[3] > 1 else x
    return pad(x, 4, plan.Sp, value) if x.shape[4] > 1 else x


def _block_index(plan: Plan, x, i, j):
    """Start and size of block pair (i, j) in a grouped `[b, k, g, t, s]` (broadcast axes stay 1)."""
    t0, tn = (i * plan.bq, plan.bq) if x.shape[3] > 1 else (0, 1)
    s0, sn = (j * plan.bk, plan.bk) if x.shape[4] > 1 else (0, 1)
    return (0, 0, 0, t0, s0), x.shape[:3] + (tn, sn)


def _block(plan: Plan, x, i, j):
    return jax.lax.dynamic_slice(x, *_block_index(plan, x, i, j))


def _rows(x, start, size: int, axis: int):
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis)


def _allowed(plan: Plan, i, j, mask, bias_block, lengths, segments=None):
    """Which (query, key) of block pair (i, j) may attend: broadcastable to `[B, K, G, bq, bk]`.

    Every operand is 5-D, so that no rank is promoted implicitly.
    """
    rows = i * plan.bq + jnp.arange(plan.bq).reshape(1, 1, 1, -1, 1) + (plan.S - plan.T)  # absolute positions
    cols = j * plan.bk + jnp.arange(plan.bk).reshape(1, 1, 1, 1, -1)
    allowed = cols < plan.S  # the padding keys
    lo, hi = key_offsets(plan.is_causal, plan.window)
    if hi is not None:
        allowed = allowed & (cols - rows <= hi)
    if lo is not None:
        allowed = allowed & (cols - rows >= lo)
    if lengths is not None:
        allowed = allowed & (cols < lengths.reshape(-1, 1, 1, 1, 1))
    if mask is not None:
        allowed = allowed & _block(plan, mask, i, j)
    if segments is not None:  # same document, not padding (id 0): `jaxattn.masks.segment_mask` of the block
        B = segments[0].shape[0]
        q_ids = _rows(segments[0], i * plan.bq, plan.bq, 1).reshape(B, 1, 1, plan.bq, 1)
        kv_ids = _rows(segments[1], j * plan.bk, plan.bk, 1).reshape(B, 1, 1, 1, plan.bk)
        allowed = allowed & (q_ids == kv_ids) & (q_ids != 0)
    if bias_block is not None:  # a key biased to -inf is hidden, as in the reference
        allowed = allowed & (bias_block != -jnp.inf)
    return allowed


def _logits(plan: Plan, q_i, k, bias, mask, lengths, segments, i, j):
    """Block pair (i, j): logits `[B,K,G,bq,bk]` in float32 (float64 stays), where they are allowed,
    and the soft cap's tanh (None without one: the backward's 1 - tanh^2)."""
    k_j = _rows(k, j * plan.bk, plan.bk, 2)
    s = jnp.einsum("BKGTH,BKSH->BKGTS", q_i, k_j, preferred_element_type=softmax_dtype(q_i.dtype))
    s = s * plan.scale
    tanh = None
    if plan.soft_cap is not None:  # c * tanh(s / c), before the bias and masks (§17)
        tanh = jnp.tanh(s / plan.soft_cap)
        s = plan.soft_cap * tanh
    bias_block = None if bias is None else _block(plan, bias, i, j)
    if bias_block is not None:
        s = s + bias_block.astype(s.dtype)
    return s, _allowed(plan, i, j, mask, bias_block, lengths, segments), tanh


def _online_step(plan: Plan, q_i, k, v, bias, mask, lengths, segments, i, j, carry):
    """One key block of the online softmax: running max m, sum l and unnormalised output acc."""
    m, l, acc = carry
    s, allowed, _ = _logits(plan, q_i, k, bias, mask, lengths, segments, i, j)
    s = jnp.where(allowed, s, -jnp.inf)
    m_new = jnp.maximum(m, s.max(axis=-1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # nothing visible yet: exp(-inf - 0) = 0, not NaN
    p = jnp.exp(s - m_safe[..., None])  # [B,K,G,bq,bk]
    alpha = jnp.exp(m - m_safe)  # rescales what was summed against the old max
    v_j = _rows(v, j * plan.bk, plan.bk, 2)
    pv = jnp.einsum("BKGTS,BKSH->BKGTH", p.astype(v.dtype), v_j, preferred_element_type=acc.dtype)
    return m_new, alpha * l + p.sum(axis=-1), alpha[..., None] * acc + pv


def _forward_blocks(plan: Plan, q, k, v, bias, mask, lengths, sinks, segments):
    """`out [B,K,G,Tp,Hv]` (float32) and `lse [B,K,G,Tp]` (-inf on rows that see no key and no sink)."""
    B, K, G, _, _ = q.shape
    f32 = softmax_dtype(q.dtype)
    meet = None if segments is None else segment_blocks(*segments, plan.bq, plan.bk)  # [nq, nk]
    start, stop = key_block_ranges(plan, lengths, meet)

    def one_query_block(_, i):
        q_i = _rows(q, i * plan.bq, plan.bq, 3)
        stats = jnp.zeros((B, K, G, plan.bq), f32)
        if sinks is None:  # nothing seen yet: max -inf, sum 0
            m, l = stats - jnp.inf, stats
        else:  # the sink is a logit every row sees, with no value: max = sink, sum = exp(0)
            m, l = stats + sinks.reshape(1, K, G, 1).astype(f32), stats + 1.0
        init = (m, l, jnp.zeros((B, K, G, plan.bq, v.shape[-1]), f32))
        step = functools.partial(_online_step, plan, q_i, k, v, bias, mask, lengths, segments, i)
        m, l, acc = jax.lax.fori_loop(start[i], stop[i], when_meets(None if meet is None else meet[i], step), init)
        # A row with no visible key (and no sink) has l = 0 and acc = 0: zeros, and lse = -inf (its P is
        # zeroed by `allowed` in the backward). (l == 0, not l > 0: a NaN input stays NaN, as in the reference.)
        empty = l == 0
        safe = jnp.where(empty, 1.0, l)
        return None, (acc / safe[..., None], jnp.where(empty, -jnp.inf, m + jnp.log(safe)))

    _, (out, lse) = jax.lax.scan(one_query_block, None, jnp.arange(plan.Tp // plan.bq))
    out = jnp.moveaxis(out, 0, 3).reshape(B, K, G, plan.Tp, v.shape[-1])  # [nq,B,K,G,bq,Hv] -> [B,K,G,Tp,Hv]
    return out, jnp.moveaxis(lse, 0, 3).reshape(B, K, G, plan.Tp)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(plan, q, k, v, bias, mask, lengths, sinks, segments):
    """`(out, lse)`; lse's cotangent is ignored (the residual is returned under stop_gradient)."""
    return _forward_blocks(plan, q, k, v, bias, mask, lengths, sinks, segments)


def _forward(plan, q, k, v, bias, mask, lengths, sinks, segments):
    out, lse = _forward_blocks(plan, q, k, v, bias, mask, lengths, sinks, segments)
    # O(T): no block of weights is kept
    return (out, lse), (q, k, v, bias, mask, lengths, sinks, segments, out, lse)


def _backward_step(plan, res, d_out, delta, j, i, carry):
    """Query block i against key block j: recompute P from the logsumexp, accumulate every gradient."""
    q, k, v, bias, mask, lengths, _, segments, _, lse = res
    d_k, d_v, d_q, d_bias = carry
    q_i, do_i = _rows(q, i * plan.bq, plan.bq, 3), _rows(d_out, i * plan.bq, plan.bq, 3)
    s, allowed, tanh = _logits(plan, q_i, k, bias, mask, lengths, segments, i, j)
    p = jnp.where(allowed, jnp.exp(s - _rows(lse, i * plan.bq, plan.bq, 3)[..., None]), 0.0)
    v_j, k_j = _rows(v, j * plan.bk, plan.bk, 2), _rows(k, j * plan.bk, plan.bk, 2)
    d_v = d_v + jnp.einsum("BKGTS,BKGTH->BKSH", p, do_i)
    d_p = jnp.einsum("BKGTH,BKSH->BKGTS", do_i, v_j, preferred_element_type=p.dtype)
    d_s = p * (d_p - _rows(delta, i * plan.bq, plan.bq, 3)[..., None])  # 0 where masked
    if d_bias is not None:  # the bias is added after the cap: its gradient is dS itself
        d_bias = _add_block(plan, d_bias, d_s, i, j)
    if tanh is not None:  # through c * tanh(x / c): times 1 - tanh^2 (the scale comes at the end)
        d_s = d_s * (1.0 - tanh * tanh)
    d_k = d_k + jnp.einsum("BKGTS,BKGTH->BKSH", d_s, q_i, preferred_element_type=p.dtype)
    d_q_i = jnp.einsum("BKGTS,BKSH->BKGTH", d_s, k_j, preferred_element_type=p.dtype)
    d_q = jax.lax.dynamic_update_slice_in_dim(d_q, _rows(d_q, i * plan.bq, plan.bq, 3) + d_q_i, i * plan.bq, 3)
    return d_k, d_v, d_q, d_bias


def _add_block(plan: Plan, acc, d_s, i, j):
    """`acc` (a grouped bias's gradient) plus `d_s [B,K,G,bq,bk]` summed to its block's broadcast shape."""
    index, shape = _block_index(plan, acc, i, j)
    axes = tuple(a for a, (n, m) in enumerate(zip(d_s.shape, shape)) if m == 1 and n != 1)
    part = d_s.sum(axis=axes, keepdims=True).reshape(shape)
    return jax.lax.dynamic_update_slice(acc, jax.lax.dynamic_slice(acc, index, shape) + part, index)


def _backward(plan, res, cotangents):
    q, k, v, bias, mask, lengths, sinks, segments, out, lse = res
    d_out, _ = cotangents  # lse's cotangent: the residual is returned under stop_gradient
    f32 = out.dtype
    d_out = d_out.astype(f32)
    delta = jnp.einsum("BKGTH,BKGTH->BKGT", d_out, out)  # rowsum(dO * O) = rowsum(dP * P), §15
    meet = None if segments is None else segment_blocks(*segments, plan.bq, plan.bk)  # [nq, nk]
    start, stop = query_block_ranges(plan, lengths, meet)
    B, K, _, _ = k.shape

    def one_key_block(carry, j):
        d_q, d_bias = carry
        init = (jnp.zeros((B, K, plan.bk, k.shape[-1]), f32), jnp.zeros((B, K, plan.bk, v.shape[-1]), f32),
                d_q, d_bias)
        step = functools.partial(_backward_step, plan, res, d_out, delta, j)
        step = when_meets(None if meet is None else meet[:, j], step)  # pairs of different documents skipped
        d_k, d_v, d_q, d_bias = jax.lax.fori_loop(start[j], stop[j], step, init)
        return (d_q, d_bias), (d_k, d_v)

    d_bias = None if bias is None else jnp.zeros(bias.shape, f32)
    (d_q, d_bias), (d_k, d_v) = jax.lax.scan(one_key_block, (jnp.zeros(q.shape, f32), d_bias),
                                             jnp.arange(plan.Sp // plan.bk))
    d_k, d_v = (jnp.moveaxis(x, 0, 2).reshape(B, K, plan.Sp, -1) for x in (d_k, d_v))  # [nk,B,K,bk,H] -> [B,K,Sp,H]
    d_bias = None if bias is None else d_bias.astype(bias.dtype)
    d_sinks = None
    if sinks is not None:  # the sink's weight exp(sink - lse) times dP_sink - delta, with dP_sink = 0 (no value)
        p_sink = jnp.where(lse == -jnp.inf, 0.0, jnp.exp(sinks.reshape(1, K, -1, 1) - lse))  # [B,K,G,Tp]
        d_sinks = -(p_sink * delta).sum(axis=(0, 3)).astype(sinks.dtype)  # [K, G]
    return ((d_q * plan.scale).astype(q.dtype), (d_k * plan.scale).astype(k.dtype), d_v.astype(v.dtype),
            d_bias, None, None, d_sinks, None)


_attention.defvjp(_forward, _backward)
