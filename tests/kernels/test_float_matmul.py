"""The "native_cpu" float32 matmul (jaxattn/kernels/float_matmul.py, native/float_matmul.cc): equal to the
float32 reference up to the order of additions, on shapes that leave every kind of remainder (rows past a
tile's, columns past a vector's, contractions across bands), for a weight stored [K, N] and one stored
[N, K] (the tied head); the reference itself above the native rows; gradients; a model's logits with its
tied head read natively. The instruction-set paths other than this machine's: tests/kernels/test_native_paths.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn import generate
from jaxattn.kernels import Kernels, float_matmul, native_build
from jaxattn.model import DecoderLM
from tests.tiny_models import drawn_params, tiny_config

pytestmark = pytest.mark.skipif(native_build.compiler() is None, reason="no C++ compiler for the native kernel")

# Rows: one, past a tile (AVX-512 8, AVX2 4), many passes, the most natively. K: one, odd, across the
# 64-row bands. N: one, below a vector, past a tile, tiles and a tail.
ROWS, DEPTHS, COLUMNS = (1, 9, 33, 64), (1, 5, 130), (1, 7, 49, 100)


def _data(M, K, N, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(M, K)).astype(np.float32), rng.normal(size=(K, N)).astype(np.float32)


def _close(got, expected, K):
    """float32 sums of K products of unit normals, in another order: within a few ulps of sqrt(K)."""
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5 * np.sqrt(K) * 4)


@pytest.mark.parametrize("M", ROWS)
def test_the_native_loop_equals_the_reference_for_both_weight_layouts(M):
    for K in DEPTHS:
        for N in COLUMNS:
            x, w = _data(M, K, N, seed=M * 1000 + K * 10 + N)
            expected = np.asarray(jnp.dot(x, w, preferred_element_type=jnp.float32))
            _close(np.asarray(float_matmul.native_matmul(x, w)), expected, K)
            _close(np.asarray(float_matmul.native_matmul(x, np.ascontiguousarray(w.T), transposed=True)), expected, K)


def test_more_rows_than_the_native_loop_takes_run_the_reference_and_gradients_are_the_references():
    x, w = _data(float_matmul.NATIVE_UP_TO + 1, 24, 40)
    np.testing.assert_array_equal(float_matmul.matmul(x, w), jnp.dot(x, w))
    x, w = _data(5, 24, 40, seed=1)
    dy = np.random.default_rng(2).normal(size=(5, 40)).astype(np.float32)
    for kernel, weight in ((float_matmul.matmul, w), (float_matmul.matmul_transposed, w.T)):
        dx, dw = jax.grad(lambda x, w: jnp.vdot(kernel(x, w), dy), argnums=(0, 1))(x, weight)
        _close(dx, dy @ w.T, 40)
        _close(dw, (x.T @ dy) if kernel is float_matmul.matmul else (x.T @ dy).T, 5)


def test_bad_shapes_are_one_clear_error():
    x, w = _data(2, 3, 4)
    with pytest.raises(ValueError, match=r"float matmul: x must be \[M, K\] and w \[K, N\] .* got x \(2, 3\), w \(4, 3\)"):
        float_matmul.native_matmul(x, w.T)
    with pytest.raises(ValueError, match=r"w \[N, K\]"):
        float_matmul.native_matmul(x, w, transposed=True)


def test_a_tied_model_decodes_the_same_tokens_with_its_head_and_products_native():
    config = tiny_config("gqa", positions="rope", tie_embeddings=True, vocab_size=97)
    params = drawn_params(config)
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 97, (3, 5)))
    logits = {name: DecoderLM(config, kernels=Kernels(matmul=name)).apply({"params": params}, tokens)
              for name in ("xla", "native_cpu")}
    np.testing.assert_allclose(logits["native_cpu"], logits["xla"], rtol=0, atol=1e-5)
    ids = {name: generate(params, config, tokens, jnp.full((3,), 5), max_new_tokens=6, rng=jax.random.PRNGKey(0),
                          temperature=0.0, kernels=Kernels(matmul=name)).tokens for name in ("xla", "native_cpu")}
    np.testing.assert_array_equal(ids["native_cpu"], ids["xla"])


def test_the_path_names_the_instruction_set_the_library_was_built_for():
    assert float_matmul.native_path() in ("avx512", "avx2", "neon", "scalar")
