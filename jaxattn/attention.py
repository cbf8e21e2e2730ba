"""Scaled dot-product attention: the fast grouped path and the textbook path.

Shapes follow `jax.nn.dot_product_attention`:

  query `[B, T, N, H]`, key `[B, S, K, H]`, value `[B, S, K, Hv]` (or all three unbatched:
  `[T, N, H]`, `[S, K, H]`, `[S, K, Hv]`)

B batch, T queries, S keys, N query heads, K key/value heads (N a multiple of
K), G = N // K query heads per key/value head, H head dim, Hv value head dim.

`scaled_dot_product_attention` and `cached_attention` check their arguments,
fill in the defaults and hand the work to one implementation chosen by name
(`implementation=`, see `jaxattn.kernels`); every implementation groups the
query heads as `[B, T, K, G, H]` (G query heads per key/value head) so that MQA
and GQA never materialise repeated keys and values (docs/theory.md §2-§5).
`reference_attention` is the textbook formula `softmax(Q K^T / sqrt(d_k)) V`
with an explicit `repeat_kv`, independent of the kernels: the oracle the tests
compare every implementation against.

Differences from `jax.nn.dot_product_attention`, whose arguments these share with its
meaning otherwise: the causal mask and local windows are aligned to the END of the keys
(query i sits at position i + S - T; jax.nn aligns at the start; the same when T == S);
a query row with no key to attend to gives zeros (jax.nn: the mean of the values), and
its residual is -inf; `segment_ids` mask packed rows of documents (docs/theory.md §27), which
jax.nn has no argument for. Everything here runs under `jax.numpy_rank_promotion("raise")`.
"""

from __future__ import annotations

import math
import typing

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn import kernels
from jaxattn._validate import (concrete_or_none, require_bool, require_broadcastable, require_float,
                               require_integer, require_positive_int, require_rank)
from jaxattn.masks import (causal_mask, check_lengths, check_segment_ids, local_window_mask, padding_mask,
                           segment_mask, window_sides)
from jaxattn.softmax import softmax_dtype


def repeat_kv(x: jnp.ndarray, n_rep: int) -> jnp.ndarray:
    """`[B, S, K, H] -> [B, S, K * n_rep, H]`; output head j is input head j // n_rep.

    This is Llama's `repeat_kv` (docs/theory.md §5). The kernels do not need
    it; it is here for teaching, for `reference_attention` and for parity tests
    of GQA against MHA.
    """
    require_rank("x", x, 4, "[B, S, K, H]")
    require_positive_int("n_rep", n_rep)
    return x if n_rep == 1 else jnp.repeat(x, n_rep, axis=2)


class _Arguments(typing.NamedTuple):
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


def _softmax_scale(scale, H: int):
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
    if lengths is None:
        return None
    lengths = jnp.asarray(lengths)
    require_rank(name, lengths, 1, "[B]")
    require_integer(name, lengths)
    if lengths.shape[0] != B:
        raise ValueError(f"{name} {lengths.shape} must be [B] = ({B},) for {shapes}")
    check_lengths(name, lengths, bound, bound_name, shapes)
    return lengths


def _soft_cap(logits_soft_cap) -> float | None:
    """None, or the soft cap as a float once it is known to be a positive finite number."""
    return None if logits_soft_cap is None else _positive_number("logits_soft_cap", logits_soft_cap)


def _sinks(sinks, N: int, shapes: str):
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


def _float_arrays(*named) -> None:
    """A TypeError unless each `(name, x)` of `named` is an array of floats."""
    for name, x in named:
        if not hasattr(x, "shape"):
            raise TypeError(f"{name} must be an array, got {type(x).__name__}")
        require_float(name, x)


