"""The acceptance rules: exact match by hand; rejection sampling checked statistically (20k draws against the
target's distribution, chi-square at p = 0.001) for a good draft, a deliberately bad one and the bonus token;
the target distribution is the one `jaxattn.sampling.sample` draws from."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxattn import sampling
from jaxattn.speculative import accept, greedy_accept, point_mass, rejection_accept, target_probs

V, DRAWS, ALPHA = 8, 20_000, 1e-3
# A target distribution with every token likely enough for the test (>= 2% each: >= 400 expected draws).
P = np.array([0.30, 0.20, 0.14, 0.11, 0.09, 0.07, 0.05, 0.04])
P_AFTER = np.array([0.05, 0.05, 0.10, 0.10, 0.15, 0.15, 0.20, 0.20])  # the target after the first draft


def chi_square_pvalue(draws, p) -> float:
    counts = np.bincount(np.asarray(draws), minlength=len(p))
    p = np.asarray(p, np.float64) / np.sum(p, dtype=np.float64)  # the expected counts must sum to the draws
    return stats.chisquare(counts, len(draws) * p).pvalue


@functools.partial(jax.jit, static_argnames=("k",))
def first_tokens(p, q, keys, *, k: int):
    """Per key: k drafts drawn from q, verified against p; `(first emitted token, accepted, next token)`."""
    def one(key):
        draft_key, verify_key = jax.random.split(key)
        drafts = jax.random.categorical(draft_key, jnp.log(q), axis=-1).astype(jnp.int32)  # [k]
        accepted, next_token = rejection_accept(p[None], q[None], drafts[None], jnp.array([k]), verify_key)
        first = jnp.where(accepted[0] > 0, drafts[0], next_token[0])
        return first, accepted[0], next_token[0]
    return jax.vmap(one)(keys)


def keys(seed=0):
    return jax.random.split(jax.random.PRNGKey(seed), DRAWS)


@pytest.mark.parametrize("draft", ["good", "bad", "uniform"])
def test_the_first_emitted_token_is_distributed_as_the_target(draft):
    q = {"good": 0.8 * P + 0.2 / V,  # close to p
         "bad": np.eye(V)[np.argmin(P)],  # a point mass on the target's least likely token
         "uniform": np.full(V, 1 / V)}[draft]
    p = jnp.asarray(np.stack([P, P_AFTER]), jnp.float32)  # [k+1, V], k = 1
    first, accepted, _ = first_tokens(p, jnp.asarray(q[None], jnp.float32), keys(), k=1)
    assert chi_square_pvalue(first, P) > ALPHA
    rate = float(np.mean(accepted))
    expected = np.minimum(P, q).sum()  # the acceptance of draft from q against p: sum min(p, q)
    assert abs(rate - expected) < 0.02, (rate, expected)


def test_the_bonus_token_after_every_draft_kept_is_drawn_from_the_target_after_them():
    """q = p: every draft kept; the bonus token, drawn from p at position k, is distributed as P_AFTER."""
    p = jnp.asarray(np.stack([P, P_AFTER]), jnp.float32)
    _, accepted, next_token = first_tokens(p, jnp.asarray(P[None], jnp.float32), keys(1), k=1)
    assert np.all(np.asarray(accepted) == 1)
    assert chi_square_pvalue(next_token, P_AFTER) > ALPHA


def test_the_token_after_a_bad_first_draft_is_distributed_as_the_target():
    """k = 2, the first draft a point mass on a token p gives 4%: nearly always rejected; what follows is
    drawn from the residual, and the first emitted token still follows P."""
    p = jnp.asarray(np.stack([P, P_AFTER, P]), jnp.float32)
    q = jnp.asarray(np.stack([np.eye(V)[7], P_AFTER]), jnp.float32)
    first, accepted, _ = first_tokens(p, q, keys(2), k=2)
    assert chi_square_pvalue(first, P) > ALPHA
    assert abs(float(np.mean(np.asarray(accepted) > 0)) - P[7]) < 0.01


def test_the_target_distribution_is_the_samplers():
    """`target_probs` with temperature, top-k and top-p against 20k draws of `jaxattn.sampling.sample`."""
    logits = jnp.asarray(np.log(P) * 1.3 + np.linspace(0, 0.2, V), jnp.float32)[None]  # [1, V]
    knobs = dict(temperature=0.7, top_k=6, top_p=0.95)
    p = np.asarray(target_probs(logits[None], **knobs))[0, 0]
    assert np.isclose(p.sum(), 1) and (p == 0).sum() >= 2  # top-k removed two tokens at least
    draws = jax.jit(jax.vmap(lambda key: sampling.sample(logits, key, **knobs)[0]))(keys(3))
    support = p > 0
    assert np.all(support[np.asarray(draws)])
    in_support = np.searchsorted(np.flatnonzero(support), np.asarray(draws))  # ids renumbered within the support
    assert chi_square_pvalue(in_support, p[support]) > ALPHA


def test_greedy_accept_keeps_the_leading_run_of_argmax_matches():
    # Target argmax per position: row 0 -> [2, 3, 1, 0], row 1 -> [5, 5, 5, 5].
    argmax = np.array([[2, 3, 1, 0], [5, 5, 5, 5]])
    logits = jnp.asarray(np.eye(V)[argmax] * 4.0, jnp.float32)  # [2, 4, V]
    drafts = jnp.array([[2, 3, 7], [5, 1, 5]], jnp.int32)
    accepted, next_token = greedy_accept(logits, drafts, jnp.array([3, 3]))
    np.testing.assert_array_equal(accepted, [2, 1])
    np.testing.assert_array_equal(next_token, [1, 5])
    accepted, next_token = greedy_accept(logits, drafts, jnp.array([1, 0]))  # fewer proposed: those only
    np.testing.assert_array_equal(accepted, [1, 0])
    np.testing.assert_array_equal(next_token, [3, 5])
    all_right = jnp.array([[2, 3, 1], [5, 5, 5]], jnp.int32)
    accepted, next_token = greedy_accept(logits, all_right, jnp.array([3, 3]))
    np.testing.assert_array_equal(accepted, [3, 3])
    np.testing.assert_array_equal(next_token, [0, 5])  # the bonus token


def test_accept_at_temperature_zero_is_greedy_and_jits_once_for_both():
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(3, 4, V)), jnp.float32)
    drafts = jnp.argmax(logits[:, :3], axis=-1).astype(jnp.int32).at[1, 1].set(0)
    num = jnp.array([3, 3, 2])
    run = jax.jit(lambda t: accept(logits, drafts, num, jax.random.PRNGKey(0), temperature=t))
    greedy = greedy_accept(logits, drafts, num)
    for got, want in zip(run(0.0), greedy):
        np.testing.assert_array_equal(got, want)
    accepted, next_token = run(1.0)
    assert np.all(np.asarray(accepted) <= np.asarray(num)) and np.all((0 <= next_token) & (next_token < V))
    np.testing.assert_array_equal(point_mass(drafts, V).sum(-1), np.ones((3, 3)))
