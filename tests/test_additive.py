"""Additive (Bahdanau) attention (docs/theory.md §13)."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn import additive_attention

additive = jax.jit(additive_attention, static_argnames=("return_weights",))


def inputs(B=2, T=3, S=5, Dq=4, Dk=6, Dv=3, A=8, seed=0):
    rng = np.random.default_rng(seed)
    shapes = dict(query=(B, T, Dq), key=(B, S, Dk), value=(B, S, Dv),
                  w_query=(Dq, A), w_key=(Dk, A), w_score=(A,))
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def numpy_additive(query, key, value, w_query, w_key, w_score, mask=None):
    """e_ij = w_score . tanh(q_i W_q + k_j W_k); a_ij = softmax_j(e_ij); out_i = sum_j a_ij v_j."""
    B, T, _ = query.shape
    S = key.shape[1]
    scores = np.zeros((B, T, S))
    for b in range(B):
        for i in range(T):
            for j in range(S):
                hidden = np.tanh(query[b, i] @ w_query + key[b, j] @ w_key)
                scores[b, i, j] = w_score @ hidden
    allowed = np.ones((B, T, S), bool) if mask is None else np.broadcast_to(mask, (B, T, S))
    exp = np.where(allowed, np.exp(scores - scores.max(-1, keepdims=True)), 0.0)
    total = exp.sum(-1, keepdims=True)
    weights = np.divide(exp, total, out=np.zeros_like(exp), where=total > 0)
    return np.einsum("bts,bsd->btd", weights, value), weights


class AdditiveShapeTest(chex.TestCase):

    @chex.variants(with_jit=True, without_jit=True)
    def test_shapes(self):
        x = inputs()
        fn = self.variant(functools.partial(additive_attention, return_weights=True))
        out, w = fn(**x, mask=np.ones((3, 5), bool))
        chex.assert_shape(out, (2, 3, 3))
        chex.assert_shape(w, (2, 3, 5))
        chex.assert_type([out, w], jnp.float32)
        chex.assert_shape(self.variant(additive_attention)(**x), (2, 3, 3))


def test_matches_numpy_transcription():
    x = inputs()
    out, w = additive(**x, return_weights=True)
    ref_out, ref_w = numpy_additive(**x)
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(w, ref_w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(w).sum(-1), 1.0, rtol=1e-6)


def test_masks_are_respected():
    x = inputs(B=2, T=3, S=5)
    mask = np.random.default_rng(1).random((2, 3, 5)) < 0.5
    mask[0, 0] = False  # a fully masked row
    mask[1, :, 0] = True
    out, w = additive(**x, mask=mask, return_weights=True)
    ref_out, ref_w = numpy_additive(**x, mask=mask)
    w = np.asarray(w)
    assert np.all(w[~mask] == 0.0)
    np.testing.assert_allclose(w, ref_w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out[0, 0], 0.0)  # fully masked row -> zeros
    rows = mask.any(-1)
    np.testing.assert_allclose(w.sum(-1)[rows], 1.0, rtol=1e-6)


def test_broadcast_key_mask():
    x = inputs(B=2, T=3, S=5)
    key_mask = np.array([[True, True, True, False, False]])  # [1, S] -> [B, T, S]
    out = additive(**x, mask=key_mask)
    ref_out, _ = numpy_additive(**x, mask=key_mask)
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5)


def test_errors():
    x = inputs(Dq=4, Dk=6, A=8)
    with pytest.raises(ValueError, match=r"query must have rank 3 \[B, T, Dq\]"):
        additive_attention(**{**x, "query": x["query"][0]})
    with pytest.raises(ValueError, match=r"w_score must have rank 1 \[A\]"):
        additive_attention(**{**x, "w_score": x["w_score"][None]})
    with pytest.raises(ValueError, match=r"w_query \(4, 7\) must be \(Dq, A\) = \(4, 8\)"):
        additive_attention(**{**x, "w_query": np.zeros((4, 7), np.float32)})
    with pytest.raises(ValueError, match=r"w_key \(5, 8\) must be \(Dk, A\) = \(6, 8\)"):
        additive_attention(**{**x, "w_key": np.zeros((5, 8), np.float32)})
    with pytest.raises(ValueError, match=r"key and value must share S"):
        additive_attention(**{**x, "value": x["value"][:, :4]})
    with pytest.raises(ValueError,
                       match=r"mask of shape \(3, 4\) is not broadcastable to \[B, T, S\]"):
        additive_attention(**x, mask=np.ones((3, 4), bool))
    with pytest.raises(TypeError, match=r"mask must be a boolean array"):
        additive_attention(**x, mask=np.ones((3, 5), np.float32))
