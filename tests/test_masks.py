"""Boolean masks (True = attend) and their additive form."""

import functools

import chex
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn import causal_mask, combine_masks, mask_to_bias, padding_mask, sliding_window_mask
from jaxattn.masks import key_offsets, local_window_mask, visible_cache_slots, window_sides


class MaskShapeTest(chex.TestCase):

    @chex.variants(with_jit=True, without_jit=True)
    def test_causal_mask(self):
        m = self.variant(causal_mask, static_argnums=(0, 1))(3, 5)
        chex.assert_shape(m, (3, 5))
        chex.assert_type(m, jnp.bool_)
        square = self.variant(causal_mask, static_argnums=0)(4)
        chex.assert_shape(square, (4, 4))
        np.testing.assert_array_equal(square, np.tril(np.ones((4, 4), bool)))

    @chex.variants(with_jit=True, without_jit=True)
    def test_sliding_window_mask(self):
        m = self.variant(sliding_window_mask, static_argnums=(0, 1, 2))(3, 6, 2)
        chex.assert_shape(m, (3, 6))
        chex.assert_type(m, jnp.bool_)

    @chex.variants(with_jit=True, without_jit=True)
    def test_padding_mask(self):
        m = self.variant(padding_mask, static_argnums=1)(jnp.array([3, 1, 0]), 4)
        chex.assert_shape(m, (3, 1, 1, 4))
        chex.assert_type(m, jnp.bool_)
        np.testing.assert_array_equal(m[:, 0, 0], [[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])

    @chex.variants(with_jit=True, without_jit=True)
    def test_combine_masks(self):
        a = np.array([[True, False, True]])  # [1, 3]
        b = np.array([[True], [False]])  # [2, 1]
        m = self.variant(combine_masks)(a, None, b)
        chex.assert_shape(m, (2, 3))
        chex.assert_type(m, jnp.bool_)
        np.testing.assert_array_equal(m, np.logical_and(a, b))

    @chex.variants(with_jit=True, without_jit=True)
    def test_mask_to_bias(self):
        mask = np.array([[True, False], [False, True]])
        for dtype in (jnp.float32, jnp.bfloat16):
            bias = self.variant(functools.partial(mask_to_bias, dtype=dtype))(mask)
            chex.assert_shape(bias, (2, 2))
            chex.assert_type(bias, dtype)
            np.testing.assert_array_equal(
                np.asarray(bias, np.float32),
                np.where(mask, 0.0, np.float32(jnp.finfo(dtype).min)))


def test_causal_mask_is_aligned_to_the_end_of_the_keys():
    """T < S: the T queries are the last T positions; query i sees key j iff j <= i + S - T."""
    m = np.asarray(causal_mask(2, 5))
    np.testing.assert_array_equal(m, [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    T, S = 3, 7
    m = np.asarray(causal_mask(T, S))
    for i in range(T):
        for j in range(S):
            assert m[i, j] == (j <= i + S - T)
    # The last row always sees every key; a single decode query sees the whole cache.
    assert np.asarray(causal_mask(1, 9)).all()


def test_causal_mask_with_more_queries_than_keys_leaves_early_rows_empty():
    m = np.asarray(causal_mask(4, 2))
    np.testing.assert_array_equal(m, [[0, 0], [0, 0], [1, 0], [1, 1]])


@pytest.mark.parametrize("T,S,window", [(6, 6, 1), (6, 6, 3), (3, 8, 2), (4, 4, 10)])
def test_sliding_window_counts(T, S, window):
    m = np.asarray(sliding_window_mask(T, S, window))
    offset = S - T
    for i in range(T):
        visible = np.flatnonzero(m[i])
        # Query i (absolute position i + offset) sees itself and window - 1 keys back.
        expected = np.arange(max(0, i + offset - window + 1), i + offset + 1)
        np.testing.assert_array_equal(visible, expected)
    # A window as long as the sequence is the causal mask.
    if window >= S:
        np.testing.assert_array_equal(m, causal_mask(T, S))


def test_sliding_window_is_subset_of_causal():
    m = np.asarray(sliding_window_mask(5, 9, 3))
    assert not np.any(m & ~np.asarray(causal_mask(5, 9)))
    np.testing.assert_array_equal(m.sum(-1), 3)


def test_padding_mask_values():
    lengths = np.array([5, 2])
    m = np.asarray(padding_mask(lengths, 5))
    chex.assert_shape(m, (2, 1, 1, 5))
    np.testing.assert_array_equal(m[:, 0, 0], np.arange(5)[None] < lengths[:, None])


def test_combine_masks_ignores_none_and_broadcasts():
    assert combine_masks() is None
    assert combine_masks(None, None) is None
    causal = causal_mask(3, 4)  # [T, S]
    pad = padding_mask(jnp.array([4, 2]), 4)  # [B, 1, 1, S]
    combined = np.asarray(combine_masks(None, causal, None, pad))
    chex.assert_shape(combined, (2, 1, 3, 4))
    np.testing.assert_array_equal(combined, np.asarray(causal)[None, None] & np.asarray(pad))
    np.testing.assert_array_equal(combine_masks(causal), causal)


def test_mask_to_bias_softmax_matches_masked_softmax():
    logits = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    mask = np.array([[1, 0, 1, 1], [1, 1, 1, 1], [0, 0, 1, 0]], bool)
    via_bias = np.asarray(jnp.exp(logits + mask_to_bias(mask)))
    via_bias = via_bias / via_bias.sum(-1, keepdims=True)
    direct = np.where(mask, np.exp(logits), 0.0)
    np.testing.assert_allclose(via_bias, direct / direct.sum(-1, keepdims=True), rtol=1e-6)
    # Finite: a fully masked row stays finite instead of -inf.
    assert np.isfinite(np.asarray(mask_to_bias(np.zeros(3, bool)))).all()


@pytest.mark.parametrize("fn,args,name", [
    (causal_mask, (0,), "q_len"),
    (causal_mask, (3, 0), "kv_len"),
    (causal_mask, (-2,), "q_len"),
    (sliding_window_mask, (0, 4, 2), "q_len"),
    (sliding_window_mask, (2, -1, 2), "kv_len"),
    (sliding_window_mask, (2, 4, 0), "window"),
    (sliding_window_mask, (2, 4, 1.5), "window"),
    (padding_mask, (jnp.array([1]), 0), "max_len"),
])
def test_non_positive_lengths_raise(fn, args, name):
    with pytest.raises(ValueError, match=rf"{name} must be a positive integer, got"):
        fn(*args)


def test_padding_mask_argument_errors():
    with pytest.raises(ValueError, match=r"lengths must have rank 1 \[B\], got shape \(2, 1\)"):
        padding_mask(jnp.array([[1], [2]]), 3)
    with pytest.raises(TypeError, match=r"lengths must be an integer array, got dtype float32"):
        padding_mask(jnp.array([1.0, 2.0]), 3)


def test_non_bool_masks_raise():
    with pytest.raises(TypeError, match=r"masks\[1\] must be a boolean array"):
        combine_masks(None, jnp.ones(3))  # names the caller's argument index
    with pytest.raises(TypeError, match=r"mask must be a boolean array"):
        mask_to_bias(jnp.ones(3, jnp.int32))


# --------------------------------------------------------------------------------------------
# Two-sided local windows, jax.nn's (left, right), end-aligned.


@pytest.mark.parametrize("T,S,window", [(6, 6, (2, 1)), (6, 6, (0, 0)), (3, 8, (2, 3)), (5, 4, (1, 0)),
                                        (4, 4, 2), (4, 7, (10, 10))])
def test_local_window_mask_sees_left_keys_back_and_right_keys_ahead(T, S, window):
    left, right = (window, window) if isinstance(window, int) else window
    m = np.asarray(local_window_mask(T, S, window))
    chex.assert_shape(m, (T, S))
    for i in range(T):
        p = i + S - T  # end-aligned: the last query sits at the last key
        np.testing.assert_array_equal(np.flatnonzero(m[i]), [j for j in range(S) if p - left <= j <= p + right])


def test_local_window_mask_relates_to_the_causal_masks():
    # (W - 1, 0) is the model's sliding window W, with or without the causal mask.
    np.testing.assert_array_equal(local_window_mask(5, 9, (2, 0)), sliding_window_mask(5, 9, 3))
    np.testing.assert_array_equal(local_window_mask(5, 9, (2, 4)) & causal_mask(5, 9), sliding_window_mask(5, 9, 3))
    np.testing.assert_array_equal(local_window_mask(4, 6, (6, 0)), causal_mask(4, 6))
    # A window wide enough is no mask; T == S with an int w is jax.nn's symmetric (w, w).
    assert np.asarray(local_window_mask(3, 5, (4, 4))).all()
    i, j = np.indices((5, 5))
    np.testing.assert_array_equal(local_window_mask(5, 5, 1), np.abs(i - j) <= 1)


def test_local_window_mask_matches_jax_nn_when_the_lengths_agree():
    """jax.nn's window is start-aligned: the same as ours at T == S, and shifted by S - T otherwise."""
    import jax
    rng = np.random.default_rng(0)
    q, k = (jnp.asarray(rng.standard_normal((1, 6, 1, 6)), jnp.float32) for _ in "qk")
    eye = jnp.eye(6, dtype=jnp.float32).reshape(1, 6, 1, 6)  # one-hot values: the output is the weights (Hv = H)
    for window in ((2, 1), (0, 3), 1):
        weights = jax.nn.dot_product_attention(q, k, eye, local_window_size=window)[0, :, 0]
        np.testing.assert_array_equal(np.asarray(weights) > 0, local_window_mask(6, 6, window))
    start_aligned = jax.nn.dot_product_attention(q[:, :3], k, eye, local_window_size=(1, 0))[0, :, 0]
    assert not np.array_equal(np.asarray(start_aligned) > 0, local_window_mask(3, 6, (1, 0)))


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("window", [None, (2, 1), (0, 3), (3, 0)])
def test_key_offsets_are_the_causal_and_window_masks_as_bounds(is_causal, window):
    """lo <= j - p <= hi exactly where `causal_mask` and `local_window_mask` allow (T != S: end-aligned)."""
    T, S = 4, 7
    lo, hi = key_offsets(is_causal, window)
    expected = np.ones((T, S), bool)
    if is_causal:
        expected &= np.asarray(causal_mask(T, S))
    if window is not None:
        expected &= np.asarray(local_window_mask(T, S, window))
    offsets = np.arange(S)[None, :] - (np.arange(T)[:, None] + S - T)  # j - p
    allowed = (offsets >= (-np.inf if lo is None else lo)) & (offsets <= (np.inf if hi is None else hi))
    np.testing.assert_array_equal(allowed, expected)
    assert (lo is None) == (window is None) and (hi is None) == (window is None and not is_causal)


@pytest.mark.parametrize("window", [(-1, 2), (1, -2), (1, 2, 3), (1.5, 2), 2.0, True, (True, 1), None, "2"])
def test_local_window_mask_refuses_anything_but_non_negative_ints(window):
    with pytest.raises(ValueError, match=r"local_window_size must be a non-negative int w \(meaning \(w, w\)\) or a "
                                         r"pair \(left, right\) of non-negative ints, got"):
        local_window_mask(3, 3, window)
    assert window_sides(3) == (3, 3) and window_sides([1, 0]) == (1, 0) and window_sides(np.int64(2)) == (2, 2)


def test_mask_helpers_are_rank_promotion_clean():
    """A `[T, S]` causal mask combined with a `[B, 1, 1, S]` padding mask, under rank promotion "raise"."""
    import jax
    with jax.numpy_rank_promotion("raise"):
        combined = combine_masks(causal_mask(3, 4), padding_mask(jnp.array([4, 2]), 4), local_window_mask(3, 4, (1, 1)))
        chex.assert_shape(combined, (2, 1, 3, 4))
        expected = np.asarray(causal_mask(3, 4)) & np.asarray(local_window_mask(3, 4, (1, 1)))
        np.testing.assert_array_equal(combined[1, 0], expected & (np.arange(4) < 2))
        chex.assert_shape(visible_cache_slots(jnp.array([[1, 2]]), 5, window=2), (1, 1, 2, 5))
