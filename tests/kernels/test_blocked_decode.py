"""The "blocked" decode kernel equals the reference and reads only the blocks the queries can see.

Blocks of 4 slots in a cache of L = 23, so that blocks do not divide L and the
last block is shifted back (`block_start`); the library's default is 256.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn import decoding
from jaxattn.attention import cached_attention
from jaxattn.config import ModelConfig
from jaxattn.kernels import Kernels, blocked_decode, xla, xla_cpu
from jaxattn.kernels.blocked_decode import block_range, slots_read
from jaxattn.model import DecoderLM

L, BLOCK, H = 23, 4, 8
HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}


# Jitted once (compiles are most of these tests' time); under jit the positions, hence the trip counts, are traced.
_blocked = jax.jit(blocked_decode.cached_attention, static_argnames=("scale", "window", "block_size"))
_reference = jax.jit(cached_attention, static_argnames=("scale", "window"))


def blocked(query, key_cache, value_cache, positions, window=None):
    return _blocked(query, key_cache, value_cache, positions, scale=0.3, window=window, block_size=BLOCK)


def reference(query, key_cache, value_cache, positions, window=None):
    return _reference(query, key_cache, value_cache, positions, scale=0.3, window=window)


def inputs(N, K, T, dtype=jnp.float32, seed=0):
    """Four rows: an empty one (positions from 0), two inside and on block edges, one ending at L - 1."""
    rng = np.random.default_rng(seed)  # numpy: a jax.random draw per shape would compile
    query = jnp.asarray(rng.standard_normal((4, T, N, H), np.float32))
    caches = (jnp.asarray(rng.standard_normal((4, K, L, H), np.float32)).astype(dtype) for _ in range(2))
    positions = jnp.asarray(np.array([0, 4, 9, L - T])[:, None] + np.arange(T))
    return (query, *caches, positions)


@pytest.mark.parametrize("heads, num_queries, window", [
    ("mha", 1, None), ("mha", 5, 3), ("gqa", 1, 3), ("gqa", 5, None), ("mqa", 1, None), ("mqa", 5, 3)])
def test_blocked_equals_the_reference(heads, num_queries, window):
    """MHA/GQA/MQA, decode (T = 1) and prefill (T = 5, per-row positions), rows of different lengths,
    each with and without a sliding window (every pair of the three choices, compiles being the cost)."""
    query, key_cache, value_cache, positions = inputs(*HEADS[heads], num_queries)
    assert positions.min() == 0 and positions.max() == L - 1
    out = blocked(query, key_cache, value_cache, positions, window)
    expected = reference(query, key_cache, value_cache, positions, window)
    assert out.dtype == query.dtype
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_blocked_with_a_bfloat16_cache_equals_the_reference():
    """Both round the weights to bfloat16 for the value product (the blocked one before normalising)."""
    query, key_cache, value_cache, positions = inputs(4, 2, 3, jnp.bfloat16)
    for q in (query, query.astype(jnp.bfloat16)):
        out = blocked(q, key_cache, value_cache, positions, 5)
        expected = reference(q, key_cache, value_cache, positions, 5)
        assert out.dtype == q.dtype
        np.testing.assert_allclose(out.astype(np.float32), expected.astype(np.float32), rtol=0, atol=2e-2)


def test_queries_with_nothing_visible_give_zeros():
    """Position -1 sees no slot; with a window, a position far past the cache sees none either."""
    query, key_cache, value_cache, _ = inputs(4, 2, 1)
    positions = jnp.array([[-1], [3], [L + 10], [22]])
    for window in (None, 4):
        out = blocked(query, key_cache, value_cache, positions, window)
        expected = reference(query, key_cache, value_cache, positions, window)
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(out[0], 0.0)
    np.testing.assert_array_equal(blocked(query, key_cache, value_cache, positions, 4)[2], 0.0)


@pytest.mark.parametrize("heads, num_queries, window, cap, with_sinks", [
    ("gqa", 1, None, 1.0, True), ("mha", 5, 3, None, True), ("mqa", 5, None, 2.0, False), ("gqa", 5, 6, 0.5, True)])
def test_soft_cap_and_sinks_equal_the_reference(heads, num_queries, window, cap, with_sinks):
    """"blocked" (sinks start its online softmax) and "xla_cpu" equal the reference ("xla") with soft caps
    and sinks, with and without windows, rows of different lengths; a query that sees no slot gives
    zeros even with a sink."""
    query, key_cache, value_cache, positions = inputs(*HEADS[heads], num_queries)
    positions = positions.at[0, 0].set(-1)  # sees nothing
    N = query.shape[2]
    sinks = jnp.asarray(np.linspace(-1.0, 2.0, N), jnp.float32) if with_sinks else None
    kw = dict(scale=0.3, window=window, logits_soft_cap=cap)
    with jax.numpy_rank_promotion("raise"):
        expected = jax.jit(functools.partial(xla.cached_attention, **kw))(
            query, key_cache, value_cache, positions, sinks=sinks)
        outs = (jax.jit(functools.partial(blocked_decode.cached_attention, block_size=BLOCK, **kw))(
                    query, key_cache, value_cache, positions, sinks=sinks),
                jax.jit(functools.partial(xla_cpu.cached_attention, **kw))(
                    query, key_cache, value_cache, positions, sinks=sinks))
    for out in outs:
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(out[0, 0], 0.0)


def test_block_range_follows_the_highest_position_and_the_window():
    """Blocks read = ceil((max p + 1) / 4) without a window; with one, none before min p - W + 1."""
    for p in range(L):
        first, stop = block_range(jnp.array([[0], [p]]), L, BLOCK)
        assert (int(first), int(stop)) == (0, -(-(p + 1) // BLOCK))
        lo, hi = slots_read(jnp.array([[0], [p]]), L, BLOCK)
        assert (int(lo), int(hi)) == (0, min(-(-(p + 1) // BLOCK) * BLOCK, L))
    assert [int(b) for b in block_range(jnp.array([[10, 11], [14, 15]]), L, BLOCK, window=3)] == [2, 4]
    assert [int(s) for s in slots_read(jnp.array([[21]]), L, BLOCK, window=2)] == [19, 23]  # shifted last block
    assert [int(s) for s in slots_read(jnp.array([[40]]), L, BLOCK)] == [0, 23]  # positions past L: all blocks
    assert [int(s) for s in slots_read(jnp.array([[-1]]), L, BLOCK)] == [0, 0]


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("num_queries", [1, 2])
def test_slots_outside_the_read_range_are_never_read(num_queries, window):
    """Under jit, NaN in every slot outside `slots_read` and 1e30 in the read slots no query sees: the
    result is the reference's on a clean cache (a NaN read would reach the output: 0 * NaN = NaN).

    This is a property of this kernel only: the dense kernels need finite values in every slot."""
    query, key_cache, value_cache, _ = inputs(4, 2, num_queries, seed=1)
    for starts in ([0, 1, 2, 3], [4, 5, 6, 7], [6, 9, 10, 12]):
        positions = jnp.asarray(np.array(starts)[:, None] + np.arange(num_queries))
        lo, hi = (int(s) for s in slots_read(positions, L, BLOCK, window))
        assert hi - lo < L
        outside = (np.arange(L) < lo) | (np.arange(L) >= hi)  # [L]
        replace = (outside | ~cached_visible(positions, window))[:, None, :, None]  # [B, 1, L, 1]
        fill = np.where(outside, np.nan, 1e30)[None, None, :, None]
        dirty = [jnp.where(replace, fill, c) for c in (key_cache, value_cache)]
        out = blocked(query, *dirty, positions, window)
        expected = reference(query, key_cache, value_cache, positions, window)
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def cached_visible(positions, window):
    """`[B, L]`: slots some query of the row sees."""
    slot = np.arange(L)[None, None, :]
    p = np.asarray(positions)[:, :, None]
    seen = (slot <= p) & ((slot > p - window) if window else True)
    return seen.any(axis=1)


def test_blocked_decode_is_for_inference_only():
    """Reverse mode through a loop with a traced trip count (traced positions, as in decoding) is
    unsupported by JAX."""
    query, key_cache, value_cache, positions = inputs(4, 2, 1)
    loss = lambda q, p: blocked_decode.cached_attention(q, key_cache, value_cache, p, scale=0.3).sum()  # noqa: E731
    with pytest.raises(ValueError, match="[Rr]everse-mode"):
        jax.jit(jax.grad(loss))(query, positions)


def test_generate_with_blocked_decode_gives_the_reference_tokens(monkeypatch):
    """A tiny GQA model, greedy: the same tokens and logits, 4-slot blocks in a cache of 21 slots, the
    trip count traced inside `generate`'s scan (windows: the kernel tests above).

    The config (max_seq_len 23) is used by no other test, so `generate`'s compiled programs are
    traced here with the patched block size."""
    config = ModelConfig(vocab_size=17, d_model=32, num_layers=1, num_heads=4, num_kv_heads=2, max_seq_len=23,
                         init_std=0.2, positions="rope")
    params = jax.jit(DecoderLM(config).init)(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))["params"]
    prompts, lengths = np.array([[3, 1, 4, 1, 5, 9, 2], [6, 5, 3, 0, 0, 0, 0]], np.int32), np.array([7, 3])
    run = functools.partial(decoding.generate, params, config, prompts, lengths, max_new_tokens=13,
                            rng=jax.random.PRNGKey(0), temperature=0.0, return_logits=True)
    monkeypatch.setattr(blocked_decode, "BLOCK_SIZE", BLOCK)
    out, expected = run(kernels=Kernels(decode="blocked")), run(kernels=Kernels())
    np.testing.assert_array_equal(out.tokens, expected.tokens)
    np.testing.assert_allclose(out.logits, expected.logits, rtol=1e-5, atol=2e-5)
