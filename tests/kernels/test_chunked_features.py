"""The blockwise kernel ("chunked") with soft-capping, sinks, two-sided windows and the residual.

Each feature against the reference in values, logsumexp and gradients (q, k, v, bias, sinks),
alone and combined with masks, key lengths and grouped heads (docs/theory.md §10, §17, §18).
Blocks are tiny (4 query rows by 3 keys) so that windows smaller than a block and windows
spanning blocks both occur, except at T = 4096 (the default blocks) and in the 32k memory
check. Everything runs under `jax.numpy_rank_promotion("raise")`.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_chunked import _bias

from jaxattn.attention import scaled_dot_product_attention
from jaxattn.kernels import chunked, chunked_blocks, xla


@pytest.fixture(autouse=True)
def no_rank_promotion():
    with jax.numpy_rank_promotion("raise"):
        yield


# The kernel contract's keywords (`jaxattn.kernels._call`), at their defaults.
CONTRACT = dict(mask=None, bias=None, is_causal=False, scale=1.0, dropout_rate=0.0, dropout_rng=None,
                return_weights=False, local_window_size=None, key_value_seq_lengths=None,
                logits_soft_cap=None, sinks=None)


def qkv(B=2, T=9, S=11, N=4, K=2, H=8, Hv=5, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal(s, np.float32)) for s in ((B, T, N, H), (B, S, K, H), (B, S, K, Hv)))


def reference(q, k, v, **kw):
    """`(out, lse)` of the reference ("xla"), called like `blockwise`."""
    out, weights, lse = xla.attention(q, k, v, **dict(CONTRACT, **kw), return_residual=True)
    assert weights is None
    return out, lse


def blockwise(q, k, v, *, block_q=4, block_k=3, **kw):
    """`(out, lse)` of `chunked.attention`, called with every keyword of the kernel contract."""
    out, weights, lse = chunked.attention(q, k, v, **dict(CONTRACT, **kw), return_residual=True,
                                          block_q=block_q, block_k=block_k)
    assert weights is None
    return out, lse


# Jitted with the structural arguments static, as the library calls the kernel.
blockwise_jit = jax.jit(blockwise, static_argnames=("is_causal", "local_window_size", "logits_soft_cap", "scale"))


def _value_and_grads(attend, q, k, v, bias, sinks, **kw):
    """The loss `<out, W>`, the logsumexp, and the gradients wrt q, k, v, bias and sinks (those given)."""
    weights = jnp.asarray(np.random.default_rng(5).standard_normal(q.shape[:3] + v.shape[-1:], np.float32))

    def loss(q, k, v, bias, sinks):
        out, lse = attend(q, k, v, bias=bias, sinks=sinks, **kw)
        return jnp.vdot(out, weights), lse
    argnums = tuple(i for i, x in enumerate((q, k, v, bias, sinks)) if x is not None)
    (value, lse), grads = jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True))(q, k, v, bias, sinks)
    return value, lse, dict(zip(["qkvbs"[i] for i in argnums], grads))


def assert_equal_to_reference(q, k, v, bias=None, sinks=None, rtol=1e-5, atol=1e-5, attend=blockwise, **kw):
    value, lse, grads = _value_and_grads(reference, q, k, v, bias, sinks, **kw)
    value_c, lse_c, grads_c = _value_and_grads(attend, q, k, v, bias, sinks, **kw)
    np.testing.assert_allclose(value_c, value, rtol=rtol, atol=atol)
    np.testing.assert_allclose(lse_c, lse, rtol=rtol, atol=atol)  # -inf where the reference has -inf
    assert lse_c.dtype == jnp.float32 and lse_c.shape == q.shape[:3]
    for name in grads:
        assert np.all(np.isfinite(grads_c[name])), name
        np.testing.assert_allclose(grads_c[name], grads[name], rtol=rtol, atol=atol, err_msg=name)
    return lse_c


def _sinks(N, seed=3):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(N).astype(np.float32) + 0.5)


# Each case combines features so that few programs compile. T and S are not multiples of the blocks (4, 3)
# unless said. Windows are (left, right) with jax.nn's meaning, end-aligned: query t sits at t + S - T.
CASES = {  # (T, S, (N, K), bias shape or None, sinks, kwargs)
    "cap_gqa_causal_t_lt_s_mask": (6, 13, (4, 2), (1, 4, 6, 13), False, dict(
        is_causal=True, scale=0.7, logits_soft_cap=1.5, mask=jnp.asarray(np.random.default_rng(7).random(
            (2, 1, 6, 13)) < 0.8))),
    "sinks_mqa_lengths_empty_row": (9, 11, (4, 1), (2, 1, 9, 1), True, dict(
        key_value_seq_lengths=jnp.array([11, 0]))),  # row 1: nothing but the sink
    "cap_sinks_causal_window_t_gt_s_minus_inf": (13, 7, (4, 2), "minus_inf", True, dict(
        is_causal=True, local_window_size=(3, 0), logits_soft_cap=0.8, scale=0.5)),
    "two_sided_window_inside_a_block": (10, 14, (4, 2), (1, 4, 10, 14), False, dict(
        local_window_size=(1, 2), logits_soft_cap=2.0)),
    "two_sided_causal_window_spanning_blocks": (16, 16, (4, 4), (1, 4, 16, 16), True, dict(
        is_causal=True, local_window_size=(7, 5))),  # right side cut by causality
    "two_sided_window_spanning_blocks_t_gt_s_lengths": (17, 12, (6, 2), (1, 6, 1, 12), True, dict(
        local_window_size=(6, 5), key_value_seq_lengths=jnp.array([12, 7]), logits_soft_cap=3.0)),
    "right_only_window_no_bias": (8, 8, (4, 2), None, True, dict(local_window_size=(0, 4), scale=0.3)),
    "diagonal_only_window": (12, 12, (4, 2), (12,), False, dict(is_causal=True, local_window_size=(0, 0))),
}


@pytest.mark.parametrize("case", CASES)
def test_values_residual_and_gradients_equal_the_reference(case):
    """Values, logsumexp and gradients wrt q, k, v, bias and sinks equal the reference to 1e-5 (float32)."""
    T, S, (N, K), bias_shape, with_sinks, kw = CASES[case]
    q, k, v = qkv(T=T, S=S, N=N, K=K)
    bias = None if bias_shape is None else (
        _bias((1, N, T, S), minus_inf=True) if bias_shape == "minus_inf" else _bias(bias_shape))
    assert_equal_to_reference(q, k, v, bias, _sinks(N) if with_sinks else None, **kw)


def test_rows_with_nothing_visible_give_zeros_and_their_residual():
    """No visible key: zero output and finite gradients; lse -inf without a sink, the sink itself with one."""
    q, k, v = qkv(T=6, S=5)
    lengths = jnp.array([5, 0])
    for sinks in (None, _sinks(4)):
        lse = assert_equal_to_reference(q, k, v, None, sinks, key_value_seq_lengths=lengths,
                                        is_causal=True, local_window_size=(1, 0), logits_soft_cap=1.0)
        out, _ = blockwise_jit(q, k, v, key_value_seq_lengths=lengths, sinks=sinks, is_causal=True)
        np.testing.assert_array_equal(out[1], 0.0)  # row 1: no keys
        np.testing.assert_array_equal(out[0, 0], 0.0)  # T > S: query 0 sits before the first key
        expected = -jnp.inf if sinks is None else jnp.broadcast_to(sinks, (6, 4))
        np.testing.assert_array_equal(lse[1], expected)


def test_the_residual_is_not_differentiated():
    """The logsumexp comes back under stop_gradient, as `jax.nn.dot_product_attention`'s."""
    q, k, v = qkv(T=5, S=5)
    grads = jax.grad(lambda q, s: blockwise(q, k, v, sinks=s)[1].sum(), argnums=(0, 1))(q, _sinks(4))
    assert all(not np.any(g) for g in grads)


