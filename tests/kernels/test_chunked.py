"""Blockwise attention ("chunked") equals the reference, skips hidden blocks and keeps O(T) residuals.

Blocks are tiny here (4 query rows by 3 keys, registered under a test-only name for the
duration of each test) so that a few dozen positions already make many blocks, partial last
blocks included; `test_the_seam_selects_chunked_with_its_default_blocks` runs the real
entry. The structural arguments (`local_window_size`, `key_value_seq_lengths`) are checked
for every implementation against the masks they stand for (docs/theory.md §10).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn import kernels
from jaxattn.attention import reference_attention, scaled_dot_product_attention
from jaxattn.kernels import Kernels, choices, chunked, chunked_blocks
from jaxattn.masks import padding_mask, sliding_window_mask

SMALL = "chunked_4x3"  # the test-only name: query blocks of 4, key blocks of 3


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setitem(kernels.IMPLEMENTATIONS["attention"], SMALL,
                        functools.partial(chunked.attention, block_q=4, block_k=3))


def qkv(B=2, T=9, S=11, N=4, K=2, H=8, Hv=5, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal(s, np.float32).astype(dtype))
                 for s in ((B, T, N, H), (B, S, K, H), (B, S, K, Hv)))


def _bias(shape, seed=2, minus_inf=False):
    bias = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    if minus_inf:  # shape [1, N, T, S]
        bias[0, 1, -1, :] = -np.inf  # head 1, the last query: every key hidden
        bias[0, 0, :, 1::2] = -np.inf  # head 0: every other key hidden
    return jnp.asarray(bias)


def _value_and_grads(implementation, q, k, v, bias=None, **kw):
    """The loss `<out, W>` and its gradients wrt q, k, v (and the bias when there is one)."""
    weights = jnp.asarray(np.random.default_rng(5).standard_normal(q.shape[:3] + v.shape[-1:], np.float32))

    def loss(q, k, v, bias):
        out = scaled_dot_product_attention(q, k, v, bias=bias, implementation=implementation, **kw)
        return jnp.vdot(out.astype(jnp.float32), weights)
    argnums = (0, 1, 2) if bias is None else (0, 1, 2, 3)
    return jax.jit(jax.value_and_grad(loss, argnums=argnums))(q, k, v, bias)


def _assert_equal_to_reference(q, k, v, bias=None, rtol=1e-5, atol=1e-5, **kw):
    loss, grads = _value_and_grads("xla", q, k, v, bias, **kw)
    loss_c, grads_c = _value_and_grads(SMALL, q, k, v, bias, **kw)
    np.testing.assert_allclose(loss_c, loss, rtol=rtol, atol=atol)
    for name, g, g_c in zip("qkvb", grads, grads_c):
        assert np.all(np.isfinite(g_c)), name
        np.testing.assert_allclose(g_c, g, rtol=rtol, atol=atol, err_msg=name)


# Each case combines several features so that the suite compiles few programs. T and S are not
# multiples of the blocks (4 and 3) unless said; every case has a bias, so its gradient is checked.
CASES = {  # (T, S, (N, K), bias shape, kwargs)
    "gqa_causal_t_lt_s_mask_scale": (6, 13, (4, 2), (1, 4, 6, 13), dict(  # end-aligned: 7 earlier keys
        is_causal=True, scale=0.7, mask=padding_mask(jnp.array([13, 9]), 13) & sliding_window_mask(6, 13, 8)[None, None])),
    "gqa_causal_t_gt_s_empty_rows": (13, 7, (4, 2), "minus_inf", dict(  # first 6 queries: no key
        is_causal=True, key_value_seq_lengths=jnp.array([7, 0]))),  # row 1: no key at all
    "mha_window_lengths": (14, 14, (4, 4), (1, 4, 14, 14), dict(
        is_causal=True, local_window_size=5, key_value_seq_lengths=jnp.array([14, 9]))),
    "mqa_unmasked_bias_per_batch_and_query": (9, 11, (4, 1), (2, 1, 9, 1), {}),
    "gqa3_one_query_bias_per_key": (1, 10, (6, 2), (10,), dict(is_causal=True)),
    "gqa_window_t_lt_s_bias_per_head_and_key": (7, 16, (4, 2), (1, 4, 1, 16), dict(
        is_causal=True, local_window_size=4)),
    "gqa_causal_whole_blocks": (12, 12, (4, 2), (1, 4, 12, 12), dict(is_causal=True)),
}


@pytest.mark.parametrize("case", CASES)
def test_values_and_gradients_equal_the_reference(case):
    """Values and gradients wrt q, k, v and the bias equal "xla" in float32 to 1e-5."""
    T, S, (N, K), bias_shape, kw = CASES[case]
    q, k, v = qkv(T=T, S=S, N=N, K=K)
    bias = _bias((1, N, T, S), minus_inf=True) if bias_shape == "minus_inf" else _bias(bias_shape)
    _assert_equal_to_reference(q, k, v, bias, **kw)


def test_rows_hidden_everywhere_give_zeros():
    """-inf biases, an empty padding row and early rows of causal T > S: zeros, never NaN
    (their gradients: `gqa_causal_t_gt_s_empty_rows` above)."""
    q, k, v = qkv(T=13, S=7)
    out = jax.jit(functools.partial(scaled_dot_product_attention, implementation=SMALL, is_causal=True))(
        q, k, v, bias=_bias((1, 4, 13, 7), minus_inf=True), key_value_seq_lengths=jnp.array([7, 0]))
    assert np.all(np.isfinite(out))
    np.testing.assert_array_equal(out[1], 0.0)  # row 1 has no keys
    np.testing.assert_array_equal(out[0, :6], 0.0)  # queries before the first key
    np.testing.assert_array_equal(out[0, -1, 1], 0.0)  # biased to -inf everywhere


def test_bfloat16_inputs_softmax_in_float32():
    """bfloat16 in, bfloat16 out, within bfloat16 rounding of the float32 maths on the same numbers."""
    q, k, v = qkv(T=10, S=10, dtype=jnp.bfloat16)

    @functools.partial(jax.jit, static_argnums=3)
    def value_and_grads(q, k, v, implementation):
        f = functools.partial(scaled_dot_product_attention, is_causal=True, implementation=implementation)
        out, vjp = jax.vjp(f, q, k, v)
        return out, vjp(jnp.ones_like(out))

    out, grads = value_and_grads(q, k, v, SMALL)
    exact, exact_grads = value_and_grads(*(x.astype(jnp.float32) for x in (q, k, v)), "xla")
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(out.astype(jnp.float32), exact, rtol=2e-2, atol=2e-2)
    for g, e in zip(grads, exact_grads):
        assert g.dtype == jnp.bfloat16
        np.testing.assert_allclose(g.astype(jnp.float32), e, rtol=5e-2, atol=5e-2)


# --------------------------------------------------------------------------------------------
# What is skipped, and what is kept for the backward.


def test_causal_and_window_blocks_are_skipped():
    """Causal T = S = 8 blocks computes the 36 block pairs on or below the diagonal, not 64; a window
    of one block computes at most 2 key blocks per query block; T < S adds the earlier keys' blocks."""
    plan = chunked_blocks.Plan(32, 32, 4, 4, True, None, 1.0)
    start, stop = chunked_blocks.key_block_ranges(plan, None)
    assert int((stop - start).sum()) == 36 == chunked_blocks.visible_blocks(32, 32, 4, 4, True, None).sum()
    start, stop = chunked_blocks.query_block_ranges(plan, None)  # the backward walks the same pairs
    assert int((stop - start).sum()) == 36
    window = chunked_blocks.visible_blocks(32, 32, 4, 4, True, (3, 0))  # the query and 3 keys back
    assert window.sum(axis=1).max() == 2 and window.sum() == 15
    assert chunked_blocks.visible_blocks(8, 32, 4, 4, True, None).sum() == 7 + 8
    assert chunked_blocks.visible_blocks(32, 32, 4, 4, False, None).sum() == 64
    lengths_stop = chunked_blocks.key_block_ranges(chunked_blocks.Plan(32, 32, 4, 4, False, None, 1.0), jnp.array([5, 9]))[1]
    np.testing.assert_array_equal(lengths_stop, 3)  # keys past the longest row (9): blocks 3.. skipped


