"""Flash attention's forward pass as a Pallas kernel: the teaching version (docs/theory.md §10).

The blockwise algorithm of `jaxattn.kernels.chunked`, written the way a GPU or TPU
runs it: a grid of programs, one per (batch row, query head, query block), each
holding a `[block_q, H]` tile of queries and walking the key blocks with the online
softmax (running max m, running sum l, unnormalised output acc, all float32), so
that no `[T, S]` array ever exists. The key blocks a query block meets are of
three kinds (`key_block_counts`):

* seen by every row of the query block: computed without a mask;
* partly hidden (the causal diagonal, or the last block with padding keys):
  computed and masked element by element;
* hidden from every row (above the causal diagonal): never computed. The loop
  stops before them, which is what halves the work of a causal pass.

Causal is end-aligned as everywhere in jaxattn: query i sits at position
i + S - T and sees keys j <= i + S - T. T and S are padded up to whole blocks
outside the kernel and the padding keys masked. MQA/GQA: query head n reads key/value
head n // G through the key BlockSpec's index map; keys and values are never repeated.

Forward only, and only the arguments above: no backward, no mask, bias, dropout,
window or lengths. It is not registered in `jaxattn.kernels`; the production paths
are "chunked" (any backend) and, on accelerators, cuDNN or splash attention. It runs
anywhere in Pallas interpret mode (the tests do, on CPU), slowly.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxattn._validate import require_float, require_positive_int, require_rank
from jaxattn.softmax import softmax_dtype


@dataclasses.dataclass(frozen=True)
class _Plan:
    """The static facts of one call that the kernel needs (hashable, so a jit cache key)."""

    T: int
    S: int
    block_q: int
    block_k: int
    is_causal: bool
    scale: float


def key_block_counts(q_block, *, T, S, block_q, block_k, is_causal):
    """For query block `q_block`: `(n_unmasked, n_visible)` key blocks.

    Key blocks `[0, n_unmasked)` are seen whole by every row of the query block (no
    mask needed), `[n_unmasked, n_visible)` are partly hidden (masked) and blocks from
    `n_visible` on are hidden from every row: the kernel never computes them.
    `q_block` may be a Python int or a traced scalar (`pl.program_id`).
    """
    if not is_causal:  # every row sees all S keys; only a last, part-padding block needs the mask
        first_row_sees = last_row_sees = S
    else:  # row i sees keys [0, i + S - T]: the block's first row sees the fewest, its last the most
        offset = S - T
        first_row_sees = jnp.clip(q_block * block_q + offset + 1, 0, S)
        last_row_sees = jnp.clip(jnp.minimum((q_block + 1) * block_q, T) + offset, 0, S)
    # Counts are >= 0 here, so // is the same floor on every backend.
    return first_row_sees // block_k, (last_row_sees + block_k - 1) // block_k


def flash_attention(query, key, value, *, is_causal=False, scale=None, block_q=128, block_k=128,
                    interpret=None):
    """query [B, T, N, H], key [B, S, K, H], value [B, S, K, Hv]; N a multiple of K (GQA/MQA: keys
    and values are never repeated; the grid maps query head n to kv head n // G). Returns
    [B, T, N, Hv] in query's dtype; logits and softmax in float32. is_causal is end-aligned like
    jaxattn (query i sees keys j <= i + S - T). A row with nothing to attend (only possible when
    T > S with causal) gives zeros, never NaN. interpret=None means: interpret mode unless running
    on a GPU or TPU backend (jax.default_backend())."""
    _validate(query, key, value, block_q, block_k)
    T, S, H = query.shape[1], key.shape[1], query.shape[3]
    if interpret is None:
        interpret = jax.default_backend() not in ("gpu", "tpu")
    # A short sequence gets one power-of-two block (block shapes GPUs accept) instead of a mostly
    # padding one.
    plan = _Plan(T, S, min(block_q, pl.next_power_of_2(T)), min(block_k, pl.next_power_of_2(S)),
                 bool(is_causal), 1.0 / math.sqrt(H) if scale is None else float(scale))
    return _forward(plan, query, key, value, bool(interpret))


@functools.partial(jax.jit, static_argnums=(0, 4))  # one compilation per plan and shapes, eager calls too
def _forward(plan: _Plan, query, key, value, interpret: bool):
    """Pad, run the grid, unpad. Heads-major, so that each grid cell reads contiguous [block, H] tiles."""
    T = plan.T
    q = _pad_to_blocks(query.transpose(0, 2, 1, 3), plan.block_q)  # [B,T,N,H] -> [B,N,Tp,H]
    k = _pad_to_blocks(key.transpose(0, 2, 1, 3), plan.block_k)  # [B,S,K,H] -> [B,K,Sp,H]
    v = _pad_to_blocks(value.transpose(0, 2, 1, 3), plan.block_k)  # [B,S,K,Hv] -> [B,K,Sp,Hv]
    out = _pallas_forward(plan, q, k, v, interpret)  # [B,N,Tp,Hv]
    return out[:, :, :T].transpose(0, 2, 1, 3)  # [B,N,T,Hv] -> [B,T,N,Hv]


def _validate(query, key, value, block_q, block_k):
    """Readable errors before tracing (shapes are static, so this costs nothing under jit)."""
    for name, x, layout in (("query", query, "[B, T, N, H]"), ("key", key, "[B, S, K, H]"),
                            ("value", value, "[B, S, K, Hv]")):
        require_rank(name, x, 4, layout)
        require_float(name, x)
    (B, _, N, H), (Bk, S, K, Hk), (Bv, Sv, Kv, _) = query.shape, key.shape, value.shape
    shapes = f"query {query.shape} [B, T, N, H], key {key.shape} [B, S, K, H], value {value.shape} [B, S, K, Hv]"
    if not B == Bk == Bv:
        raise ValueError(f"batch sizes B differ: {shapes}")
    if H != Hk:
        raise ValueError(f"head dims H of query and key differ: {shapes}")
    if (Sv, Kv) != (S, K):
        raise ValueError(f"value must match key in length S and heads K: {shapes}")
    if N % K:
        raise ValueError(f"query heads N={N} must be a multiple of key/value heads K={K}: {shapes}")
    require_positive_int("block_q", block_q)
    require_positive_int("block_k", block_k)


def _pad_to_blocks(x, block: int):
    """`[B, heads, L, H]` zero-padded along L to a whole number of blocks (the kernel masks padded keys)."""
    padded = pl.cdiv(x.shape[2], block) * block
    return jnp.pad(x, ((0, 0), (0, 0), (0, padded - x.shape[2]), (0, 0)))


def _pallas_forward(plan: _Plan, q, k, v, interpret: bool):
    """The grid: one program per (batch row b, query head n, query block i)."""
    B, N, Tp, H = q.shape
    K, Sp, Hv = k.shape[1], k.shape[2], v.shape[3]
    G = N // K  # query heads per key/value head
    sq = pl.squeezed  # a size-1 block dimension dropped from the kernel's view of the tile
    return pl.pallas_call(
        functools.partial(_flash_kernel, plan),
        grid=(B, N, Tp // plan.block_q),
        in_specs=[
            pl.BlockSpec((sq, sq, plan.block_q, H), lambda b, n, i: (b, n, i, 0)),  # q tile [bq, H]
            # The whole key sequence of kv head n // G: the kernel walks it block by block.
            pl.BlockSpec((sq, sq, Sp, H), lambda b, n, i: (b, n // G, 0, 0)),  # [Sp, H]
            pl.BlockSpec((sq, sq, Sp, Hv), lambda b, n, i: (b, n // G, 0, 0)),  # [Sp, Hv]
        ],
        out_specs=pl.BlockSpec((sq, sq, plan.block_q, Hv), lambda b, n, i: (b, n, i, 0)),  # [bq, Hv]
        out_shape=jax.ShapeDtypeStruct((B, N, Tp, Hv), q.dtype),
        interpret=interpret,
        name="jaxattn_flash_forward",
    )(q, k, v)


def _flash_kernel(plan: _Plan, q_ref, k_ref, v_ref, o_ref):
    """One query block: the online softmax over the key blocks it can see, then o = acc / l."""
    i = pl.program_id(2)  # which query block
    f32 = softmax_dtype(q_ref.dtype)  # float32 (float64 inputs stay float64, as everywhere in jaxattn)
    n_unmasked, n_visible = key_block_counts(i, T=plan.T, S=plan.S, block_q=plan.block_q,
                                             block_k=plan.block_k, is_causal=plan.is_causal)
    carry = (jnp.full((plan.block_q,), -jnp.inf, f32),  # m: running max of the logits
             jnp.zeros((plan.block_q,), f32),  # l: running sum of exp(logit - m)
             jnp.zeros((plan.block_q, v_ref.shape[-1]), f32))  # acc: running sum of exp(logit - m) v
    step = functools.partial(_online_step, plan, q_ref[...], k_ref, v_ref, i)
    carry = jax.lax.fori_loop(0, n_unmasked, functools.partial(step, False), carry)
    _, l, acc = jax.lax.fori_loop(n_unmasked, n_visible, functools.partial(step, True), carry)
    # l == 0: the row saw no key (causal, T > S). Defined as zeros (docs/theory.md §3), not 0/0.
    empty = l == 0
    out = jnp.where(empty[:, None], 0.0, acc / jnp.where(empty, 1.0, l)[:, None])
    o_ref[...] = out.astype(o_ref.dtype)


def _online_step(plan: _Plan, q, k_ref, v_ref, i, masked: bool, j, carry):
    """Fold key block j into (m, l, acc) for query block i (docs/theory.md §10's recurrence)."""
    m, l, acc = carry
    keys = pl.ds(j * plan.block_k, plan.block_k)
    k, v = k_ref[keys, :], v_ref[keys, :]  # [bk, H], [bk, Hv]
    s = jnp.einsum("TH,SH->TS", q, k, preferred_element_type=m.dtype) * plan.scale  # [bq, bk]
    if masked:  # only the partly hidden blocks pay for the mask
        s = jnp.where(_allowed(plan, i, j), s, -jnp.inf)
    m_new = jnp.maximum(m, s.max(axis=-1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # nothing seen yet: exp(-inf - 0) = 0, not NaN
    p = jnp.exp(s - m_safe[:, None])  # [bq, bk]
    alpha = jnp.exp(m - m_safe)  # rescales what was summed against the old max (<= 1)
    pv = jnp.einsum("TS,SH->TH", p.astype(v.dtype), v, preferred_element_type=acc.dtype)  # [bq, Hv]
    return m_new, alpha * l + p.sum(axis=-1), alpha[:, None] * acc + pv


def _allowed(plan: _Plan, i, j):
    """`[bq, bk]` bool for block pair (i, j): a real key (not padding) that the causal rule allows."""
    shape = (plan.block_q, plan.block_k)
    rows = i * plan.block_q + jax.lax.broadcasted_iota(jnp.int32, shape, 0) + (plan.S - plan.T)  # positions
    cols = j * plan.block_k + jax.lax.broadcasted_iota(jnp.int32, shape, 1)  # key indices
    allowed = cols < plan.S
    return allowed & (cols <= rows) if plan.is_causal else allowed
