"""The one masked softmax and the one attention dropout (docs/theory.md §3, §12)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.softmax import MASKED_LOGIT, dropout_weights, grouped_sinks, logsumexp, masked_softmax, soft_cap


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
    grads = jax.grad(lambda x: (masked_softmax(x, mask) * jnp.arange(4.0)[None, :]).sum())(x)
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


# --------------------------------------------------------------------------------------------
# Soft cap, sinks and the logsumexp (docs/theory.md §17, §18), under rank promotion "raise".


@pytest.fixture
def no_rank_promotion():
    with jax.numpy_rank_promotion("raise"):
        yield


def test_soft_cap_bounds_logits_and_is_the_identity_without_a_cap():
    x = logits() * 10
    capped = np.asarray(soft_cap(x, 2.0))
    np.testing.assert_allclose(capped, 2.0 * np.tanh(np.asarray(x) / 2.0), rtol=1e-6)
    assert np.all(np.abs(capped) <= 2.0) and np.abs(capped).max() > 1.99  # float32 rounds tanh to 1 far out
    assert soft_cap(x, None) is x
    small = jnp.asarray([1e-3, -2e-3])  # near 0 the cap changes nothing: tanh(z) ~ z
    np.testing.assert_allclose(soft_cap(small, 5.0), small, rtol=1e-6)
    np.testing.assert_allclose(jax.grad(lambda z: soft_cap(z, 2.0).sum())(x), 1 - np.tanh(np.asarray(x) / 2) ** 2,
                               rtol=1e-5, atol=1e-6)


def _with_sink(x, mask, sink):
    """The textbook: the sink as one more logit, always visible, whose weight is dropped."""
    x = np.where(mask, np.asarray(x, np.float64), -np.inf)
    full = np.concatenate([x, np.broadcast_to(np.asarray(sink, np.float64)[..., None], x.shape[:-1] + (1,))], -1)
    e = np.exp(full - full.max(-1, keepdims=True))
    return (e / e.sum(-1, keepdims=True))[..., :-1]


def test_sinks_join_the_denominator_without_a_value(no_rank_promotion):
    x = logits((2, 3, 5))
    mask = np.random.default_rng(1).random(x.shape) < 0.6
    mask[0, 0] = False  # a row with no key: zeros, the sink takes it all
    sinks = jnp.asarray([[0.5, -1.0, 2.0], [1.0, 0.0, -3.0]], jnp.float32)  # one per row: [2, 3]
    w = np.asarray(masked_softmax(x, jnp.asarray(mask), sinks=sinks))
    np.testing.assert_allclose(w, _with_sink(x, mask, sinks), rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(w[0, 0], 0.0)
    assert np.all(w[~mask] == 0.0) and np.all(w.sum(-1) < 1.0)
    lse = np.asarray(logsumexp(x, jnp.asarray(mask), sinks=sinks))
    np.testing.assert_allclose(w.sum(-1), 1 - np.exp(np.asarray(sinks) - lse), rtol=1e-5, atol=1e-6)
    # A very negative sink is no sink at all (the negative control: a sink of 0 is not).
    np.testing.assert_allclose(masked_softmax(x, mask[1:2], sinks=jnp.full((1, 3), -1e4)),
                               masked_softmax(x, mask[1:2]), atol=1e-7)
    assert not np.allclose(masked_softmax(x, mask[1:2], sinks=jnp.zeros((1, 3))), masked_softmax(x, mask[1:2]))


def test_sinks_broadcast_lower_rank_masks_and_any_key_axis(no_rank_promotion):
    """A `[T, S]` mask and `[1, K, G, 1]`-style sinks against 5-D logits, and axis=0."""
    x = logits((2, 2, 3, 4, 5))  # [B, K, G, T, S]
    mask = jnp.tril(jnp.ones((4, 5), bool), 1)
    sinks = grouped_sinks(jnp.arange(6.0) - 2, 2)
    assert sinks.shape == (1, 2, 3, 1)
    np.testing.assert_allclose(masked_softmax(x, mask, sinks=sinks),
                               _with_sink(x, np.broadcast_to(mask, x.shape), np.broadcast_to(sinks, x.shape[:-1])),
                               rtol=1e-5, atol=1e-7)
    y = logits((5, 3))
    np.testing.assert_allclose(masked_softmax(y, axis=0, sinks=jnp.zeros(3)),
                               _with_sink(y.T, np.ones((3, 5), bool), np.zeros(3)).T, rtol=1e-5)
    np.testing.assert_allclose(grouped_sinks(jnp.arange(6.0), 3).ravel(), np.arange(6.0))  # n = k * G + g


def test_sink_gradients_are_finite_and_equal_the_textbook_with_empty_rows(no_rank_promotion):
    x = logits((3, 4))
    mask = jnp.array([[1, 1, 0, 1], [0, 0, 0, 0], [1, 0, 0, 0]], bool)
    sinks = jnp.asarray([0.3, -0.2, 1.0])
    target = jnp.asarray(np.random.default_rng(2).standard_normal((3, 4)), jnp.float32)

    def textbook(x, s):  # concatenated, then the masked softmax without sinks
        full = jnp.concatenate([x, s[:, None]], -1)
        return (masked_softmax(full, jnp.concatenate([mask, jnp.ones((3, 1), bool)], -1))[:, :4] * target).sum()
    grads = jax.grad(lambda x, s: (masked_softmax(x, mask, sinks=s) * target).sum(), (0, 1))(x, sinks)
    expected = jax.grad(textbook, (0, 1))(x, sinks)
    for g, e in zip(grads, expected):
        assert np.all(np.isfinite(g))
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)


def test_logsumexp_is_minus_infinity_for_a_row_with_nothing(no_rank_promotion):
    x = logits((2, 4))
    mask = jnp.array([[True, False, True, True], [False] * 4])
    lse = np.asarray(logsumexp(x, mask))
    np.testing.assert_allclose(lse[0], np.log(np.exp(np.asarray(x[0]))[[0, 2, 3]].sum()), rtol=1e-6)
    assert lse[1] == -np.inf
    np.testing.assert_allclose(logsumexp(x, mask, sinks=jnp.asarray([0.0, 1.5]))[1], 1.5)  # the sink alone
    np.testing.assert_allclose(logsumexp(x), jax.nn.logsumexp(x, axis=-1), rtol=1e-6)
    assert np.all(np.isfinite(jax.grad(lambda x: logsumexp(x, mask)[0])(x)))