def test_hidden_blocks_are_never_read():
    """NaN keys and values in the last key block poison every query that reads that block (0 * NaN):
    the reference reads it everywhere, "chunked" only in the last query block, which can see it."""
    q, k, v = qkv(B=1, T=12, S=12)
    k, v = k.at[:, 9:].set(jnp.nan), v.at[:, 9:].set(jnp.nan)  # key block 3 of 3 keys
    attend = jax.jit(scaled_dot_product_attention, static_argnames=("is_causal", "implementation"))
    out = attend(q, k, v, is_causal=True, implementation=SMALL)
    assert np.all(np.isfinite(out[:, :8])) and np.all(np.isnan(out[:, 8:]))  # query block 2 sees block 3
    assert np.all(np.isnan(attend(q, k, v, is_causal=True, implementation="xla")))


def _largest_residual(implementation, T, S):
    q, k, v = qkv(B=1, T=T, S=S, N=2, K=1, H=4, Hv=4)
    _, vjp = jax.vjp(lambda q, k, v: scaled_dot_product_attention(
        q, k, v, is_causal=True, implementation=implementation), q, k, v)
    return max(leaf.size for leaf in jax.tree_util.tree_leaves(vjp))


def test_the_backward_keeps_no_t_by_s_residual():
    """The residuals are O(T): q, k, v, out, lse; the reference keeps `[B, K, G, T, S]` weights."""
    T = S = 64
    assert _largest_residual(SMALL, T, S) <= 2 * T * 4  # out [B, K, G, T, Hv] = 2 * 64 * 4 numbers
    assert _largest_residual("xla", T, S) >= 2 * T * S


