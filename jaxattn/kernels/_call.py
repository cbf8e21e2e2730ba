"""The kernel contract and the static facts of one attention call: what the "auto" rules and the fused kernels check.

Every `jaxattn.kernels.*.attention` has the signature of `jaxattn.kernels.xla.attention`:

    attention(query, key, value, *, mask, bias, is_causal, scale, dropout_rate, dropout_rng,
              return_weights, local_window_size=None, key_value_seq_lengths=None,
              logits_soft_cap=None, sinks=None, return_residual=False, segment_ids=None)
      -> (out [B, T, N, Hv], weights [B, N, T, S] float32 | None, residual [B, T, N] float32 | None)

with 4-D batched inputs, `local_window_size` already a `(left, right)` tuple or None, a
concrete `logits_soft_cap`, `sinks` `[N]`, `segment_ids` `[B, T]` int32 document ids of a packed
self-attention (T == S; 0 = padding, attends to nothing and is never attended; docs/theory.md §27)
or None, and weights (residual) only when asked for
(float32 is the softmax's dtype: float64 for float64 inputs).
`scaled_dot_product_attention` checks the arguments, adds and removes the batch axis of
unbatched inputs, applies `query_seq_lengths` (no kernel sees them) and rounds the residual
to the query's dtype.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Callable

import jax
import jax.numpy as jnp

from jaxattn.kernels import xla

# The keyword arguments of the common kernel signature (`jaxattn.kernels.xla.attention`'s).
CONTRACT = ("mask", "bias", "is_causal", "scale", "dropout_rate", "dropout_rng", "return_weights",
            "local_window_size", "key_value_seq_lengths", "logits_soft_cap", "sinks", "return_residual",
            "segment_ids")


class KernelFallbackWarning(UserWarning):
    """A fused kernel could not take a call and the reference ("xla") ran instead; the message says why."""


@dataclasses.dataclass(frozen=True)
class AttentionCall:
    """Shapes, dtype and features of a `scaled_dot_product_attention` call (all static under `jit`).

    Letters as in `jaxattn.attention`: T queries, S keys, N query heads, K key/value
    heads, H head dim, Hv value head dim. `window` is `(left, right)` (jax.nn's meaning,
    end-aligned) or None; `soft_cap`, `sinks`, `residual` and `segments` say whether a logit soft
    cap, attention sinks, the logsumexp residual or the segment ids of packed rows are asked for.
    """

    T: int
    S: int
    N: int
    K: int
    H: int
    Hv: int
    dtype: str
    is_causal: bool = False
    window: tuple[int, int] | None = None
    lengths: bool = False
    mask: bool = False
    bias: bool = False
    dropout: bool = False
    weights: bool = False
    traced_scale: bool = False
    soft_cap: bool = False
    sinks: bool = False
    residual: bool = False
    segments: bool = False

    @classmethod
    def of(cls, query, key, value, *, mask=None, bias=None, is_causal=False, scale=None, dropout_rate=0.0,
           dropout_rng=None, return_weights=False, local_window_size=None, key_value_seq_lengths=None,
           logits_soft_cap=None, sinks=None, return_residual=False, segment_ids=None, **_) -> "AttentionCall":
        """The call made with these arguments (keyword names of the kernels' common signature)."""
        _, T, N, H = query.shape
        _, S, K, Hv = value.shape
        window = None if local_window_size is None else tuple(int(w) for w in local_window_size)
        return cls(T=T, S=S, N=N, K=K, H=H, Hv=Hv, dtype=jnp.dtype(query.dtype).name, is_causal=is_causal,
                   window=window, lengths=key_value_seq_lengths is not None,
                   mask=mask is not None, bias=bias is not None,
                   dropout=dropout_rate > 0.0 and dropout_rng is not None, weights=return_weights,
                   traced_scale=not _is_concrete(scale), soft_cap=logits_soft_cap is not None,
                   sinks=sinks is not None, residual=return_residual, segments=segment_ids is not None)

    def common_refusal(self, kernel: str) -> str | None:
        """Why a fused kernel that returns only the output and has no dropout cannot take this call."""
        if self.weights:
            return f"attention weights requested ({kernel} does not return them)"
        if self.dropout:
            return f"dropout on the attention weights ({kernel} has none)"
        if self.mask:
            return "a dense boolean mask (only the causal, window and padding structure goes to " \
                   f"{kernel} here)"
        if self.bias:
            return f"an additive bias ({kernel} is called without one here)"
        if self.Hv != self.H:
            return f"value head dim Hv={self.Hv} differs from H={self.H}"
        if self.traced_scale:
            return f"a traced scale ({kernel} takes it as a constant)"
        return None


def _is_concrete(x) -> bool:
    """Whether `x` is None or a number known when tracing (not a tracer under `jit` or `grad`)."""
    if x is None:
        return True
    try:
        float(x)
    except (TypeError, jax.errors.ConcretizationTypeError):
        return False
    return True


def weights_or_dropout(call: AttentionCall) -> str | None:
    """The refusal of the hand-written kernels ("custom_vjp", "chunked"), said in their docs: they return
    only the output (and residual), have no dropout, and take the scale as a constant of their backward.
    The "auto" rules give the refused calls to the reference with this reason (`jaxattn.kernels.auto`)."""
    if call.weights or call.dropout:
        return "attention weights or dropout: the reference materialises the weights anyway"
    return "a traced scale: the hand-written backwards take it as a constant" if call.traced_scale else None


def reference_unless(refusal: Callable[[AttentionCall], str | None], warn_as: str | None = None):
    """Decorator: the kernel runs for the calls `refusal` accepts (None); any other call runs the
    reference ("xla"), with a one-line `KernelFallbackWarning` naming `warn_as` and the reason
    where `warn_as` is given (once per distinct reason, Python's default filter, at trace time).
    Keywords beyond `CONTRACT` (block sizes, `interpret`) go to the kernel only; every contract
    keyword (soft cap, sinks, residual included) reaches the reference."""
    def wrap(kernel: Callable) -> Callable:
        @functools.wraps(kernel)
        def attention(query, key, value, **arguments):
            contract = {name: arguments[name] for name in CONTRACT if name in arguments}
            reason = refusal(AttentionCall.of(query, key, value, **contract))
            if reason is None:
                return kernel(query, key, value, **arguments)
            if warn_as is not None:
                warnings.warn(f"{warn_as} attention cannot take this call: {reason}; running the reference (xla)",
                              KernelFallbackWarning, stacklevel=2)
            return xla.attention(query, key, value, **contract)
        return attention
    return wrap
