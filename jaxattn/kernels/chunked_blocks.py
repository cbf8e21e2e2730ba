"""Which block pairs the blockwise kernel (`jaxattn.kernels.chunked`) computes, known before it runs.

Queries are cut into blocks of `bq` rows and keys into blocks of `bk` (`Plan`: T and S padded up to
whole blocks, `pad`). Which block pairs the causal / window rule (one- or two-sided) hides entirely is
known from the static T, S and window (`visible_blocks`): per query block the visible key blocks are one
interval (`key_block_ranges`), and per key block the query blocks that see it (`query_block_ranges`,
the backward's loop). Key blocks past every row's `key_value_seq_lengths` are cut at run time.

Packed rows (`segment_ids`, docs/theory.md §27): a pair is computed only if, in some batch row, the
range of the query block's nonzero ids `[min, max]` overlaps the key block's (`segment_blocks`); the
loop's bounds are narrowed to the first and last pair that meet, and a pair in between that does not
is skipped by a `lax.cond` (`when_meets`). `blocks_computed` is every pair computed, for tests and
readers.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn.masks import key_offsets


@dataclasses.dataclass(frozen=True)
class Plan:
    """The static shape of one call: lengths, block sizes, the structural mask, the scale and soft cap."""

    T: int
    S: int
    bq: int
    bk: int
    is_causal: bool
    window: tuple[int, int] | None  # (left, right): jax.nn's local_window_size
    scale: float
    soft_cap: float | None = None

    @property
    def Tp(self) -> int:  # T padded to whole query blocks
        return -(-self.T // self.bq) * self.bq

    @property
    def Sp(self) -> int:
        return -(-self.S // self.bk) * self.bk


def visible_blocks(T: int, S: int, bq: int, bk: int, is_causal: bool,
                   window: tuple[int, int] | None) -> np.ndarray:
    """`[nq, nk]` bool: True where block pair (i, j) holds a (query, key) the causal/window rule allows.

    Positions are end-aligned (query t sits at p = t + S - T); the rule bounds j - p to an interval
    (`jaxattn.masks.key_offsets`), so each row and each column of True is one interval (a band).
    """
    nq, nk = -(-T // bq), -(-S // bk)
    lo, hi = key_offsets(is_causal, window)
    q_first = np.arange(nq) * bq + (S - T)  # absolute positions of each block's first and last query
    q_last = np.minimum(np.arange(1, nq + 1) * bq, T) - 1 + (S - T)
    k_first, k_last = np.arange(nk) * bk, np.minimum(np.arange(1, nk + 1) * bk, S) - 1
    visible = np.ones((nq, nk), bool)  # the pair's offsets j - p span [k_first - q_last, k_last - q_first]
    if hi is not None:
        visible &= k_first[None, :] - q_last[:, None] <= hi
    if lo is not None:
        visible &= k_last[None, :] - q_first[:, None] >= lo
    return visible


def intervals(visible: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`[n, m]` bool with one interval of True per row -> `(start, stop)` per row (stop == start: none)."""
    any_ = visible.any(axis=1)
    start = np.where(any_, visible.argmax(axis=1), 0)
    stop = np.where(any_, visible.shape[1] - visible[:, ::-1].argmax(axis=1), 0)
    assert all(visible[i, a:b].all() and visible[i].sum() == b - a for i, (a, b) in enumerate(zip(start, stop)))
    return start.astype(np.int32), stop.astype(np.int32)


