"""Dense matmuls with bfloat16 operands and float32 sums, like `torch.autocast` (docs/theory.md §15).

Contract (both): `x [M, K] @ w [K, N]` with each operand rounded to bfloat16 and
the products summed in float32, returned as float32; the gradients
`dx = dy @ w.T` and `dw = x.T @ dy` likewise (operands rounded to bfloat16, sums
in float32), returned in the inputs' dtypes. The two are the same numbers up to
float32 summation order; against float32 they differ by bfloat16 rounding
(tests/kernels/test_kernels.py). Both have a hand-written backward, so both are
reverse mode only: JAX's own transpose of a bfloat16 dot would return bfloat16
gradients whose accumulation precision depends on the platform (on XLA:CPU
about 1% off the float32 sum).

* "bfloat16": the backward as written above. What a GPU or TPU with bfloat16
  matrix units wants.
* "bfloat16_cpu": the same products in the only form XLA:CPU's fast bfloat16
  library path accepts (neither operand contracted over its leading
  dimension, which `x.T @ dy` is): `dw` comes from a materialised transpose of
  the smaller of x and dy, and optimisation barriers keep XLA from folding the
  transposes back into the dots. Faster only on CPUs with AMX-BF16
  (docs/performance.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def matmul(x, w):
    """The "bfloat16" kernel."""
    return _bf16_matmul(x, w, jnp.dtype(x.dtype), jnp.dtype(w.dtype), False)


def matmul_cpu(x, w):
    """The "bfloat16_cpu" kernel: the same numbers in XLA:CPU's fast forms."""
    return _bf16_matmul(x, w, jnp.dtype(x.dtype), jnp.dtype(w.dtype), True)


def _fence(a: jnp.ndarray, fenced: bool) -> jnp.ndarray:
    """`a` behind an optimization barrier (when `fenced`): XLA cannot fold a neighbouring
    transpose into the dot that produces or consumes it."""
    return jax.lax.optimization_barrier(a[None])[0] if fenced else a


def _products(a16, b16, fenced: bool):
    """`[M, K] @ [K, N]` bfloat16 -> float32. Fenced, a transpose of the result downstream
    (the tied lm_head's `wte.T`) cannot be folded into this dot."""
    return _fence(jnp.dot(a16, b16, preferred_element_type=jnp.float32), fenced)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _bf16_matmul(x, w, x_dtype, w_dtype, fenced):
    return _products(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), fenced)


def _forward(x, w, x_dtype, w_dtype, fenced):
    x16, w16 = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    return _products(x16, w16, fenced), (x16, w16)


def _backward(x_dtype, w_dtype, fenced, residuals, dy):
    x16, w16 = residuals
    dy16 = dy.astype(jnp.bfloat16)
    # dx = dy @ w.T: both operands contracted over their minor dim.
    dx = _fence(jax.lax.dot_general(dy16, w16, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32),
                fenced)
    if not fenced:  # dw = x.T @ dy as one dot contracting the leading dims
        dw = jax.lax.dot_general(x16, dy16, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    elif x16.shape[1] <= dy16.shape[1]:  # transpose the smaller operand into a real row-major copy
        dw = _products(_fence(x16.T, True), dy16, True)  # [K, M] @ [M, N]
    else:
        dw = _products(_fence(dy16.T, True), x16, True).T  # ([N, M] @ [M, K]).T
    return dx.astype(x_dtype), dw.astype(w_dtype)


_bf16_matmul.defvjp(_forward, _backward)
