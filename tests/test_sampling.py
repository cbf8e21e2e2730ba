"""Sampling functions: exact supports on crafted logits, frequencies, determinism, jit without retracing."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn import sampling

# Probabilities 0.4, 0.3, 0.15, 0.1, 0.05 over ids 3, 0, 4, 1, 2.
PROBS = np.array([0.3, 0.1, 0.05, 0.4, 0.15], np.float32)
LOGITS = jnp.log(jnp.asarray(PROBS))[None, :]


def test_greedy_picks_argmax_and_lowest_id_on_ties():
    logits = jnp.array([[0.0, 2.0, 1.0], [5.0, 5.0, 1.0]])
    np.testing.assert_array_equal(sampling.greedy(logits), [1, 0])


@pytest.mark.parametrize("top_k, expected", [
    (1, [3]), (2, [3, 0]), (3, [3, 0, 4]), (5, [0, 1, 2, 3, 4]), (0, [0, 1, 2, 3, 4]), (-1, [0, 1, 2, 3, 4]),
])
def test_top_k_support_is_exact(top_k, expected):
    keep = sampling.support_mask(LOGITS, top_k=top_k)
    assert sorted(np.flatnonzero(keep[0]).tolist()) == sorted(expected)


def test_top_k_ties_never_grow_the_support():
    logits = jnp.array([[1.0, 3.0, 3.0, 3.0, 0.0]])
    keep = sampling.support_mask(logits, top_k=2)
    np.testing.assert_array_equal(keep[0], [False, True, True, False, False])


@pytest.mark.parametrize("top_p, expected", [
    (0.0, [3]),             # the best token always survives
    (0.39, [3]),            # 0.4 alone reaches 0.39
    (0.41, [3, 0]),         # needs 0.4 + 0.3
    (0.69, [3, 0]),
    (0.71, [3, 0, 4]),
    (0.9, [3, 0, 4, 1]),
    (0.96, [3, 0, 4, 1, 2]),
    (1.0, [3, 0, 4, 1, 2]),
])
def test_top_p_support_is_the_smallest_nucleus(top_p, expected):
    keep = sampling.support_mask(LOGITS, top_p=top_p)
    assert sorted(np.flatnonzero(keep[0]).tolist()) == sorted(expected)


def test_top_p_is_measured_after_top_k_renormalises():
    # Top-2 keeps 0.4 and 0.3 -> renormalised 4/7 ~ 0.571 and 3/7; top_p 0.55 then keeps only id 3.
    keep = sampling.support_mask(LOGITS, top_k=2, top_p=0.55)
    assert np.flatnonzero(keep[0]).tolist() == [3]
    keep = sampling.support_mask(LOGITS, top_k=2, top_p=0.6)
    assert sorted(np.flatnonzero(keep[0]).tolist()) == [0, 3]


def test_top_p_one_keeps_tokens_of_vanishing_probability():
    logits = jnp.array([[0.0, -200.0, -300.0]])
    assert bool(sampling.support_mask(logits, top_p=1.0).all())


def test_temperature_zero_is_greedy_whatever_the_key():
    logits = jax.random.normal(jax.random.PRNGKey(0), (4, 65))
    for seed in range(3):
        tokens = sampling.sample(logits, jax.random.PRNGKey(seed), temperature=0.0, top_k=5)
        np.testing.assert_array_equal(tokens, sampling.greedy(logits))


def test_same_key_same_tokens_different_key_different_tokens():
    logits = jnp.zeros((64, 65))
    a = sampling.sample(logits, jax.random.PRNGKey(1))
    b = sampling.sample(logits, jax.random.PRNGKey(1))
    c = sampling.sample(logits, jax.random.PRNGKey(2))
    chex.assert_shape(a, (64,))
    assert a.dtype == jnp.int32
    np.testing.assert_array_equal(a, b)
    assert (np.asarray(a) != np.asarray(c)).any()


def _frequencies(logits, n, **knobs):
    keys = jax.random.split(jax.random.PRNGKey(0), n)
    draw = jax.vmap(lambda key: sampling.sample(logits, key, **knobs)[0])
    return np.bincount(np.asarray(draw(keys)), minlength=logits.shape[-1]) / n


@pytest.mark.parametrize("knobs, support", [
    (dict(), [0, 1, 2, 3, 4]),
    (dict(top_k=3), [3, 0, 4]),
    (dict(top_p=0.71), [3, 0, 4]),
    (dict(top_k=4, top_p=0.8), [3, 0, 4]),  # top-4 mass 0.95; 0.4/0.95 + 0.3/0.95 = 0.737 < 0.8
])
def test_sampled_frequencies_match_renormalised_probabilities(knobs, support):
    n = 20000
    freq = _frequencies(LOGITS, n, **knobs)
    expected = np.zeros_like(PROBS)
    expected[support] = PROBS[support] / PROBS[support].sum()
    assert (freq[expected == 0] == 0).all()
    # 5 standard errors of a binomial proportion: a wrong distribution fails, noise does not.
    tolerance = 5 * np.sqrt(expected * (1 - expected) / n) + 1e-9
    np.testing.assert_array_less(np.abs(freq - expected), tolerance + 1e-12)


def test_temperature_sharpens_and_flattens():
    cold = _frequencies(LOGITS, 4000, temperature=0.25)
    hot = _frequencies(LOGITS, 4000, temperature=4.0)
    assert cold[3] > 0.6 > PROBS[3]
    assert hot.max() < 0.3 and hot.min() > 0.1


def test_knobs_are_traced_values_under_jit():
    traces = []

    @jax.jit
    def draw(logits, key, temperature, top_k, top_p):
        traces.append(1)
        return sampling.sample(logits, key, temperature=temperature, top_k=top_k, top_p=top_p)

    key = jax.random.PRNGKey(0)
    greedy_tokens = draw(LOGITS, key, 0.0, 0, 1.0)
    top1 = draw(LOGITS, key, 1.0, 1, 1.0)
    nucleus = draw(LOGITS, key, 0.7, 0, 0.3)
    assert len(traces) == 1
    assert int(greedy_tokens[0]) == int(top1[0]) == int(nucleus[0]) == 3


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.0, 0, 1.0), (0.0, 3, 0.5), (0.8, 0, 1.0),
                                                     (0.8, 3, 1.0), (0.8, 0, 0.6), (1.3, 4, 0.7)])
def test_sample_branches_equal_the_unbranched_formula(temperature, top_k, top_p):
    """`sample` skips sorting when top-k/top-p are off and everything when greedy: same tokens as the full path."""
    logits = jax.random.normal(jax.random.PRNGKey(5), (6, 11)) * 3
    key = jax.random.PRNGKey(9)
    full = jax.random.categorical(
        key, sampling.filter_logits(sampling.apply_temperature(logits, temperature), top_k=top_k, top_p=top_p),
        axis=-1)
    expected = sampling.greedy(logits) if temperature == 0 else full
    for knobs in [(temperature, top_k, top_p), (jnp.float32(temperature), jnp.int32(top_k), jnp.float32(top_p))]:
        got = jax.jit(lambda l, t, k, p: sampling.sample(l, key, temperature=t, top_k=k, top_p=p))(logits, *knobs)
        np.testing.assert_array_equal(got, expected)
