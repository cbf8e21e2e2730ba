"""The checks of the attention functions' arguments (`jaxattn.attention`): each a ValueError or TypeError
naming the argument and the shapes, raised before JAX traces.

Letters as in `jaxattn.attention`: B batch, T queries, S keys (L a cache's slots), N query heads, K
key/value heads, H head dim, Hv value head dim. `check_arguments` is the one check of
`scaled_dot_product_attention`'s and `reference_attention`'s arguments and gives them batched
(`Arguments`); `check_sizes`, `check_float_arrays`, `softmax_scale`, `checked_soft_cap` and
`checked_sinks` are its parts that `cached_attention` shares. Values (lengths, segment ids, a scale)
are checked when they are known, i.e. not under `jit`.
"""

from __future__ import annotations

import math
import typing

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn._validate import (concrete_or_none, require_bool, require_broadcastable, require_float,
                               require_integer, require_rank)
from jaxattn.masks import check_lengths, check_segment_ids, window_sides


class Arguments(typing.NamedTuple):
    """The checked arguments, batched (a leading axis of 1 added to unbatched inputs)."""

    query: jax.Array
    key: jax.Array
    value: jax.Array
    bias: jax.Array | None
    mask: jax.Array | None
    query_lengths: jax.Array | None
    key_lengths: jax.Array | None
    window: tuple[int, int] | None
    soft_cap: float | None
    sinks: jax.Array | None
    segments: jax.Array | None
    unbatched: bool


def softmax_scale(scale, H: int):
    """`scale`, or jax.nn's default `1 / sqrt(H)` when it is None; ValueError for a scale known to be
    non-finite (a traced one is the caller's to keep finite)."""
    if scale is None:
        return 1.0 / math.sqrt(H)
    known = concrete_or_none(scale)
    if known is not None and not np.all(np.isfinite(known)):
        raise ValueError(f"scale must be a finite number, got {scale!r}")
    return scale


def _positive_number(name: str, value) -> float:
    """`value` as a float if it is a positive finite number known now (not traced), else a ValueError."""
    known = concrete_or_none(value)
    # A bool is refused by its dtype: numpy's bool is not a number type.
    if (known is None or known.ndim or not np.issubdtype(known.dtype, np.number)
            or not np.isfinite(known) or known <= 0):
        shown = "a traced value (pass it as a Python float, static under jit)" if known is None else repr(value)
        raise ValueError(f"{name} must be a positive finite number known when tracing, got {shown}")
    return float(known)


def _lengths(name: str, lengths, B: int, bound: int, bound_name: str, shapes: str):
    """None, or `lengths` as an array once it is known to be `[B]` integers in `[0, bound]` (values when known)."""
    if lengths is None:
        return None
    lengths = jnp.asarray(lengths)
    require_rank(name, lengths, 1, "[B]")
    require_integer(name, lengths)
    if lengths.shape[0] != B:
        raise ValueError(f"{name} {lengths.shape} must be [B] = ({B},) for {shapes}")
    check_lengths(name, lengths, bound, bound_name, shapes)
    return lengths


def checked_soft_cap(logits_soft_cap) -> float | None:
    """None, or the soft cap as a float once it is known to be a positive finite number."""
    return None if logits_soft_cap is None else _positive_number("logits_soft_cap", logits_soft_cap)


def checked_sinks(sinks, N: int, shapes: str):
    """None, or `sinks` as an array once it is known to be `[N]` floats (one logit per query head)."""
    if sinks is None:
        return None
    sinks = jnp.asarray(sinks)
    require_float("sinks", sinks)
    if sinks.shape != (N,):
        raise ValueError(f"sinks must be [N] = ({N},), one logit per query head, got shape {sinks.shape} "
                         f"for {shapes}")
    return sinks


def _segment_ids(segment_ids, B: int, T: int, S: int, unbatched: bool, shapes: str):
    """None, or the `[B, T]` int32 segment ids once they are known to be integers of the queries' shape
    (`[T]` unbatched) in a self-attention (T == S); a TypeError or ValueError naming them otherwise."""
    if segment_ids is None:
        return None
    if T != S:
        raise ValueError(f"segment_ids mark the documents of a packed self-attention, whose queries and keys are "
                         f"the same tokens (T == S), got T={T}, S={S}: {shapes}")
    layout, shape = ("[T]", (T,)) if unbatched else ("[B, T]", (B, T))
    segment_ids = check_segment_ids("segment_ids", segment_ids, shape, layout, shapes)
    return segment_ids.reshape(B, T)


