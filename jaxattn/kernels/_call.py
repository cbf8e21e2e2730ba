"""The static facts of one attention call: what the "auto" rules and the accelerator kernels check."""

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
            "local_window_size", "key_value_seq_lengths")


class KernelFallbackWarning(UserWarning):
    """A fused kernel could not take a call and the reference ("xla") ran instead; the message says why."""


@dataclasses.dataclass(frozen=True)
class AttentionCall:
    """Shapes, dtype and features of a `scaled_dot_product_attention` call (all static under `jit`).

    Letters as in `jaxattn.attention`: T queries, S keys, N query heads, K key/value
    heads, H head dim, Hv value head dim.
    """

    T: int
    S: int
    N: int
    K: int
    H: int
    Hv: int
    dtype: str
    is_causal: bool = False
    window: int | None = None
    lengths: bool = False
    mask: bool = False
    bias: bool = False
    dropout: bool = False
    weights: bool = False
    traced_scale: bool = False

    @classmethod
    def of(cls, query, key, value, *, mask=None, bias=None, is_causal=False, scale=None, dropout_rate=0.0,
           dropout_rng=None, return_weights=False, local_window_size=None, key_value_seq_lengths=None,
           **_) -> "AttentionCall":
        """The call made with these arguments (keyword names of the kernels' common signature)."""
        _, T, N, H = query.shape
        _, S, K, Hv = value.shape
        return cls(T=T, S=S, N=N, K=K, H=H, Hv=Hv, dtype=jnp.dtype(query.dtype).name, is_causal=is_causal,
                   window=local_window_size, lengths=key_value_seq_lengths is not None,
                   mask=mask is not None, bias=bias is not None,
                   dropout=dropout_rate > 0.0 and dropout_rng is not None, weights=return_weights,
                   traced_scale=not _is_concrete(scale))

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
    """The refusal of the kernels that return only the output and have no dropout, said in their docs."""
    return "attention weights or dropout" if call.weights or call.dropout else None


def reference_unless(refusal: Callable[[AttentionCall], str | None], warn_as: str | None = None):
    """Decorator: the kernel runs for the calls `refusal` accepts (None); any other call runs the
    reference ("xla"), with a one-line `KernelFallbackWarning` naming `warn_as` and the reason
    where `warn_as` is given (once per distinct reason, Python's default filter, at trace time).
    Keywords beyond `CONTRACT` (block sizes, `interpret`) go to the kernel only."""
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