# --------------------------------------------------------------------------------------------
# The seam: names, fallbacks, modes, and the structural arguments everywhere.


def test_the_seam_selects_chunked_with_its_default_blocks():
    assert "chunked" in choices("attention") and Kernels(attention="chunked").attention == "chunked"
    q, k, v = qkv(T=7, S=9)
    _, grads = _value_and_grads("xla", q, k, v, _bias((1, 4, 7, 9)), is_causal=True)
    _, grads_c = _value_and_grads("chunked", q, k, v, _bias((1, 4, 7, 9)), is_causal=True)
    for g, g_c in zip(grads, grads_c):
        np.testing.assert_allclose(g_c, g, rtol=1e-5, atol=1e-5)


def test_weights_and_dropout_fall_back_and_forward_mode_raises():
    q, k, v = qkv(T=5, S=5)

    @functools.partial(jax.jit, static_argnums=0)
    def weights_and_dropout(implementation, q, k, v):
        f = functools.partial(scaled_dot_product_attention, implementation=implementation)
        return (f(q, k, v, is_causal=True, return_weights=True),
                # an "rbg" key: the same dropout contract, compiled in a fraction of threefry's time
                f(q, k, v, dropout_rate=0.5, dropout_rng=jax.random.key(3, impl="rbg")))
    for x, y in zip(jax.tree_util.tree_leaves(weights_and_dropout("chunked", q, k, v)),
                    jax.tree_util.tree_leaves(weights_and_dropout("xla", q, k, v))):
        np.testing.assert_array_equal(x, y)
    with pytest.raises(TypeError, match="custom_vjp"):
        jax.jit(lambda q: jax.jvp(  # lowered, not compiled
            lambda q: scaled_dot_product_attention(q, k, v, implementation="chunked"), (q,), (q,))).lower(q)


@pytest.mark.parametrize("implementation", choices("attention") + ("reference",))
def test_structural_arguments_equal_the_masks_they_stand_for(implementation):
    """`local_window_size` and `key_value_seq_lengths` equal `sliding_window_mask` and `padding_mask`
    (Mistral's window W = 3: the query and 2 keys back, `(W - 1, 0)`)."""
    q, k, v = qkv(T=6, S=9)
    lengths = jnp.array([9, 4])
    attend = (reference_attention if implementation == "reference" else
              functools.partial(scaled_dot_product_attention, implementation=implementation))
    structural = attend(q, k, v, is_causal=True, local_window_size=(2, 0), key_value_seq_lengths=lengths)
    masked = scaled_dot_product_attention(q, k, v, mask=sliding_window_mask(6, 9, 3)[None, None] & padding_mask(lengths, 9))
    np.testing.assert_allclose(structural, masked, rtol=1e-5, atol=1e-6)


def test_structural_arguments_are_checked():
    q, k, v = qkv(T=3, S=3)
    for window in (-1, (1,), (1, -2), (1.5, 0), True):
        with pytest.raises(ValueError, match="local_window_size must be a non-negative int w"):
            scaled_dot_product_attention(q, k, v, local_window_size=window)
    with pytest.raises(ValueError, match=r"key_value_seq_lengths \(3,\) must be \[B\] = \(2,\)"):
        scaled_dot_product_attention(q, k, v, key_value_seq_lengths=jnp.array([1, 2, 3]))
    with pytest.raises(TypeError, match="key_value_seq_lengths must be an integer array"):
        reference_attention(q, k, v, key_value_seq_lengths=jnp.array([1.0, 2.0]))
    for lengths in ([4, 2], [-1, 2]):  # outside [0, S]: checked whenever the values are known
        for attend in (scaled_dot_product_attention, reference_attention):
            with pytest.raises(ValueError, match=rf"key_value_seq_lengths must be in \[0, S=3\] for .*key "
                                                 rf"\(2, 3, 2, 8\).*, got \{lengths}"):
                attend(q, k, v, key_value_seq_lengths=jnp.array(lengths))
    edges = scaled_dot_product_attention(q, k, v, key_value_seq_lengths=jnp.array([0, 3]))  # both ends are fine
    assert not np.any(edges[0]) and np.all(np.isfinite(edges))
