"""jaxattn.matmul: bfloat16 operands, float32 sums, and a backward in the fast dot forms.

Oracle: the same products in float64 numpy on the bfloat16-rounded operands, so
the only difference allowed is float32 summation order.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.matmul import cpu_flags, fast_operand_dtype, matmul, resolve_operand_dtype


def _rounded(x):
    """x rounded to bfloat16, as float64 numpy."""
    return np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32)).astype(np.float64)


def _data(M, K, N, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal(s, np.float32)) for s in ((M, K), (K, N), (M, N)))


def _loss(operand_dtype):
    return jax.jit(lambda x, w, dy: jnp.vdot(matmul(x, w, operand_dtype=operand_dtype), dy))


def test_float32_is_a_plain_matmul():
    x, w, _ = _data(6, 5, 3)
    np.testing.assert_array_equal(matmul(x, w), jnp.dot(x, w))


@pytest.mark.parametrize("M,K,N", [(24, 8, 32), (24, 32, 8)],
                         ids=["x-narrower-than-dy", "x-wider-than-dy"])
def test_bfloat16_products_and_gradients_are_rounded_operands_summed_in_float32(M, K, N):
    """Both branches of the weight gradient (which operand gets transposed) are covered."""
    x, w, dy = _data(M, K, N)
    y = jax.jit(lambda x, w: matmul(x, w, operand_dtype=jnp.bfloat16))(x, w)
    assert y.dtype == jnp.float32
    np.testing.assert_allclose(y, _rounded(x) @ _rounded(w), rtol=1e-5, atol=1e-5)
    dx, dw = jax.grad(_loss(jnp.bfloat16), argnums=(0, 1))(x, w, dy)
    assert dx.dtype == dw.dtype == jnp.float32
    np.testing.assert_allclose(dx, _rounded(dy) @ _rounded(w).T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, _rounded(x).T @ _rounded(dy), rtol=1e-5, atol=1e-5)


def test_bfloat16_is_close_to_float32():
    """bf16 keeps 8 mantissa bits: each product is off by ~2^-8 relative, sums of K=64 terms
    of random sign by about that times sqrt(K) against their O(sqrt(K)) size."""
    x, w, dy = _data(16, 64, 32, seed=1)
    np.testing.assert_allclose(matmul(x, w, operand_dtype=jnp.bfloat16), x @ w, rtol=0, atol=0.2)
    g16 = jax.grad(_loss(jnp.bfloat16), argnums=(0, 1))(x, w, dy)
    g32 = jax.grad(_loss(jnp.float32), argnums=(0, 1))(x, w, dy)
    for a, b in zip(g16, g32):
        np.testing.assert_allclose(a, b, rtol=0, atol=0.2)
        assert float(jnp.abs(a - b).max()) > 0  # really rounded


def test_gradients_keep_the_input_dtypes():
    x, w, dy = _data(8, 4, 4)
    dx, dw = jax.grad(_loss(jnp.bfloat16), argnums=(0, 1))(x.astype(jnp.bfloat16), w, dy)
    assert dx.dtype == jnp.bfloat16 and dw.dtype == jnp.float32


def test_forward_mode_is_not_supported_for_bfloat16():
    x, w, _ = _data(4, 4, 4)
    with pytest.raises(TypeError, match="custom_vjp"):
        jax.jvp(lambda x: matmul(x, w, operand_dtype=jnp.bfloat16), (x,), (x,))
    jax.jvp(lambda x: matmul(x, w), (x,), (x,))  # float32: any mode


def test_errors():
    x, w, _ = _data(4, 3, 2)
    with pytest.raises(ValueError, match=r"x .* \[M, K\]"):
        matmul(x[None], w)
    with pytest.raises(ValueError, match=r"disagree in K"):
        matmul(x, w.T)
    with pytest.raises(ValueError, match="operand_dtype"):
        matmul(x, w, operand_dtype=jnp.float16)


@pytest.mark.parametrize("backend,flags,expected,reason", [
    ("cpu", {"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}, "bfloat16", "has AMX-BF16"),
    ("cpu", {"avx512f", "avx512_bf16"}, "float32", "has no AMX-BF16"),  # bf16 instructions, no AMX: slower
    ("cpu", set(), "float32", "has no AMX-BF16"),
    ("gpu", set(), "bfloat16", "gpu backend"),
    ("tpu", set(), "bfloat16", "tpu backend"),
])
def test_fast_operand_dtype_is_bfloat16_only_where_it_is_faster(backend, flags, expected, reason):
    dtype, why = fast_operand_dtype(backend, frozenset(flags))
    assert dtype == expected and reason in why


def test_cpu_flags_reads_the_flags_line(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Some Xeon\nflags\t\t: fpu avx512f amx_bf16\n\n"
                       "processor\t: 1\nflags\t\t: fpu avx512f amx_bf16\n")
    assert cpu_flags(str(cpuinfo)) == {"fpu", "avx512f", "amx_bf16"}
    assert cpu_flags(str(tmp_path / "missing")) == frozenset()


def test_auto_resolves_to_this_machines_choice():
    assert resolve_operand_dtype("auto") == fast_operand_dtype(jax.default_backend(), cpu_flags())[0]
    assert resolve_operand_dtype("float32") == "float32"
    assert resolve_operand_dtype("bfloat16") == "bfloat16"
    with pytest.raises(ValueError, match="'float32', 'bfloat16' or 'auto', got 'float16'"):
        resolve_operand_dtype("float16")