def _check_sizes(query_shape, key_shape, value_shape, shapes: str, key: str = "key", value: str = "value",
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


def _check(query, key, value, bias=None, mask=None, *, dropout_rate=0.0, local_window_size=None,
           query_seq_lengths=None, key_value_seq_lengths=None, logits_soft_cap=None, sinks=None,
           segment_ids=None) -> _Arguments:
    """The one check of the attention arguments: a ValueError or TypeError naming the argument and the
    shapes, raised before tracing (values of lengths are checked when known, i.e. not under `jit`)."""
    _float_arrays(("query", query), ("key", key), ("value", value))
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
    _check_sizes(query.shape, key.shape, value.shape, shapes)
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
    sinks = _sinks(sinks, N, shapes)
    return _Arguments(
        query, key, value, arrays.get("bias"), arrays.get("mask"),
        _lengths("query_seq_lengths", query_seq_lengths, B, T, "T", shapes),
        _lengths("key_value_seq_lengths", key_value_seq_lengths, B, S, "S", shapes),
        None if local_window_size is None else window_sides(local_window_size),
        _soft_cap(logits_soft_cap), sinks, _segment_ids(segment_ids, B, T, S, unbatched, shapes), unbatched)


def _without_queries_or_keys(a: _Arguments, return_weights: bool):
    """`(out, weights, residual)` where T = 0 or S = 0, the same for every implementation: with no key,
    every row has nothing to attend to (zeros; its residual is its head's sink logit, or -inf), and
    with no query there is nothing to compute. Here, so that no kernel has to plan blocks of nothing."""
    (B, T, N, _), S, Hv = a.query.shape, a.key.shape[1], a.value.shape[-1]
    f32 = softmax_dtype(a.query.dtype)
    out = jnp.zeros((B, T, N, Hv), a.query.dtype)
    weights = jnp.zeros((B, N, T, S), f32) if return_weights else None
    logit = jnp.full((N,), -jnp.inf, f32) if a.sinks is None else a.sinks.astype(f32)
    residual = jax.lax.stop_gradient(jnp.broadcast_to(logit.reshape(1, 1, N), (B, T, N)))
    return out, weights, residual


def _results(a: _Arguments, out, weights, residual, return_weights: bool, return_residual: bool):
    """Query rows past `query_seq_lengths` zeroed (their residual -inf), the residual in the query's
    dtype, the batch axis of unbatched inputs removed, and the tuple the flags ask for."""
    if residual is not None:
        # jax.nn's dtype. The kernels return it in the softmax's (float32 for 16-bit inputs); rounding it
        # here, outside their custom VJPs, lets `jax.vjp` take a cotangent of the residual's own dtype.
        residual = residual.astype(a.query.dtype)
    if a.query_lengths is not None:
        B, T = out.shape[:2]
        valid = jnp.arange(T).reshape(1, T) < a.query_lengths.reshape(B, 1)  # [B, T]
        out = jnp.where(valid.reshape(B, T, 1, 1), out, jnp.zeros((), out.dtype))
        weights = None if weights is None else jnp.where(valid.reshape(B, 1, T, 1), weights, 0.0)
        residual = None if residual is None else jnp.where(valid.reshape(B, T, 1), residual, -jnp.inf)
    if a.unbatched:
        out, weights, residual = (None if x is None else x[0] for x in (out, weights, residual))
    results = (out,) + ((weights,) if return_weights else ()) + ((residual,) if return_residual else ())
    return results[0] if len(results) == 1 else results


def scaled_dot_product_attention(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
                                 query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
                                 logits_soft_cap=None, sinks=None, dropout_rate=0.0, dropout_rng=None,
                                 return_weights=False, return_residual=False, implementation="auto",
                                 segment_ids=None):
    """softmax(cap(Q K^T * scale) + bias, masked, with sinks) V, grouped for MQA/GQA (docs/theory.md §2-§5).

    The positional order and every argument `jax.nn.dot_product_attention` has mean what they
    mean there, except the alignment when T != S and empty rows (module docstring).

    Args:
      query: `[B, T, N, H]`, or `[T, N, H]` unbatched (then key and value are unbatched too, and
        so are the results).
      key: `[B, S, K, H]`, N a multiple of K (K = N is MHA, K = 1 MQA).
      value: `[B, S, K, Hv]`.
      bias: additive logits, broadcastable to `[B, N, T, S]` (`[N, T, S]` unbatched), added after
        the soft cap; a key biased to -inf is hidden like a masked one.
      mask: boolean, True = attend, broadcastable to `[B, N, T, S]` (`[N, T, S]` unbatched).
      scale: multiplies the logits; defaults to `1 / sqrt(H)`.
      is_causal: query i sees keys `j <= i + S - T` (`causal_mask(T, S)`, aligned to the end of the keys).
      query_seq_lengths: None, or `[B]` integers in [0, T]: query rows `t >= lengths[b]` give zero
        outputs, weights and gradients (and a residual of -inf).
      key_value_seq_lengths: None, or `[B]` integers in [0, S]: keys `j >= lengths[b]` of row b are
        hidden (right padding, `jaxattn.masks.padding_mask`). Values outside their range are a
        ValueError when known before tracing (under `jit` they are not checked).
      local_window_size: None, an int w (meaning `(w, w)`), or `(left, right)` non-negative ints:
        the query at position p sees keys `p - left .. p + right` (end-aligned:
        `jaxattn.masks.local_window_mask`); with `is_causal` the right side is cut at p. The
        model's sliding window W (the query and W - 1 keys back) is `(W - 1, 0)`.
      logits_soft_cap: None or a positive number c: logits `c * tanh(scale * q.k / c)`, before the
        bias and masks (Gemma 2; docs/theory.md §17). Must be known when tracing.
      sinks: None or `[N]` float logits, one per query head (GPT-OSS; docs/theory.md §18): each joins
        its rows' softmax denominator with no value, so a row's weights sum to less than 1.
        Differentiable.
      segment_ids: None, or `[B, T]` integer document ids of packed rows (`[T]` unbatched), in a
        self-attention (T == S): query t sees key s only where `segment_ids[b, t] == segment_ids[b, s]`,
        with the causal mask and window as well (`jaxattn.masks.segment_mask`). Id 0 is padding: it
        attends to nothing (zeros) and is never attended; ids 1, 2, ... number a row's documents.
        Negative ids are a ValueError when known (docs/theory.md §27). Every implementation takes
        them but cuDNN (the reference runs, with a `KernelFallbackWarning`).
      dropout_rate: dropout on the attention weights, applied only when
        `dropout_rate > 0` and `dropout_rng` is given.
      dropout_rng: PRNG key for the dropout.
      return_weights: also return the attention weights `[B, N, T, S]` (float32, after dropout, as
        used for the output; without the sink, whose weight is 1 minus the row's sum).
      return_residual: also return the logsumexp of each row's logits and sink `[B, T, N]`
        (in the query's dtype, as jax.nn's residual; computed in float32 and rounded; under
        `stop_gradient`; -inf for a row with no key and no sink, where jax.nn's is finite).
      implementation: "auto" (default: this process's platform rule, e.g.
        "auto_cpu", which picks per call, see `jaxattn.kernels.auto`) or a
        name of `jaxattn.kernels.choices("attention")`: "xla" (the reference,
        differentiable in any order and mode: use it for `jax.jvp` or
        higher derivatives), "custom_vjp" (a hand-written backward for
        training), "chunked" (blockwise, O(T) memory, skips the blocks the
        causal mask or the window hides; docs/theory.md §10), "cudnn" (GPU)
        or "splash" (TPU). All but "xla" are reverse mode only and run the
        reference for dropout and `return_weights`; cuDNN and splash run it, with a
        one-line `KernelFallbackWarning`, for what they cannot take (`jaxattn.kernels`).

    Returns:
      `out` `[B, T, N, Hv]` in the query's dtype; `(out, weights)`, `(out, residual)` or
      `(out, weights, residual)` as asked. Logits and softmax are float32 whatever the
      input dtype (float64 inputs stay float64). A query row with no key to attend to
      (masked, or biased to -inf) gives zeros, never NaN.

    Inputs must be finite, masked keys' values included: a masked key gets
    weight exactly 0, but 0 times NaN is NaN (padding and unwritten cache slots
    that this library writes are always finite).
    """
    a = _check(query, key, value, bias, mask, dropout_rate=dropout_rate, local_window_size=local_window_size,
               query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
               logits_soft_cap=logits_soft_cap, sinks=sinks, segment_ids=segment_ids)
    if implementation == kernels.AUTO:
        implementation = kernels.select.attention_rule_here()
    attend = kernels.attention_kernel(implementation)
    if 0 in a.query.shape[1:2] + a.key.shape[1:2]:  # T = 0 or S = 0
        return _results(a, *_without_queries_or_keys(a, return_weights), return_weights, return_residual)
    out, weights, residual = attend(
        a.query, a.key, a.value, mask=a.mask, bias=a.bias, is_causal=is_causal,
        scale=_softmax_scale(scale, a.query.shape[-1]),
        dropout_rate=dropout_rate, dropout_rng=dropout_rng, return_weights=return_weights,
        local_window_size=a.window, key_value_seq_lengths=a.key_lengths, logits_soft_cap=a.soft_cap,
        sinks=a.sinks, return_residual=return_residual, segment_ids=a.segments)
    return _results(a, out, weights, residual, return_weights, return_residual)


def cached_attention(query, key_cache, value_cache, query_positions, *, scale=None, window=None,
                     logits_soft_cap=None, sinks=None, implementation="xla"):
    """Attention of T new queries against a KV cache (prefill and decode steps, docs/theory.md §9).

    The cache is heads-major (`jaxattn.cache.containers`): each (row, kv head) is one
    contiguous `[L, H]` matrix. Slot j holds absolute position j and is visible
    to a query at position p iff j <= p (`jaxattn.masks.visible_cache_slots`),
    so slots not yet written never are. The same maths as
    `scaled_dot_product_attention` on the transposed cache with that mask.

    Args:
      query: `[B, T, N, H]` new queries, N a multiple of K.
      key_cache: `[B, K, L, H]` keys.
      value_cache: `[B, K, L, Hv]` values.
      query_positions: `[B, T]` integer absolute positions of the queries.
      scale: multiplies the logits; defaults to `1 / sqrt(H)`.
      window: None, or the model's sliding window W: slot j is also hidden when `p - j >= W`.
      logits_soft_cap: None or a positive number c: logits `c * tanh(scale * q.k / c)` (§17).
      sinks: None or `[N]` float logits joining each row's softmax denominator (§18).
      implementation: a name of `jaxattn.kernels.choices("decode")`.

    Returns:
      `[B, T, N, Hv]` in the query's dtype; logits and softmax in float32.
    """
    _float_arrays(("query", query), ("key_cache", key_cache), ("value_cache", value_cache))
    layouts = {"query": "[B, T, N, H]", "key_cache": "[B, K, L, H]", "value_cache": "[B, K, L, Hv]"}
    arrays = {"query": query, "key_cache": key_cache, "value_cache": value_cache}
    for name, x in arrays.items():
        require_rank(name, x, 4, layouts[name])
    shapes = ", ".join(f"{name} {x.shape} {layouts[name]}" for name, x in arrays.items())
    key_shape, value_shape = ((c.shape[0], c.shape[2], c.shape[1], c.shape[3]) for c in (key_cache, value_cache))
    _check_sizes(query.shape, key_shape, value_shape, shapes, key="key_cache", value="value_cache", length="L")
    B, T, N, H = query.shape
    if key_cache.shape[2] == 0:
        raise ValueError(f"key_cache and value_cache hold no slots (L=0); a cache holds at least the queries' "
                         f"positions: {shapes}")
    query_positions = jnp.asarray(query_positions)
    if query_positions.shape != (B, T):
        raise ValueError(f"query_positions must be [B, T] = {(B, T)}, got {query_positions.shape}")
    require_integer("query_positions", query_positions)
    attend = kernels.cached_attention_kernel(implementation)
    if window is not None:
        require_positive_int("window", window)
    return attend(query, key_cache, value_cache, query_positions, scale=_softmax_scale(scale, H), window=window,
                  logits_soft_cap=_soft_cap(logits_soft_cap), sinks=_sinks(sinks, N, shapes))


def reference_attention(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
                        query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
                        logits_soft_cap=None, sinks=None, return_weights=False, return_residual=False,
                        segment_ids=None):
    """The textbook formula, step by step (docs/theory.md §2-§5, §17, §18). Same contract as above.

    Slow on purpose and independent of `jaxattn.kernels` and of the masked
    softmax: it repeats K/V to every query head, moves heads in front
    (`[B, N, T, H]`), caps, masks with -inf and appends each head's sink as one
    more key with no value, exactly as the textbook writes it.
    """
    a = _check(query, key, value, bias, mask, local_window_size=local_window_size,
               query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
               logits_soft_cap=logits_soft_cap, sinks=sinks, segment_ids=segment_ids)
    if 0 in a.query.shape[1:2] + a.key.shape[1:2]:  # T = 0 or S = 0
        return _results(a, *_without_queries_or_keys(a, return_weights), return_weights, return_residual)
    B, T, N, H = a.query.shape
    S, K = a.key.shape[1], a.key.shape[2]
    scale = _softmax_scale(scale, H)

    k = repeat_kv(a.key, N // K).transpose(0, 2, 1, 3)  # [B, N, S, H]
    v = repeat_kv(a.value, N // K).transpose(0, 2, 1, 3)  # [B, N, S, Hv]
    q = a.query.transpose(0, 2, 1, 3)  # [B, N, T, H]
    f32 = softmax_dtype(a.query.dtype)
    scores = jnp.matmul(q.astype(f32), k.astype(f32).swapaxes(-1, -2)) * scale  # [B, N, T, S]
    if a.soft_cap is not None:
        scores = a.soft_cap * jnp.tanh(scores / a.soft_cap)
    allowed = jnp.ones((B, N, T, S), bool)
    if a.bias is not None:  # a key biased to -inf cannot be attended to
        scores = scores + a.bias.astype(f32)
        allowed = allowed & (a.bias != -jnp.inf)
    if a.mask is not None:
        allowed = allowed & a.mask
    if is_causal:
        allowed = allowed & causal_mask(T, S)[None, None]
    if a.window is not None:
        allowed = allowed & local_window_mask(T, S, a.window)[None, None]
    if a.key_lengths is not None:
        allowed = allowed & padding_mask(a.key_lengths, S)  # [B, 1, 1, S]
    if a.segments is not None:
        allowed = allowed & segment_mask(a.segments, a.segments)  # [B, 1, T, S]
    scores = jnp.where(allowed, scores, -jnp.inf)
    if a.sinks is not None:  # one more key per head, always visible, with no value
        sink = jnp.broadcast_to(a.sinks.astype(f32).reshape(1, N, 1, 1), (B, N, T, 1))
        scores = jnp.concatenate([scores, sink], -1)
        allowed = jnp.concatenate([allowed, jnp.ones(sink.shape, bool)], -1)
    # A row with nothing to attend to is defined as zeros rather than 0/0.
    any_allowed = allowed.any(axis=-1, keepdims=True)
    scores = jnp.where(any_allowed, scores, 0.0)
    weights = jnp.where(any_allowed, jax.nn.softmax(scores, axis=-1), 0.0)[..., :S]  # the sink has no value
    lse = jnp.where(any_allowed[..., 0], jax.nn.logsumexp(scores, axis=-1), -jnp.inf)  # [B, N, T]
    out = jnp.matmul(weights, v.astype(f32))  # [B, N, T, Hv]
    out = out.transpose(0, 2, 1, 3).astype(a.query.dtype)  # [B, T, N, Hv]
    residual = jax.lax.stop_gradient(lse.transpose(0, 2, 1))  # [B, T, N]
    return _results(a, out, weights, residual, return_weights, return_residual)
