"""The Pallas flash-attention forward (the teaching kernel) equals the reference and skips hidden blocks.

Everything runs on CPU in Pallas interpret mode, with blocks of 16 or 32 so that a few dozen
positions make several blocks, partial last blocks included (docs/theory.md §10). Each distinct
shape compiles once (about a second), so the cases are few and each covers several features.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.attention import reference_attention as _reference_attention
from jaxattn.kernels.pallas_flash import flash_attention, key_block_counts

F32_TOL = dict(atol=2e-6, rtol=2e-5)
# Jitted: one compilation per shape instead of one per operation (the file's time is compilation).
reference_attention = jax.jit(_reference_attention, static_argnames=("is_causal", "scale"))


def qkv(B=2, T=20, S=37, N=4, K=2, H=8, Hv=5, seed=0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal(s, np.float32), dtype)
                 for s in ((B, T, N, H), (B, S, K, H), (B, S, K, Hv)))


# (shape of qkv, flash_attention's keywords). Hv = 5 != H = 8 throughout; T and S are not multiples
# of the blocks unless said. The other tests reuse these shapes, so their calls compile nothing new.
CASES = {
    "mha": (dict(T=20, S=37, N=2, K=2), dict(block_q=16, block_k=16)),
    "mha_causal_whole_blocks": (dict(T=48, S=48, N=2, K=2), dict(is_causal=True, block_q=16, block_k=16)),
    "gqa_causal_t_below_s_scale": (dict(T=24, S=56, N=4, K=2),
                                   dict(is_causal=True, scale=0.3, block_q=16, block_k=32)),
    "mqa_causal_one_query": (dict(T=1, S=37, N=4, K=1), dict(is_causal=True, block_q=16, block_k=16)),
    "mqa_causal_t_above_s": (dict(T=40, S=12, N=2, K=1), dict(is_causal=True, block_q=16, block_k=16)),
}


@pytest.mark.parametrize("name", CASES)
def test_equals_the_reference_float32(name):
    shape, kw = CASES[name]
    q, k, v = qkv(**shape)
    out = flash_attention(q, k, v, **kw)
    reference = reference_attention(q, k, v, is_causal=kw.get("is_causal", False), scale=kw.get("scale"))
    chex.assert_shape(out, q.shape[:3] + v.shape[-1:])
    chex.assert_type(out, jnp.float32)
    np.testing.assert_allclose(out, reference, **F32_TOL)


def test_bfloat16_inputs_give_bfloat16_close_to_float32():
    q, k, v = qkv(T=40, S=40, dtype=jnp.bfloat16)
    out = flash_attention(q, k, v, is_causal=True, block_q=16, block_k=16)
    chex.assert_type(out, jnp.bfloat16)
    reference = reference_attention(*(x.astype(jnp.float32) for x in (q, k, v)), is_causal=True)
    assert not np.isnan(np.asarray(out, np.float32)).any()
    np.testing.assert_allclose(np.asarray(out, np.float32), reference, atol=2e-2, rtol=2e-2)


def test_causal_rows_before_the_first_key_are_exactly_zero():
    shape, kw = CASES["mqa_causal_t_above_s"]
    hidden = shape["T"] - shape["S"]  # end-aligned: query t sees keys j <= t - hidden, rows < hidden none
    out = np.asarray(flash_attention(*qkv(**shape), **kw))
    assert not np.isnan(out).any()
    np.testing.assert_array_equal(out[:, :hidden], 0.0)
    assert (np.abs(out[:, hidden:]) > 0).all()  # the others do attend


def test_jit_equals_eager():
    shape, kw = CASES["gqa_causal_t_below_s_scale"]
    q, k, v = qkv(**shape)
    jitted = jax.jit(lambda q, k, v: flash_attention(q, k, v, **kw))
    np.testing.assert_allclose(jitted(q, k, v), flash_attention(q, k, v, **kw), atol=1e-7, rtol=0)


def counts(T, S, block_q, block_k, is_causal):
    """`[(n_unmasked, n_visible)]` per query block, as Python ints."""
    return [tuple(int(c) for c in key_block_counts(i, T=T, S=S, block_q=block_q, block_k=block_k,
                                                     is_causal=is_causal))
            for i in range(-(-T // block_q))]


def test_the_causal_loop_computes_only_visible_key_blocks():
    # T = S = 4 blocks: block pair (i, j) is computed iff j <= i, the diagonal one masked.
    square = counts(64, 64, 16, 16, True)
    assert square == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert sum(n for _, n in square) == 10  # of 16 block pairs
    assert sum(n - u for u, n in square) == 4  # only the diagonal pays for the mask
    assert counts(64, 64, 16, 16, False) == [(4, 4)] * 4
    assert counts(64, 40, 16, 16, False) == [(2, 3)] * 4  # the last key block holds padding: masked
    assert counts(16, 64, 16, 16, True) == [(3, 4)]  # end-aligned: queries at positions 48..63
    assert counts(64, 16, 16, 16, True) == [(0, 0), (0, 0), (0, 0), (0, 1)]  # T > S: rows 0..47 see nothing
    assert counts(48, 48, 16, 32, True) == [(0, 1), (0, 1), (1, 2)]  # key blocks of 32: rows 16..31 see block 0 in part


def test_hidden_key_blocks_are_never_read():
    # NaN values in the last key block (keys 32..47) reach only the last query block, the one that
    # can see them: query blocks 0 and 1 never load them. (The dense reference multiplies them by
    # weight 0 and gets NaN.)
    shape, kw = CASES["mha_causal_whole_blocks"]
    q, k, v = qkv(**shape)
    out = np.asarray(flash_attention(q, k, v.at[:, 32:].set(jnp.nan), **kw))
    assert np.isnan(out[:, 32:]).all()
    np.testing.assert_allclose(out[:, :32], reference_attention(q, k, v, is_causal=True)[:, :32], **F32_TOL)


@pytest.mark.parametrize("change, error, message", [
    (dict(query=np.zeros((2, 5, 4))), ValueError, r"query must have rank 4 \[B, T, N, H\]"),
    (dict(key=np.zeros((3, 7, 2, 8), np.float32)), ValueError, "batch sizes B differ: query"),
    (dict(key=np.zeros((2, 7, 2, 6), np.float32)), ValueError, "head dims H of query and key differ"),
    (dict(value=np.zeros((2, 6, 2, 5), np.float32)), ValueError, "value must match key in length S"),
    (dict(key=np.zeros((2, 7, 3, 8), np.float32), value=np.zeros((2, 7, 3, 5), np.float32)),
     ValueError, "query heads N=4 must be a multiple of key/value heads K=3"),
    (dict(block_q=0), ValueError, "block_q must be a positive integer"),
    (dict(block_k=-16), ValueError, "block_k must be a positive integer"),
    (dict(query=np.zeros((2, 5, 4, 8), np.int32)), TypeError, "query must be a floating-point array"),
])
def test_bad_inputs_raise_clear_errors(change, error, message):
    args = dict(query=np.zeros((2, 5, 4, 8), np.float32), key=np.zeros((2, 7, 2, 8), np.float32),
                value=np.zeros((2, 7, 2, 5), np.float32))
    args.update(change)
    with pytest.raises(error, match=message):
        flash_attention(**args)
