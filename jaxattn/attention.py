"""Scaled dot-product attention: the fast grouped path and the textbook path.

Shapes follow `jax.nn.dot_product_attention`:

  query `[B, T, N, H]`, key `[B, S, K, H]`, value `[B, S, K, Hv]` (or all three unbatched:
  `[T, N, H]`, `[S, K, H]`, `[S, K, Hv]`)

B batch, T queries, S keys, N query heads, K key/value heads (N a multiple of
K), G = N // K query heads per key/value head, H head dim, Hv value head dim.

`scaled_dot_product_attention` and `cached_attention` check their arguments
(`jaxattn.attention_checks`), fill in the defaults and hand the work to one implementation chosen
by name (`implementation=`, see `jaxattn.kernels`); every implementation groups the
query heads as `[B, T, K, G, H]` (G query heads per key/value head) so that MQA
and GQA never materialise repeated keys and values (docs/theory.md §2-§5).
`reference_attention` is the textbook formula `softmax(Q K^T / sqrt(d_k)) V`
with an explicit `repeat_kv`, independent of the kernels: the oracle the tests
compare every implementation against.

The implementations of `scaled_dot_product_attention`: "auto" (the default: this process's platform
rule, e.g. "auto_cpu", which picks per call, see `jaxattn.kernels.auto`) or a name of
`jaxattn.kernels.choices("attention")`: "xla" (the reference, differentiable in any order and mode:
use it for `jax.jvp` or higher derivatives), "custom_vjp" (a hand-written backward for training),
"chunked" (blockwise, O(T) memory, skips the blocks the causal mask or the window hides;
docs/theory.md §10), "cudnn" (GPU) or "splash" (TPU). All but "xla" are reverse mode only and run
the reference for dropout and `return_weights`; cuDNN and splash run it, with a one-line
`KernelFallbackWarning`, for what they cannot take (`jaxattn.kernels`).

Differences from `jax.nn.dot_product_attention`, whose arguments these share, in its positional
order, with its meaning otherwise: the causal mask and local windows are aligned to the END of the keys
(query i sits at position i + S - T; jax.nn aligns at the start; the same when T == S);
a query row with no key to attend to gives zeros (jax.nn: the mean of the values), and
its residual is -inf; `segment_ids` mask packed rows of documents (docs/theory.md §27), which
jax.nn has no argument for. Everything here runs under `jax.numpy_rank_promotion("raise")`.

Inputs must be finite, masked keys' values included: a masked key gets weight exactly 0, but 0
times NaN is NaN (padding and unwritten cache slots that this library writes are always finite).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxattn import kernels
from jaxattn._validate import require_integer, require_positive_int, require_rank
from jaxattn.attention_checks import (Arguments, check_arguments, check_float_arrays, check_sizes, checked_sinks,
                                      checked_soft_cap, softmax_scale)
from jaxattn.masks import causal_mask, local_window_mask, padding_mask, segment_mask
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


def _without_queries_or_keys(a: Arguments, return_weights: bool):
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


def _results(a: Arguments, out, weights, residual, return_weights: bool, return_residual: bool):
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

    Args:
      query: `[B, T, N, H]`, or `[T, N, H]` unbatched (then key and value are unbatched too, and so are the results).
      key, value: `[B, S, K, H]` and `[B, S, K, Hv]`, N a multiple of K (K = N is MHA, K = 1 MQA).
      bias: additive logits, broadcastable to `[B, N, T, S]` (`[N, T, S]` unbatched), added after the soft cap; a
        key biased to -inf is hidden like a masked one.
      mask: boolean, True = attend, broadcastable to `[B, N, T, S]` (`[N, T, S]` unbatched).
      scale: multiplies the logits; defaults to `1 / sqrt(H)`.
      is_causal: query i sees keys `j <= i + S - T` (`causal_mask(T, S)`, aligned to the end of the keys).
      query_seq_lengths: None, or `[B]` integers in [0, T]: query rows `t >= lengths[b]` give zero outputs,
        weights and gradients (and a residual of -inf).
      key_value_seq_lengths: None, or `[B]` integers in [0, S]: keys `j >= lengths[b]` of row b are hidden (right
        padding, `jaxattn.masks.padding_mask`). Values outside their range are a ValueError when known before
        tracing (under `jit` they are not checked).
      local_window_size: None, an int w (meaning `(w, w)`), or `(left, right)` non-negative ints: the query at
        position p sees keys `p - left .. p + right` (`jaxattn.masks.local_window_mask`); with `is_causal` the right
        side is cut at p. The model's sliding window W (the query and W - 1 keys back) is `(W - 1, 0)`.
      logits_soft_cap: None or a positive number c: logits `c * tanh(scale * q.k / c)`, before the bias and masks
        (Gemma 2; docs/theory.md §17). Must be known when tracing.
      sinks: None or `[N]` float logits, one per query head (GPT-OSS; docs/theory.md §18): each joins its rows'
        softmax denominator with no value, so a row's weights sum to less than 1. Differentiable.
      segment_ids: None, or `[B, T]` integer document ids of packed rows (`[T]` unbatched), in a self-attention
        (T == S): query t sees key s only where `segment_ids[b, t] == segment_ids[b, s]`, with the causal mask and
        window as well (`jaxattn.masks.segment_mask`). Id 0 is padding: it attends to nothing (zeros) and is never
        attended; ids 1, 2, ... number a row's documents. Negative ids are a ValueError when known (docs/theory.md
        §27). Every implementation takes them but cuDNN (the reference runs, with a `KernelFallbackWarning`).
      dropout_rate: dropout on the attention weights, applied only when `dropout_rate > 0` and `dropout_rng` is given.
      dropout_rng: PRNG key for the dropout.
      return_weights: also return the attention weights `[B, N, T, S]` (float32, after dropout, as used for the
        output; without the sink, whose weight is 1 minus the row's sum).
      return_residual: also return the logsumexp of each row's logits and sink `[B, T, N]` (in the query's dtype,
        as jax.nn's residual; computed in float32 and rounded; under `stop_gradient`; -inf for a row with no key
        and no sink, where jax.nn's is finite).
      implementation: "auto" (default) or a name of `jaxattn.kernels.choices("attention")` (module docstring).

    Returns:
      `out` `[B, T, N, Hv]` in the query's dtype; `(out, weights)`, `(out, residual)` or `(out, weights, residual)`
      as asked. Logits and softmax are float32 whatever the input dtype (float64 inputs stay float64). A query row
      with no key to attend to (masked, or biased to -inf) gives zeros, never NaN. Inputs must be finite (module
      docstring).
    """
    a = check_arguments(query, key, value, bias, mask, dropout_rate=dropout_rate, local_window_size=local_window_size,
                        query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
                        logits_soft_cap=logits_soft_cap, sinks=sinks, segment_ids=segment_ids)
    rule = kernels.select.attention_rule_here() if implementation == kernels.AUTO else implementation
    attend = kernels.attention_kernel(rule)
    if 0 in a.query.shape[1:2] + a.key.shape[1:2]:  # T = 0 or S = 0
        return _results(a, *_without_queries_or_keys(a, return_weights), return_weights, return_residual)
    out, weights, residual = attend(a.query, a.key, a.value, mask=a.mask, bias=a.bias, is_causal=is_causal,
                                    scale=softmax_scale(scale, a.query.shape[-1]), dropout_rate=dropout_rate,
                                    dropout_rng=dropout_rng, return_weights=return_weights, local_window_size=a.window,
                                    key_value_seq_lengths=a.key_lengths, logits_soft_cap=a.soft_cap, sinks=a.sinks,
                                    return_residual=return_residual, segment_ids=a.segments)
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
    check_float_arrays(("query", query), ("key_cache", key_cache), ("value_cache", value_cache))
    layouts = {"query": "[B, T, N, H]", "key_cache": "[B, K, L, H]", "value_cache": "[B, K, L, Hv]"}
    arrays = {"query": query, "key_cache": key_cache, "value_cache": value_cache}
    for name, x in arrays.items():
        require_rank(name, x, 4, layouts[name])
    shapes = ", ".join(f"{name} {x.shape} {layouts[name]}" for name, x in arrays.items())
    key_shape, value_shape = ((c.shape[0], c.shape[2], c.shape[1], c.shape[3]) for c in (key_cache, value_cache))
    check_sizes(query.shape, key_shape, value_shape, shapes, key="key_cache", value="value_cache", length="L")
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
    return attend(query, key_cache, value_cache, query_positions, scale=softmax_scale(scale, H), window=window,
                  logits_soft_cap=checked_soft_cap(logits_soft_cap), sinks=checked_sinks(sinks, N, shapes))


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
    a = check_arguments(query, key, value, bias, mask, local_window_size=local_window_size,
                        query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
                        logits_soft_cap=logits_soft_cap, sinks=sinks, segment_ids=segment_ids)
    if 0 in a.query.shape[1:2] + a.key.shape[1:2]:  # T = 0 or S = 0
        return _results(a, *_without_queries_or_keys(a, return_weights), return_weights, return_residual)
    B, T, N, H = a.query.shape
    S, K = a.key.shape[1], a.key.shape[2]
    scale = softmax_scale(scale, H)

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
