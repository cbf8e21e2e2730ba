"""Boolean attention masks. Convention everywhere: True = the query attends to the key.

Masks are `[T, S]` (query length by key length) or broadcastable to
`[B, N, T, S]`. Causal masks are aligned to the *end* of the keys: query `i`
sees key `j` iff `j <= i + (S - T)`, so a block of T new queries that follows
S - T cached keys sees everything before it and nothing after
(docs/theory.md §3). Local windows are end-aligned the same way: query `i`
sits at absolute position `p = i + S - T` (`local_window_mask`, jax.nn's
`(left, right)` meaning; `sliding_window_mask` is the model's window W, the
query and W - 1 keys back). A cache is read by absolute position instead
(`visible_cache_slots`, docs/theory.md §9). Packed rows (several documents in one row,
docs/theory.md §27) are masked by their segment ids (`segment_mask`) and numbered from 0 per
document (`segment_positions`).

Every function here builds its result from operands of equal rank, so it runs
under `jax.numpy_rank_promotion("raise")`; `combine_masks` adds the leading axes
of lower-rank masks explicitly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn._validate import (concrete_or_none, is_int, require_bool, require_integer, require_positive_int,
                               require_rank)


def _query_key_offsets(q_len: int, kv_len: int) -> jnp.ndarray:
    """`[T, S]` int array of (absolute query position) - (key position)."""
    query_pos = jnp.arange(q_len)[:, None] + (kv_len - q_len)
    key_pos = jnp.arange(kv_len)[None, :]
    return query_pos - key_pos


def causal_mask(q_len: int, kv_len: int | None = None) -> jnp.ndarray:
    """`[T, S]` boolean mask, True where key j is not in the future of query i.

    Args:
      q_len: T, number of queries (the last T positions of the sequence).
      kv_len: S, number of keys; defaults to T.
    """
    kv_len = q_len if kv_len is None else kv_len
    require_positive_int("q_len", q_len)
    require_positive_int("kv_len", kv_len)
    return _query_key_offsets(q_len, kv_len) >= 0


def sliding_window_mask(q_len: int, kv_len: int, window: int) -> jnp.ndarray:
    """`[T, S]` causal mask that also hides keys `window` or more positions back.

    Each query sees itself and the `window - 1` keys before it (Mistral's
    convention, the model's `sliding_window`: a window of 1 is the diagonal alone).
    The same mask as `local_window_mask(T, S, (window - 1, 0))`.
    """
    require_positive_int("window", window)
    return local_window_mask(q_len, kv_len, (window - 1, 0))


def window_sides(window) -> tuple[int, int]:
    """`local_window_size` as `(left, right)`: an int w is `(w, w)` (jax.nn's meaning); ValueError otherwise.

    Each side must be a non-negative integer (a bool is refused).
    """
    sides = (window, window) if is_int(window) else window
    if not isinstance(sides, (tuple, list)) or len(sides) != 2 or not all(is_int(w) and w >= 0 for w in sides):
        raise ValueError("local_window_size must be a non-negative int w (meaning (w, w)) or a pair "
                         f"(left, right) of non-negative ints, got {window!r}")
    return int(sides[0]), int(sides[1])


def key_offsets(is_causal: bool, window: tuple[int, int] | None) -> tuple[int | None, int | None]:
    """`(lo, hi)`: the causal mask and a window `(left, right)` let the query at absolute position p see
    key j iff `lo <= j - p <= hi` (None: no bound on that side), the rule of `causal_mask` and
    `local_window_mask` as two numbers.

    A window bounds j - p to `[-left, right]`; causality also bounds it above by 0. The kernels
    read from these bounds which key blocks a query block can see (`jaxattn.kernels.chunked`) and
    whether a query row sees no key (`jaxattn.kernels.splash`), without building a mask.
    """
    lo, hi = (None, None) if window is None else (-window[0], window[1])
    if is_causal:
        hi = 0 if hi is None else min(hi, 0)
    return lo, hi


def local_window_mask(q_len: int, kv_len: int, window) -> jnp.ndarray:
    """`[T, S]` mask of a local window `(left, right)`: the query at absolute position p sees keys
    `p - left .. p + right` (an int w means `(w, w)`), jax.nn's `local_window_size`.

    Positions are end-aligned like `causal_mask` (query i sits at `p = i + S - T`; jax.nn aligns
    at the start, which differs only when T != S). Not causal by itself: `(W - 1, 0)` together with
    a causal mask is `sliding_window_mask(T, S, W)`, and so is `(W - 1, 0)` alone.
    """
    require_positive_int("q_len", q_len)
    require_positive_int("kv_len", kv_len)
    left, right = window_sides(window)
    offsets = _query_key_offsets(q_len, kv_len)  # p - j
    return (offsets <= left) & (offsets >= -right)


def check_lengths(name: str, lengths, bound: int, bound_name: str, shapes: str = "") -> None:
    """ValueError unless every length is in `[0, bound]`, when their values are known (outside `jit`;
    under `jit` a length outside gives the mask of the nearest valid one, unchecked). The one rule
    of `padding_mask` and of the attention functions' `key_value_seq_lengths`/`query_seq_lengths`."""
    known = concrete_or_none(lengths)
    if known is not None and known.size and (known.min() < 0 or known.max() > bound):
        where = f" for {shapes}" if shapes else ""
        raise ValueError(f"{name} must be in [0, {bound_name}={bound}]{where}, got {known.tolist()}")


def padding_mask(lengths, max_len: int) -> jnp.ndarray:
    """`[B, 1, 1, S]` mask, True where key position `j < lengths[b]`.

    Args:
      lengths: `[B]` integer count of real (non-padding) keys in each row, in `[0, max_len]`
        (`check_lengths`, the rule `key_value_seq_lengths` follows too); padding is on the right.
      max_len: S, the padded key length.
    """
    lengths = jnp.asarray(lengths)
    require_rank("lengths", lengths, 1, "[B]")
    require_integer("lengths", lengths)
    require_positive_int("max_len", max_len)
    check_lengths("lengths", lengths, max_len, "max_len")
    valid = jnp.arange(max_len)[None, :] < lengths[:, None]  # [B, S]
    return valid[:, None, None, :]


def visible_cache_slots(query_positions, num_slots: int, window: int | None = None) -> jnp.ndarray:
    """`[B, 1, T, L]` mask of a KV cache: slot j is visible to a query at absolute position p iff j <= p
    (and, with a sliding `window` W, p - j < W: `sliding_window_mask`'s rule).

    The one visibility rule of cached attention (slot = absolute position,
    docs/theory.md §9): slots a row has not written yet, and padding written
    past a row's length, are never visible to its real queries.

    Args:
      query_positions: `[B, T]` integer absolute positions of the queries.
      num_slots: L, the cache slots per row.
      window: None (no window) or a positive int.
    """
    query_positions = jnp.asarray(query_positions)
    require_rank("query_positions", query_positions, 2, "[B, T]")
    require_integer("query_positions", query_positions)
    require_positive_int("num_slots", num_slots)
    slots = jnp.arange(num_slots)[None, None, :]
    positions = query_positions[:, :, None]
    visible = slots <= positions  # [B, T, L]
    if window is not None:
        require_positive_int("window", window)
        visible = visible & (slots > positions - window)  # p - j < W
    return visible[:, None]  # [B, 1, T, L]


def combine_masks(*masks) -> jnp.ndarray | None:
    """Logical AND of boolean masks, broadcasting; `None` entries are ignored.

    Masks of lower rank get leading axes of size 1 (numpy's rule, done explicitly so
    that it holds under `jax.numpy_rank_promotion("raise")`): a `[T, S]` causal mask
    combines with a `[B, 1, 1, S]` padding mask into `[B, 1, T, S]`.
    Returns None when every argument is None (no masking at all).
    """
    present = [jnp.asarray(m) for m in masks if m is not None]
    if not present:
        return None
    for i, m in enumerate(masks):  # i is the caller's argument index
        if m is not None:
            require_bool(f"masks[{i}]", jnp.asarray(m))
    rank = max(m.ndim for m in present)
    present = [m.reshape((1,) * (rank - m.ndim) + m.shape) for m in present]
    combined = present[0]
    for m in present[1:]:
        combined = jnp.logical_and(combined, m)
    return combined


def mask_to_bias(mask, dtype=jnp.float32) -> jnp.ndarray:
    """Additive bias from a boolean mask: 0 where True, a large negative where False.

    The large negative is the dtype's most negative finite value rather than
    -inf, so that a fully masked row stays finite (it becomes uniform, not NaN).
    """
    mask = jnp.asarray(mask)
    require_bool("mask", mask)
    return jnp.where(mask, jnp.asarray(0, dtype), jnp.finfo(dtype).min).astype(dtype)


def check_segment_ids(name: str, segment_ids, shape: tuple[int, ...], layout: str, shapes: str = ""):
    """`segment_ids` as an int32 array once it is known to be integers of `shape` (`layout`, e.g.
    "[B, T]"), else a TypeError (not an integer array) or a ValueError naming `name`, the shapes and
    `shapes` (the other arguments). Values are checked when known (outside `jit`): ids are >= 0.

    The convention of packed rows (docs/theory.md §27): id 0 is padding, which attends to nothing
    and is never attended; ids 1, 2, ... number the documents of a row.
    """
    where = f" for {shapes}" if shapes else ""
    if not hasattr(segment_ids, "shape"):
        raise TypeError(f"{name} must be an integer array {layout} = {shape}, got {type(segment_ids).__name__}")
    segment_ids = jnp.asarray(segment_ids)
    if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array {layout} = {tuple(shape)}, got dtype {segment_ids.dtype} "
                        f"of shape {segment_ids.shape}{where}")
    if segment_ids.shape != tuple(shape):
        raise ValueError(f"{name} must be {layout} = {tuple(shape)}, got shape {segment_ids.shape}{where}")
    known = concrete_or_none(segment_ids)
    if known is not None and known.size and known.min() < 0:
        raise ValueError(f"{name} must be >= 0 (0 = padding, 1, 2, ... the documents of a row), "
                         f"got a minimum of {known.min()}")
    return segment_ids.astype(jnp.int32)


def segment_mask(q_segments, kv_segments) -> jnp.ndarray:
    """`[B, 1, T, S]` mask of packed rows: query t sees key s iff both belong to the same document,
    `q_segments[b, t] == kv_segments[b, s] != 0` (id 0 is padding: it attends to nothing and is
    never attended; docs/theory.md §27).

    Combine it with `causal_mask` or `sliding_window_mask` (`combine_masks`) for a packed causal
    model: each token then sees the tokens before it in its own document only.

    Args:
      q_segments: `[B, T]` integer document ids of the queries.
      kv_segments: `[B, S]` integer document ids of the keys (the same array for self-attention).
    """
    q_segments, kv_segments = jnp.asarray(q_segments), jnp.asarray(kv_segments)
    require_rank("q_segments", q_segments, 2, "[B, T]")
    require_rank("kv_segments", kv_segments, 2, "[B, S]")
    require_integer("q_segments", q_segments)
    require_integer("kv_segments", kv_segments)
    if q_segments.shape[0] != kv_segments.shape[0]:
        raise ValueError(f"q_segments {q_segments.shape} [B, T] and kv_segments {kv_segments.shape} [B, S] "
                         "have different batch sizes")
    (B, T), S = q_segments.shape, kv_segments.shape[1]
    q = q_segments.reshape(B, 1, T, 1)
    kv = kv_segments.reshape(B, 1, 1, S)
    return (q == kv) & (q != 0)  # q != 0 and q == kv: kv != 0 too


def segment_positions(segment_ids) -> jnp.ndarray:
    """`[B, T]` int32 positions that restart at 0 at each document's first token (docs/theory.md §27).

    A document is a run of equal nonzero ids; padding (id 0) gets position 0, so that a position
    never exceeds the longest document. The ids of a row must keep each document in one run
    (packed documents one after another): a ValueError when the values are known and an id comes
    back after another one, which the masks would treat as one document with two starts.

    Args:
      segment_ids: `[B, T]` integer document ids (0 = padding).
    """
    segment_ids = jnp.asarray(segment_ids)
    require_rank("segment_ids", segment_ids, 2, "[B, T]")
    require_integer("segment_ids", segment_ids)
    B, T = segment_ids.shape
    _check_contiguous(segment_ids)
    index = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32).reshape(1, T), (B, T))
    previous = jnp.concatenate([segment_ids[:, :1], segment_ids[:, :-1]], axis=1)  # token t - 1's id (t = 0: its own)
    starts = jnp.where((index == 0) | (segment_ids != previous), index, 0)  # [B, T]: t where a run begins, else 0
    first = jax.lax.cummax(starts, axis=1)  # the start of the run token t is in
    return jnp.where(segment_ids == 0, 0, index - first).astype(jnp.int32)


def _check_contiguous(segment_ids) -> None:
    """ValueError when the ids are known and a row's document comes back after another one."""
    known = concrete_or_none(segment_ids)
    if known is None:
        return
    for b, row in enumerate(known):
        runs = row[np.r_[True, row[1:] != row[:-1]]]  # one id per run
        runs = runs[runs != 0]
        if len(np.unique(runs)) != len(runs):
            raise ValueError(f"segment_ids row {b} splits a document into several runs (ids by run: "
                             f"{runs.tolist()}); pack each document contiguously")
