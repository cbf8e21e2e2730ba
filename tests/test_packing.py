"""Packed rows: documents side by side in one row, kept apart by their segment ids (docs/theory.md §27).

The key check: a row packing three documents of different lengths (and padding) gives every token
the logits, and the loss its gradients, that each document gives alone, for tiny models with RoPE,
learned positions, GQA, MLA and a sliding-window layer, under the reference, the hand-written
backward and the blockwise kernel (blocks of 4 queries by 3 keys, so that documents span several
blocks and blocks several documents). Documents alone run as one right-padded batch without
segment ids: causal attention keeps a document's tokens from seeing the padding after it.
"""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn import kernels
from jaxattn.attention import reference_attention, scaled_dot_product_attention
from jaxattn.config import LayerKind
from jaxattn.kernels import Kernels, KernelFallbackWarning, auto, chunked
from jaxattn.kernels._call import AttentionCall
from jaxattn.masks import causal_mask, combine_masks, segment_mask, segment_positions
from jaxattn.model import DecoderLM
from tests.tiny_models import VOCAB, params_for, tiny_config

SMALL = "chunked_4x3"  # the test-only name: query blocks of 4, key blocks of 3


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setitem(kernels.IMPLEMENTATIONS["attention"], SMALL,
                        functools.partial(chunked.attention, block_q=4, block_k=3))


# Two packed rows of 16 tokens: lengths 5, 3, 6 and 2 of padding; 9, 4 and 3 of padding.
DOCUMENTS = ((5, 3, 6), (9, 4))
T = 16


def packed_ids() -> np.ndarray:
    ids = np.zeros((len(DOCUMENTS), T), np.int32)
    for b, lengths in enumerate(DOCUMENTS):
        starts = np.cumsum((0,) + lengths)
        for d, (start, stop) in enumerate(zip(starts[:-1], starts[1:])):
            ids[b, start:stop] = d + 1
    return ids


def tokens_and_alone(seed=0):
    """`(packed tokens [2, T], segment ids [2, T], alone tokens [5, L], real [5, L], where)`: `where` lists
    for each document (row, start, length) in the packed rows, in the order of the alone batch."""
    ids = packed_ids()
    tokens = np.random.default_rng(seed).integers(0, VOCAB, (len(DOCUMENTS), T)).astype(np.int32)
    where = [(b, int(np.cumsum((0,) + lengths)[d]), n) for b, lengths in enumerate(DOCUMENTS)
             for d, n in enumerate(lengths)]
    L = max(n for _, _, n in where)
    alone, real = np.zeros((len(where), L), np.int32), np.zeros((len(where), L), bool)
    for i, (b, start, n) in enumerate(where):
        alone[i, :n], real[i, :n] = tokens[b, start:start + n], True
    return jnp.asarray(tokens), jnp.asarray(ids), jnp.asarray(alone), jnp.asarray(real), where


CONFIGS = {
    "rope": tiny_config("mha", "rope"),
    "learned": tiny_config("mha", "learned", max_seq_len=T),
    "gqa_window": tiny_config("gqa", "rope", sliding_window=3, layer_pattern=(LayerKind(local=True), LayerKind())),
    "mla": tiny_config("mla_naive", "rope"),
}


def _next_token_loss(logits, tokens, counts):
    """Cross-entropy of predicting token t + 1 from t, summed where `counts [B, T - 1]` holds."""
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    picked = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    return -jnp.sum(jnp.where(counts, picked, 0.0))


@pytest.mark.parametrize("name", CONFIGS)
def test_a_packed_row_gives_each_document_what_it_gives_alone(name):
    config = CONFIGS[name]
    params = {"params": params_for(config)}
    tokens, ids, alone, _, where = tokens_and_alone()
    expected = jax.jit(DecoderLM(config).apply)(params, alone)  # [5, L, V], no segment ids
    attentions = ("xla", "custom_vjp", SMALL) + (("absorb",) if name == "mla" else ())
    for attention in attentions:
        chosen = Kernels(mla="absorb") if attention == "absorb" else Kernels(attention=attention)
        packed = jax.jit(functools.partial(DecoderLM(config, chosen).apply, segment_ids=ids))(params, tokens)
        for i, (b, start, n) in enumerate(where):
            np.testing.assert_allclose(packed[b, start:start + n], expected[i, :n], atol=3e-5, rtol=3e-5,
                                       err_msg=f"{attention}: document {i}")
        assert np.all(np.isfinite(packed)), attention  # padding tokens included
    # Negative control: without segment ids the later documents see the earlier ones.
    mixed = jax.jit(DecoderLM(config).apply)(params, tokens)
    b, start, n = where[1]
    assert np.abs(mixed[b, start:start + n] - expected[1, :n]).max() > 1e-3


@pytest.mark.parametrize("attention", ["xla", "custom_vjp", SMALL])
def test_the_packed_loss_has_the_gradients_of_the_documents_alone(attention):
    config = CONFIGS["gqa_window"]
    params = params_for(config)
    tokens, ids, alone, real, _ = tokens_and_alone(seed=1)
    model = DecoderLM(config, Kernels(attention=attention))

    def packed_loss(params):  # token t predicts t + 1 only within its document
        counts = (ids[:, 1:] == ids[:, :-1]) & (ids[:, :-1] != 0)
        return _next_token_loss(model.apply({"params": params}, tokens, segment_ids=ids), tokens, counts)

    def alone_loss(params):  # the sum of the documents' losses: the rows of the batch are independent
        return _next_token_loss(model.apply({"params": params}, alone), alone, real[:, 1:] & real[:, :-1])

    loss, grads = jax.jit(jax.value_and_grad(packed_loss))(params)
    loss_alone, grads_alone = jax.jit(jax.value_and_grad(alone_loss))(params)
    np.testing.assert_allclose(loss, loss_alone, rtol=1e-5)
    assert jax.tree.structure(grads) == jax.tree.structure(grads_alone)
    for g, g_alone in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_alone)):
        np.testing.assert_allclose(g, g_alone, atol=2e-5, rtol=1e-4)