def segment_blocks(q_segments, kv_segments, bq: int, bk: int) -> jax.Array:
    """`[nq, nk]` bool: False where query block i and key block j share no document in any batch row,
    so that the pair is skipped (docs/theory.md §27).

    Per block, the minimum and maximum of its nonzero ids (padding, id 0, attends to nothing and is
    never attended): blocks whose ranges do not overlap hold no common id. Exact for any ids; for
    packed rows (documents one after another, ids rising) it is False for every pair of blocks of
    different documents.

    Args:
      q_segments: `[B, T]` integer ids of the queries, T a multiple of `bq` (pad with 0).
      kv_segments: `[B, S]` integer ids of the keys, S a multiple of `bk`.
    """
    def ranges(ids, block):  # [B, L] -> per block, the min and max nonzero id [B, n] (max < min: none)
        B, L = ids.shape
        ids = ids.reshape(B, L // block, block)
        big = jnp.iinfo(ids.dtype).max
        return jnp.where(ids == 0, big, ids).min(axis=-1), jnp.where(ids == 0, 0, ids).max(axis=-1)
    q_min, q_max = ranges(q_segments, bq)  # [B, nq]
    k_min, k_max = ranges(kv_segments, bk)  # [B, nk]
    meet = (k_min[:, None, :] <= q_max[:, :, None]) & (k_max[:, None, :] >= q_min[:, :, None])  # [B, nq, nk]
    return meet.any(axis=0)


def blocks_computed(T: int, S: int, bq: int, bk: int, is_causal: bool, window: tuple[int, int] | None = None,
                    segment_ids=None) -> np.ndarray:
    """`[nq, nk]` bool: the block pairs the forward pass computes for these shapes and, with packed rows,
    `segment_ids` `[B, T]` (T == S): `visible_blocks` and `segment_blocks` together, what the loop's
    bounds and its `lax.cond` let through (`key_value_seq_lengths` may skip more). For tests and
    readers: `attention` computes the same pairs without this array."""
    computed = visible_blocks(T, S, bq, bk, is_causal, window)
    if segment_ids is not None:
        Tp, Sp = -(-T // bq) * bq, -(-S // bk) * bk
        ids = jnp.asarray(segment_ids, jnp.int32)
        computed = computed & np.asarray(segment_blocks(pad(ids, 1, Tp), pad(ids, 1, Sp), bq, bk))
    return computed


def _narrowed(start, stop, meet):
    """`[start, stop)` per row of `meet [n, m]` cut to its first and last True (stop == start: none)."""
    m = meet.shape[1]
    any_ = meet.any(axis=1)
    first = jnp.argmax(meet, axis=1).astype(jnp.int32)
    last = (m - jnp.argmax(meet[:, ::-1], axis=1)).astype(jnp.int32)
    start = jnp.maximum(start, first)
    stop = jnp.where(any_, jnp.minimum(stop, last), start)
    return start, jnp.maximum(stop, start)


def key_block_ranges(plan: Plan, lengths, meet=None):
    """Per query block, the key blocks `[start, stop)` to compute (int32 `[nq]` each); `meet` is
    `segment_blocks` (or None)."""
    start, stop = intervals(visible_blocks(plan.T, plan.S, plan.bq, plan.bk, plan.is_causal, plan.window))
    start, stop = jnp.asarray(start), jnp.asarray(stop)
    if lengths is not None:  # key blocks past every row's length hold no visible key
        stop = jnp.minimum(stop, -(-jnp.max(lengths) // plan.bk)).astype(jnp.int32)
    if meet is not None:  # the first and last key blocks that share a document with the query block
        start, stop = _narrowed(start, stop, meet)
    return start, stop


def query_block_ranges(plan: Plan, lengths, meet=None):
    """Per key block, the query blocks `[start, stop)` that see it (int32 `[nk]` each)."""
    start, stop = intervals(visible_blocks(plan.T, plan.S, plan.bq, plan.bk, plan.is_causal, plan.window).T)
    start, stop = jnp.asarray(start), jnp.asarray(stop)
    if lengths is not None:
        past = jnp.arange(len(start)) * plan.bk >= jnp.max(lengths)
        stop = jnp.where(past, start, stop)
    if meet is not None:
        start, stop = _narrowed(start, stop, meet.T)
    return start, stop


def when_meets(meets, step):
    """`step(index, carry)` where `meets[index]` is True, the carry unchanged elsewhere (a block pair of
    different documents, between the first and last that meet); `step` itself without `meets`."""
    if meets is None:
        return step
    return lambda index, carry: jax.lax.cond(meets[index], step, lambda _, c: c, index, carry)


def pad(x, axis: int, size: int, value=0):
    """`x` padded with `value` at the end of `axis` to `size` (whole blocks)."""
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)