def check_float_arrays(*named) -> None:
    """A TypeError unless each `(name, x)` of `named` is an array of floats."""
    for name, x in named:
        if not hasattr(x, "shape"):
            raise TypeError(f"{name} must be an array, got {type(x).__name__}")
        require_float(name, x)


def check_sizes(query_shape, key_shape, value_shape, shapes: str, key: str = "key", value: str = "value",
                 length: str = "S") -> None:
    """The sizes queries, keys and values share, each a ValueError naming them and `shapes`.

    `query_shape` `[B, T, N, H]`, `key_shape` `[B, S, K, H]`, `value_shape` `[B, S, K, Hv]` (a
    cache's `[B, K, L, H]` passed as `[B, L, K, H]`, with `length="L"`): one batch size B, values
    matching keys in length and heads K, one head dim H > 0, and N query heads a multiple of K > 0.
    Every other axis may be 0: no rows, queries, query heads or value dims give an empty output,
    and no keys (S = 0) a row with nothing to attend to, zeros.
    """
    (B, _, N, H), (Bk, S, K, Hk) = query_shape, key_shape
    if H == 0 or Hk == 0:  # no dims to take a dot product over, and 1 / sqrt(H) undefined
        raise ValueError(f"the head dim H must be positive, got query H={H}, {key} H={Hk}: {shapes}")
    if K == 0:  # no key/value head for the query heads to share
        raise ValueError(f"{key} and {value} need at least one key/value head, got K=0: {shapes}")
    if Bk != B or value_shape[0] != B:
        raise ValueError(f"batch sizes differ: {shapes}")
    if tuple(value_shape[1:3]) != (S, K):
        raise ValueError(f"{value} must match {key} in length {length} and heads K: {shapes}")
    if Hk != H:
        raise ValueError(f"head dims differ: query has H={H}, {key} H={Hk}: {shapes}")
    if N % K:
        raise ValueError(f"query heads N={N} must be a multiple of key/value heads K={K}: {shapes}")


def check_arguments(query, key, value, bias=None, mask=None, *, dropout_rate=0.0, local_window_size=None,
                    query_seq_lengths=None, key_value_seq_lengths=None, logits_soft_cap=None, sinks=None,
                    segment_ids=None) -> Arguments:
    """The one check of the attention arguments: a ValueError or TypeError naming the argument and the
    shapes, raised before tracing (values of lengths are checked when known, i.e. not under `jit`)."""
    check_float_arrays(("query", query), ("key", key), ("value", value))
    if query.ndim not in (3, 4):
        raise ValueError(f"query must have rank 4 [B, T, N, H] or 3 [T, N, H] (unbatched), got shape {query.shape}")
    unbatched = query.ndim == 3
    layout = {"key": "[S, K, H]", "value": "[S, K, Hv]"} if unbatched else {"key": "[B, S, K, H]",
                                                                           "value": "[B, S, K, Hv]"}
    for name, x in (("key", key), ("value", value)):
        require_rank(name, x, query.ndim, f"{layout[name]} like query {query.shape}")
    shapes = f"query {query.shape}, key {key.shape}, value {value.shape}"
    if unbatched:
        query, key, value = query[None], key[None], value[None]
    check_sizes(query.shape, key.shape, value.shape, shapes)
    (B, T, N, _), S = query.shape, key.shape[1]
    target, desc = ((N, T, S), "[N, T, S]") if unbatched else ((B, N, T, S), "[B, N, T, S]")
    arrays = {}
    for name, x in (("mask", mask), ("bias", bias)):
        if x is None:
            continue
        x = jnp.asarray(x)
        if name == "mask":
            require_bool("mask", x)
        if unbatched and x.ndim == 4 and x.shape[0] == 1:  # jax.nn takes 4-D masks of unbatched calls
            x = x[0]
        require_broadcastable(name, x.shape, target, desc)
        arrays[name] = x.reshape((1,) * (4 - x.ndim) + x.shape)  # rank 4, explicitly
    if not 0.0 <= dropout_rate < 1.0:
        raise ValueError(f"dropout_rate must be in [0, 1), got {dropout_rate}")
    sinks = checked_sinks(sinks, N, shapes)
    return Arguments(
        query, key, value, arrays.get("bias"), arrays.get("mask"),
        _lengths("query_seq_lengths", query_seq_lengths, B, T, "T", shapes),
        _lengths("key_value_seq_lengths", key_value_seq_lengths, B, S, "S", shapes),
        None if local_window_size is None else window_sides(local_window_size),
        checked_soft_cap(logits_soft_cap), sinks, _segment_ids(segment_ids, B, T, S, unbatched, shapes), unbatched)
