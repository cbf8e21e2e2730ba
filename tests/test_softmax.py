"""The one masked softmax and the one attention dropout (docs/theory.md §3, §12)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.softmax import MASKED_LOGIT, dropout_weights, masked_softmax


def logits(shape=(2, 3, 5), dtype=np.float32, seed=0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape).astype(dtype) * 3)


def test_masked_keys_get_exactly_zero_and_rows_sum_to_one():
    x = logits()
    mask = np.random.default_rng(1).random(x.shape) < 0.6
    mask[..., 0] = True  # every row keeps a key
    w = np.asarray(masked_softmax(x, mask))
    assert np.all(w[~mask] == 0.0) and np.all(w[mask] > 0.0)
    np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-6)
    expected = np.where(mask, np.exp(x - np.where(mask, x, -np.inf).max(-1, keepdims=True)), 0.0)
    np.testing.assert_allclose(w, expected / expected.sum(-1, keepdims=True), rtol=1e-6)
    np.testing.assert_allclose(masked_softmax(x), jax.nn.softmax(x, axis=-1), rtol=1e-6)  # no mask: plain softmax


def test_fully_masked_rows_are_zero_with_finite_gradients():
    x = logits((2, 4))
    mask = jnp.array([[True, False, True, False], [False] * 4])  # row 1 has nothing to attend to
    w = masked_softmax(x, mask)
    np.testing.assert_array_equal(w[1], 0.0)
    np.testing.assert_allclose(w[0].sum(), 1.0, rtol=1e-6)
    grads = jax.grad(lambda x: (masked_softmax(x, mask) * jnp.arange(4.0)).sum())(x)
    assert np.all(np.isfinite(grads))
    np.testing.assert_array_equal(grads[1], 0.0)
    assert MASKED_LOGIT == float(np.finfo(np.float32).min)  # finite: no -inf - (-inf) = NaN


def test_bfloat16_logits_give_float32_weights():
    x = logits(dtype=np.float32)
    w16 = masked_softmax(x.astype(jnp.bfloat16), x > -1)
    assert w16.dtype == jnp.float32
    np.testing.assert_allclose(w16, masked_softmax(x.astype(jnp.bfloat16).astype(jnp.float32), x > -1), rtol=1e-6)
    with jax.enable_x64(True):
        assert masked_softmax(jnp.zeros(3, jnp.float64)).dtype == jnp.float64  # never downcast


def test_dropout_keeps_or_rescales_and_is_off_without_a_key():
    w = jnp.full((64, 64), 0.25)
    np.testing.assert_array_equal(dropout_weights(w, 0.5, None), w)
    np.testing.assert_array_equal(dropout_weights(w, 0.0, jax.random.PRNGKey(0)), w)
    dropped = np.asarray(dropout_weights(w, 0.5, jax.random.PRNGKey(0)))
    assert set(np.unique(dropped)) == {0.0, 0.5}  # 0 or w / (1 - p)
    assert abs((dropped == 0).mean() - 0.5) < 0.05  # 4096 draws: standard error 0.008


@pytest.mark.parametrize("axis", [0, -1])
def test_the_key_axis_can_be_any_axis(axis):
    x = logits((4, 4))
    mask = jnp.tril(jnp.ones((4, 4), bool))
    np.testing.assert_allclose(masked_softmax(x, mask, axis=axis).sum(axis), 1.0, rtol=1e-6)
