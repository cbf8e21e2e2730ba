"""Next-token losses from the last hidden states and the head, without ever holding `[M, V]` logits.

A model's loss is usually `cross_entropy(x @ head, targets)`: the logits `[M, V]` (M = B*T tokens) are
kept for the backward pass, with their softmax, in float32. With a large vocabulary they are the
biggest activation of a step (SmolLM2's 49,152 tokens x 2,048 rows: 400 MB each). Here the head runs
`chunk` rows at a time (docs/theory.md §28):

* `token_losses(x, head, targets, ...)` equals
  `optax.softmax_cross_entropy_with_integer_labels(soft_cap(matmul(x, head), cap), targets)` up to float32
  summation order (tests/test_head_loss.py), the logits made by the run's matmul kernel.
* Its gradient with respect to `x`: loss i reads only row i of x, so `d loss_i / d x_i` is one row
  `(softmax_i - onehot_i) @ head.T` (times the soft cap's slope). The forward of `jax.grad` computes these
  rows `[M, D]` while each chunk's logits are at hand and keeps them instead of the logits; the backward
  multiplies them by the incoming cotangents. The head's products are the same as the unfused pair
  (forward logits, backward `dx`), so nothing is recomputed for x.
* Its gradient with respect to the head needs the cotangents, so the backward recomputes each chunk's
  logits: one more head product, traced only where the head is differentiated (a frozen head's, as in a
  LoRA run, is dead code that `jit` removes).
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

CHUNK = 256  # rows of logits at a time: 256 x V float32 (50 MB at V = 49,152)


def token_losses(x: jax.Array, head: jax.Array, targets: jax.Array, *, matmul: Callable,
                 cap: float | None = None, chunk: int = CHUNK) -> jax.Array:
    """Per-token losses `[M]` float32 of hidden states `x [M, D]` through `head [D, V]` against `targets [M]`.

    Args:
      x: `[M, D]` the hidden states after the final norm, in the head's compute dtype.
      head: `[D, V]` float: the head (the tied embedding's transpose, or lm_head's kernel).
      targets: `[M]` int ids in `[0, V)`.
      matmul: a dense kernel `[M, D] @ [D, V] -> float32` (`jaxattn.kernels.matmul_kernel`).
      cap: the final logits' soft cap (`jaxattn.softmax.soft_cap`), or None.
      chunk: rows of logits computed at a time.
    """
    if x.ndim != 2 or head.ndim != 2 or x.shape[1] != head.shape[0]:
        raise ValueError(f"x must be [M, D] and head [D, V] with the same D, got x {x.shape}, head {head.shape}")
    if targets.shape != x.shape[:1] or not jnp.issubdtype(targets.dtype, jnp.integer):
        raise ValueError(f"targets must be int [M] = {x.shape[:1]}, got {targets.dtype} {targets.shape}")
    if chunk < 1:
        raise ValueError(f"chunk must be at least 1, got {chunk}")
    return _token_losses(x, head, targets, matmul, cap, min(chunk, x.shape[0]))


def _in_chunks(a: jax.Array, chunk: int) -> jax.Array:
    """`[M, ...] -> [M/C, C, ...]`, zero rows added at the end up to a whole chunk (dropped afterwards)."""
    pad = -a.shape[0] % chunk
    a = jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1))
    return a.reshape(-1, chunk, *a.shape[1:])


def _logits(x_c, head, matmul, cap):
    """`[C, D] -> ([C, V] float32 logits, soft-capped; their slope against the raw logits, or None)`."""
    raw = matmul(x_c, head)  # [C, V] float32
    if cap is None:
        return raw, None
    squashed = jnp.tanh(raw / cap)
    return cap * squashed, 1.0 - squashed * squashed


def _loss_lse_softmax(logits, t_c):
    """`[C, V]`, `[C]` -> (losses `[C]`, log-sum-exp `[C]`, softmax `[C, V]`), one exponential per logit:
    `e = exp(logits - max)`, its sum and `e / sum(e)` (the logits are finite: raw or soft-capped). Where
    only the losses are used, `jit` drops the softmax."""
    top = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))  # [C, 1]
    e = jnp.exp(logits - top)
    total = jnp.sum(e, axis=-1, keepdims=True)
    lse = (top + jnp.log(total))[:, 0]
    return lse - jnp.take_along_axis(logits, t_c[:, None], axis=-1)[:, 0], lse, e / total


def _minus_onehot(p, slope, t_c):
    """`(p - onehot(t_c)) * slope`: the softmax `p` `[C, V]` to `d loss / d raw logits`."""
    p = p.at[jnp.arange(p.shape[0]), t_c].add(-1.0)
    return p if slope is None else p * slope


def _dlogits(logits, slope, lse, t_c):
    """`d loss / d raw logits` of each row from the log-sum-exp kept by the forward, `[C, V]` float32."""
    return _minus_onehot(jnp.exp(logits - lse[:, None]), slope, t_c)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _token_losses(x, head, targets, matmul, cap, chunk):
    def one(chunk_args):  # forward only (no gradient asked): each chunk's losses
        x_c, t_c = chunk_args
        return _loss_lse_softmax(_logits(x_c, head, matmul, cap)[0], t_c)[0]
    losses = jax.lax.map(one, (_in_chunks(x, chunk), _in_chunks(targets, chunk)))  # [M/C, C]
    return losses.reshape(-1)[:x.shape[0]]


def _forward(x, head, targets, matmul, cap, chunk):
    def one(chunk_args):
        x_c, t_c = chunk_args
        logits, slope = _logits(x_c, head, matmul, cap)
        losses, lse, softmax = _loss_lse_softmax(logits, t_c)
        # the kernel's own backward for dx (its fast forms): d loss_i / d x_i, one row per token
        rows = jax.vjp(lambda xc: matmul(xc, head), x_c)[1](_minus_onehot(softmax, slope, t_c))[0]  # [C, D]
        return losses, rows, lse
    losses, rows, lse = jax.lax.map(one, (_in_chunks(x, chunk), _in_chunks(targets, chunk)))
    M = x.shape[0]
    return losses.reshape(-1)[:M], (rows.reshape(-1, x.shape[1])[:M], x, head, targets, lse)


def _backward(matmul, cap, chunk, residuals, g):
    rows, x, head, targets, lse = residuals  # lse [M/C, C]
    dx = (g[:, None] * rows).astype(x.dtype)  # [M, D]

    def add_chunk(dhead, chunk_args):  # the head's gradient: each chunk's logits again
        x_c, t_c, lse_c, g_c = chunk_args
        logits, slope = _logits(x_c, head, matmul, cap)
        dlogits = g_c[:, None] * _dlogits(logits, slope, lse_c, t_c)  # [C, V]
        return dhead + jax.vjp(lambda w: matmul(x_c, w), head)[1](dlogits)[0].astype(jnp.float32), None
    chunks = (_in_chunks(x, chunk), _in_chunks(targets, chunk), lse, _in_chunks(g, chunk))  # padded g: 0
    dhead, _ = jax.lax.scan(add_chunk, jnp.zeros(head.shape, jnp.float32), chunks)
    return dx, dhead.astype(head.dtype), None


_token_losses.defvjp(_forward, _backward)