def test_bfloat16_with_cap_and_sinks():
    """bfloat16 in and out, softmax in float32: within bfloat16 rounding of the float32 reference."""
    q, k, v = qkv(T=10, S=10)
    kw = dict(is_causal=True, local_window_size=(4, 0), logits_soft_cap=1.0, sinks=_sinks(4))
    out, lse = blockwise_jit(*(x.astype(jnp.bfloat16) for x in (q, k, v)), **kw)
    exact, exact_lse = reference(*(x.astype(jnp.bfloat16).astype(jnp.float32) for x in (q, k, v)), **kw)
    assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
    np.testing.assert_allclose(out.astype(jnp.float32), exact, rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(lse, exact_lse, rtol=1e-5, atol=1e-5)


def test_through_scaled_dot_product_attention():
    """The front end hands every new argument to "chunked" (its default blocks): soft cap, sinks, a
    two-sided window, query lengths and the residual, values and gradients equal to "xla"."""
    q, k, v = qkv(T=7, S=9)
    kw = dict(local_window_size=(2, 3), logits_soft_cap=1.5, return_residual=True,
              query_seq_lengths=jnp.array([7, 4]), key_value_seq_lengths=jnp.array([9, 6]))

    def attend(implementation, q, k, v, sinks):
        out, lse = scaled_dot_product_attention(q, k, v, sinks=sinks, implementation=implementation, **kw)
        return out, lse
    results = {}
    for implementation in ("xla", "chunked"):
        loss = lambda *args, i=implementation: (jnp.sum(attend(i, *args)[0] ** 2), attend(i, *args)[1])  # noqa: E731
        results[implementation] = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(
            q, k, v, _sinks(4))
    for x, y in zip(jax.tree_util.tree_leaves(results["chunked"]), jax.tree_util.tree_leaves(results["xla"])):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------
# Two-sided windows: which blocks are computed, and that the others are never read.


def _visible_by_brute_force(T, S, bq, bk, is_causal, window):
    p, j = np.arange(T)[:, None] + S - T, np.arange(S)[None, :]
    allowed = np.ones((T, S), bool)
    if is_causal:
        allowed &= j <= p
    if window is not None:
        allowed &= (j >= p - window[0]) & (j <= p + window[1])
    nq, nk = -(-T // bq), -(-S // bk)
    padded = np.zeros((nq * bq, nk * bk), bool)
    padded[:T, :S] = allowed
    return padded.reshape(nq, bq, nk, bk).any(axis=(1, 3))


@pytest.mark.parametrize("T, S", [(16, 16), (7, 19), (19, 7)])
def test_visible_blocks_are_exactly_those_holding_a_visible_pair(T, S):
    """Every (causal, window) rule, T = S and T != S: a block pair is computed iff it holds a visible
    (query, key), and each row of computed blocks is one interval (`_intervals` asserts it)."""
    for is_causal in (False, True):
        for window in (None, (0, 0), (1, 0), (0, 2), (2, 1), (5, 3), (3, 9), (30, 30)):
            visible = chunked_blocks.visible_blocks(T, S, 4, 3, is_causal, window)
            np.testing.assert_array_equal(visible, _visible_by_brute_force(T, S, 4, 3, is_causal, window),
                                          err_msg=f"{is_causal=} {window=}")
            chunked_blocks.intervals(visible)
            chunked_blocks.intervals(visible.T)


def test_two_sided_windows_skip_blocks_on_both_sides():
    """T = S = 32 in blocks of 4, non-causal window (1, 1): at most 3 key blocks per query block, 22 in all."""
    visible = chunked_blocks.visible_blocks(32, 32, 4, 4, False, (1, 1))
    assert visible.sum(axis=1).max() == 3 and visible.sum() == 8 + 2 * 7
    plan = chunked_blocks.Plan(32, 32, 4, 4, False, (1, 1), 1.0)
    start, stop = chunked_blocks.query_block_ranges(plan, None)  # the backward walks the same pairs
    assert int((stop - start).sum()) == 22


def test_blocks_outside_a_two_sided_window_are_never_read():
    """NaN keys and values in key blocks no query of a query block can see leave that block finite."""
    q, k, v = qkv(B=1, T=12, S=12)
    k, v = k.at[:, 9:].set(jnp.nan), v.at[:, 9:].set(jnp.nan)  # key block 3 (of 3 keys)
    out, _ = blockwise_jit(q, k, v, local_window_size=(2, 1), sinks=_sinks(4))
    # query block i (rows 4i..4i+3) sees keys 4i-2 .. 4i+4: only query block 2 reaches key 9
    assert np.all(np.isfinite(out[:, :8])) and np.all(np.isnan(out[:, 8:]))


# --------------------------------------------------------------------------------------------
# Long sequences: T = 4096 against the reference, O(T) memory at 32k.


def test_cap_and_sinks_equal_the_reference_at_4096():
    """T = S = 4096, the default blocks, causal, soft cap and sinks: values, logsumexp and gradients."""
    q, k, v = qkv(B=1, T=4096, S=4096, N=2, K=1, H=16, Hv=16)
    assert_equal_to_reference(q, k, v, None, _sinks(2), rtol=1e-4, atol=1e-5, is_causal=True, scale=0.25,
                              logits_soft_cap=2.0, attend=functools.partial(blockwise, block_q=chunked.BLOCK_Q,
                                                                            block_k=chunked.BLOCK_K))


def _largest_residual(**kw):
    q, k, v = qkv(B=1, T=64, S=64, N=2, K=1, H=4, Hv=4)
    _, vjp = jax.vjp(lambda q, k, v, s: blockwise(q, k, v, is_causal=True, sinks=s, **kw)[0], q, k, v, _sinks(2))
    return max(leaf.size for leaf in jax.tree_util.tree_leaves(vjp))


def test_the_backward_keeps_no_t_by_s_residual_with_cap_and_sinks():
    """The residuals stay q, k, v, out, lse and the sinks: nothing `[T, S]`."""
    assert _largest_residual(logits_soft_cap=1.0, local_window_size=(9, 0)) <= 2 * 64 * 4


def test_causal_32k_forward_and_backward_plans_under_4_gib_with_cap_and_sinks():
    """bench/attention.py's 32k case (B 1, N 8, H 64, float32, causal, fwd+bwd), here with a soft cap and
    sinks: the memory XLA plans for the program (arguments, outputs, temporaries) stays the plain
    kernel's (0.65 GiB in bench/results/attention.md), far under 4 GiB. Compiled, not run."""
    T, N, H = 32768, 8, 64
    q = jax.ShapeDtypeStruct((1, T, N, H), jnp.float32)
    sinks = jax.ShapeDtypeStruct((N,), jnp.float32)

    def loss(q, k, v, sinks):
        return blockwise(q, k, v, is_causal=True, scale=H ** -0.5, logits_soft_cap=50.0, sinks=sinks,
                         block_q=chunked.BLOCK_Q, block_k=chunked.BLOCK_K)[0].sum()
    memory = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(q, q, q, sinks).compile().memory_analysis()
    planned = memory.temp_size_in_bytes + memory.argument_size_in_bytes + memory.output_size_in_bytes
    assert planned < 1 * 2**30, planned / 2**30
