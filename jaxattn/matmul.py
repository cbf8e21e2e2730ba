"""Matmuls with bfloat16 operands and float32 accumulation, fast in both directions on CPU.

On the 2-core AVX-512/AMX CPU of this project, XLA:CPU (jaxlib 0.10) runs a
`[768, 128] @ [128, 512]` matmul at ~200 GFLOP/s in float32 and at ~700-1000
GFLOP/s with bfloat16 operands and a float32 result (`preferred_element_type`),
but only when neither operand is contracted over its leading (major) dimension.
Autodiff of `x @ w` gives the weight gradient `x.T @ dy`, which contracts both
operands over their leading dimension (~150 GFLOP/s in bfloat16, and it fails
outright on the fallback dot for bfloat16 x bfloat16 -> float32). So the
bfloat16 path of `matmul` has a hand-written backward that feeds every product in a fast
form: `dx = dy @ w.T` contracts the minor dims, and `dw` is computed from a
transposed copy of the smaller of x and dy. Measured side by side in one
process this is the largest single gain in the baby training step
(bench/results/train_notes.md).

Numerics match `torch.autocast(dtype=torch.bfloat16)` for linear layers:
operands rounded to bfloat16 (8-bit mantissa), products summed in float32.

That speed needs the CPU's AMX-BF16 tile unit. On an AVX-512 CPU without AMX
(the same VM type in another session) bfloat16 dots ran at 87-101 GFLOP/s
against 75-180 for float32, and the baby training step was 1.3x slower with
bfloat16 than with float32. `matmul_dtype="auto"` therefore picks by hardware
(`fast_operand_dtype`).
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxattn._validate import require_rank


def _fenced(a: jnp.ndarray) -> jnp.ndarray:
    """`a` behind an optimization barrier, so that XLA cannot fold a neighbouring
    transpose into the dot that produces or consumes it."""
    return jax.lax.optimization_barrier(a[None])[0]


def _materialized_transpose(a: jnp.ndarray) -> jnp.ndarray:
    """`a.T` as a real row-major copy (a plain transpose would be folded into the
    consuming dot, turning it back into a contraction over the leading dim)."""
    return _fenced(a.T)


def _products(x16, w16):
    """`[M, K] @ [K, N]` bfloat16 -> float32, fenced: a transpose of the result
    downstream (e.g. the tied lm_head's `wte.T`) must not be folded into this dot."""
    return _fenced(jnp.dot(x16, w16, preferred_element_type=jnp.float32))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _bf16_matmul(x, w, x_dtype, w_dtype):
    return _products(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16))


def _bf16_matmul_fwd(x, w, x_dtype, w_dtype):
    x16, w16 = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    return _products(x16, w16), (x16, w16)


def _bf16_matmul_bwd(x_dtype, w_dtype, residuals, dy):
    """Gradients in the inputs' dtypes, from float32 sums of bfloat16 products."""
    x16, w16 = residuals
    dy16 = dy.astype(jnp.bfloat16)
    # dx = dy @ w.T: both operands contracted over their minor dim.
    dx = _fenced(jax.lax.dot_general(dy16, w16, (((1,), (1,)), ((), ())),
                                     preferred_element_type=jnp.float32))
    if x16.shape[1] <= dy16.shape[1]:  # transpose the smaller operand
        dw = _products(_materialized_transpose(x16), dy16)  # [K, M] @ [M, N]
    else:
        dw_t = _products(_materialized_transpose(dy16), x16)  # [N, M] @ [M, K]
        dw = dw_t.T  # a transpose of the fenced [N, K] product
    return dx.astype(x_dtype), dw.astype(w_dtype)


_bf16_matmul.defvjp(_bf16_matmul_fwd, _bf16_matmul_bwd)


def matmul(x: jnp.ndarray, w: jnp.ndarray, *, operand_dtype=jnp.float32) -> jnp.ndarray:
    """`x @ w` for `x [M, K]`, `w [K, N]`, accumulated and returned in float32.

    Args:
      x: `[M, K]`.
      w: `[K, N]`.
      operand_dtype: float32 (plain autodiff) or bfloat16 (operands rounded to
        bfloat16; the custom backward is reverse-mode only, so `jax.jvp` /
        `jax.jacfwd` through it raise).

    Returns:
      `[M, N]` float32.
    """
    require_rank("x", x, 2, "[M, K]")
    require_rank("w", w, 2, "[K, N]")
    if x.shape[1] != w.shape[0]:
        raise ValueError(f"x {x.shape} [M, K] and w {w.shape} [K, N] disagree in K")
    operand_dtype = jnp.dtype(operand_dtype)
    if operand_dtype == jnp.bfloat16:
        return _bf16_matmul(x, w, jnp.dtype(x.dtype), jnp.dtype(w.dtype))
    if operand_dtype == jnp.float32:
        return jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32))
    raise ValueError(f"operand_dtype must be float32 or bfloat16, got {operand_dtype}")


@functools.lru_cache(maxsize=None)
def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The feature flags of the first CPU in `cpuinfo` (empty where there is no such file)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def fast_operand_dtype(backend: str, flags: frozenset[str] | set[str]) -> tuple[str, str]:
    """(dtype, reason): the matmul operand dtype that trains faster on `backend` with CPU `flags`.

    "bfloat16" on GPUs and TPUs (bfloat16 matrix units) and on CPUs with AMX-BF16
    (`amx_bf16`: XLA's YNNPACK dots run 3-5x faster than float32 there);
    "float32" on other CPUs, where bfloat16 dots are no faster and the extra
    casts make a training step slower.
    """
    if backend in ("gpu", "cuda", "rocm", "tpu"):
        return "bfloat16", f"{backend} backend"
    if "amx_bf16" in flags:
        return "bfloat16", "this CPU has AMX-BF16"
    return "float32", "this CPU has no AMX-BF16, where bfloat16 matmuls are slower than float32"


def resolve_operand_dtype(name: str) -> str:
    """The concrete operand dtype of `name`: float32 and bfloat16 as they are, "auto" the
    `fast_operand_dtype` of this process's default backend and CPU.

    Initialises JAX's backend, so call it after setting XLA_FLAGS.
    """
    if name == "auto":
        return fast_operand_dtype(jax.default_backend(), cpu_flags())[0]
    if name not in ("float32", "bfloat16"):
        raise ValueError(f"matmul dtype must be 'float32', 'bfloat16' or 'auto', got {name!r}")
    return name
