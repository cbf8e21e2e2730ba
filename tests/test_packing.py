"""Packed rows: documents side by side in one row, kept apart by their segment ids (docs/theory.md §27).

The key check: a row packing three documents of different lengths (and padding) gives every token
the logits, and the loss its gradients, that each document gives alone, for tiny models with RoPE,
learned positions, GQA, MLA and a sliding-window layer, under the reference, the hand-written
backward, its causal blocks of query rows (blocks of 4 rows) and the blockwise kernel (blocks of 4
queries by 3 keys), so that documents span several blocks and blocks several documents. Documents alone run as one right-padded batch without
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
from jaxattn.kernels import Kernels, KernelFallbackWarning, auto, chunked, chunked_blocks, custom_vjp
from jaxattn.kernels._call import AttentionCall
from jaxattn.scan_plan import stack_params
from jaxattn.masks import causal_mask, combine_masks, segment_mask, segment_positions
from jaxattn.model import DecoderLM
from tests.tiny_models import VOCAB, params_for, tiny_config

SMALL = "chunked_4x3"  # the test-only name: query blocks of 4, key blocks of 3
ROWS = "causal_blocks_5"  # the test-only name: causal_blocks in blocks of at most 5 rows (16 rows: 4 of 4)


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setitem(kernels.IMPLEMENTATIONS["attention"], SMALL,
                        functools.partial(chunked.attention, block_q=4, block_k=3))
    monkeypatch.setitem(kernels.IMPLEMENTATIONS["attention"], ROWS,
                        functools.partial(custom_vjp.attention, rows_per_block=5))


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
    attentions = ("xla", "custom_vjp", SMALL, ROWS) + (("absorb",) if name == "mla" else ())
    for attention in attentions:
        chosen = Kernels(mla="absorb") if attention == "absorb" else Kernels(attention=attention)
        packed = jax.jit(functools.partial(DecoderLM(config, chosen).apply, segment_ids=ids))(params, tokens)
        for i, (b, start, n) in enumerate(where):
            np.testing.assert_allclose(packed[b, start:start + n], expected[i, :n], atol=3e-5, rtol=3e-5,
                                       err_msg=f"{attention}: document {i}")
        assert np.all(np.isfinite(packed)), attention  # padding tokens included
    if name == "gqa_window":  # the layers under one scan take the segment ids too
        scanned = config.replace(scan_layers=True, num_layers=4)
        stacked = {"params": stack_params(params_for(scanned.replace(scan_layers=False)), scanned)}
        expected = jax.jit(DecoderLM(scanned).apply)(stacked, alone)
        packed = jax.jit(functools.partial(DecoderLM(scanned, Kernels(attention=SMALL)).apply, segment_ids=ids))(
            stacked, tokens)
        for i, (b, start, n) in enumerate(where):
            np.testing.assert_allclose(packed[b, start:start + n], expected[i, :n], atol=3e-5, rtol=3e-5)
    if name == "learned":  # negative control: without segment ids the later documents see the earlier ones
        mixed = jax.jit(DecoderLM(config).apply)(params, tokens)
        b, start, n = where[1]
        assert np.abs(mixed[b, start:start + n] - expected[1, :n]).max() > 1e-3


@pytest.mark.parametrize("attention", ["custom_vjp", SMALL, ROWS])
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


def qkv(B=2, T=24, N=4, K=2, H=8, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((B, T, N, H), (B, T, K, H), (B, T, K, H)))


# Row 0: documents of 6, 9 and 7 tokens, 2 of padding; row 1: 6, then 18. With key blocks of 3 and
# query blocks of 4, key block 0 (positions 0-2) holds document 1 only, in both rows.
ATTENTION_IDS = jnp.asarray([[1] * 6 + [2] * 9 + [3] * 7 + [0] * 2, [1] * 6 + [2] * 18], jnp.int32)


def test_chunked_skips_the_blocks_of_other_documents_and_equals_the_reference():
    # Which block pairs run: the causal band, less the pairs of different documents.
    computed = chunked_blocks.blocks_computed(24, 24, 4, 3, True, None, ATTENTION_IDS)
    causal = chunked_blocks.visible_blocks(24, 24, 4, 3, True, None)
    np.testing.assert_array_equal(computed[2:, 0], False)  # query blocks from position 8 on: documents 2, 3
    assert computed.sum() < causal.sum() and not (computed & ~causal).any()
    # The proof that they are never visited: NaN keys and values in key block 0 (document 1) reach
    # every query row that computes the block (0 * NaN is NaN), its output and its query's gradient,
    # and none that skips it. (Keys' gradients are not compared: document 2's first rows share a
    # query block with document 1, so their outputs, and through them those keys' gradients, are NaN.)
    q, k, v = qkv()
    poison = lambda x: x.at[:, :3].set(jnp.nan)  # noqa: E731

    def run(implementation, k, v, **kw):
        def loss(q, k, v):
            out = scaled_dot_product_attention(q, k, v, is_causal=True, implementation=implementation, **kw)
            return jnp.sum(out[:, 8:] ** 2), out
        (_, out), grads = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(q, k, v)
        return out, grads
    expected, expected_grads = jax.jit(functools.partial(run, "xla", segment_ids=ATTENTION_IDS))(k, v)
    packed = jax.jit(functools.partial(run, SMALL, segment_ids=ATTENTION_IDS))
    out, grads = packed(poison(k), poison(v))
    np.testing.assert_allclose(out[:, 8:], expected[:, 8:], atol=2e-6, rtol=2e-6)
    np.testing.assert_allclose(grads[0][:, 8:], expected_grads[0][:, 8:], atol=1e-5, rtol=1e-5)
    out, grads = packed(k, v)  # clean: every row and gradient
    np.testing.assert_allclose(out, expected, atol=2e-6, rtol=2e-6)
    for g, g_expected in zip(grads, expected_grads):
        np.testing.assert_allclose(g, g_expected, atol=1e-5, rtol=1e-5)
    # Negative control: causal alone visits key block 0 from every query block.
    out, _ = jax.jit(functools.partial(run, SMALL))(poison(k), poison(v))
    assert np.isnan(out[:, 8:]).all()


def test_segment_blocks_is_exact_for_ids_in_any_order():
    ids = jnp.asarray([[2, 2, 1, 1, 2, 2, 0, 3, 3]], jnp.int32)  # document 2 in two runs, out of order
    meet = chunked_blocks.blocks_computed(9, 9, 4, 3, False, None, ids)  # segment_blocks alone: no causal band
    exact = np.asarray(segment_mask(ids, ids))[0, 0]  # [T, T]
    for i in range(3):
        for j in range(4):
            if exact[4 * i:4 * i + 4, 3 * j:3 * j + 3].any():
                assert meet[i, j], (i, j)  # never skips a pair with a visible (query, key)
    assert not meet.all()  # and still skips some
    q, k, v = qkv(B=1, T=9)
    out, expected = jax.jit(lambda q, k, v: (scaled_dot_product_attention(q, k, v, segment_ids=ids, implementation=SMALL),
                                             reference_attention(q, k, v, segment_ids=ids)))(q, k, v)
    np.testing.assert_allclose(out, expected, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("implementation", ["xla", "custom_vjp", SMALL, "auto_cpu"])
def test_a_padding_only_row_gives_zeros_and_finite_gradients(implementation):
    q, k, v = qkv(T=9)
    ids = jnp.asarray([[0] * 9, [1, 1, 1, 2, 2, 2, 2, 0, 0]], jnp.int32)

    def loss(q, k, v):
        out = scaled_dot_product_attention(q, k, v, is_causal=True, segment_ids=ids, implementation=implementation)
        return jnp.sum(out ** 2), out
    (_, out), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(q, k, v)
    np.testing.assert_array_equal(out[0], 0.0)
    np.testing.assert_array_equal(out[1, 7:], 0.0)  # padding attends to nothing
    assert all(np.isfinite(g).all() for g in grads)
    expected = jax.jit(lambda q, k, v: reference_attention(q, k, v, is_causal=True, segment_ids=ids))(q, k, v)
    np.testing.assert_allclose(out, expected, atol=2e-6)
    np.testing.assert_array_equal(grads[1][:, 7:], 0.0)  # and is never attended
    np.testing.assert_array_equal(grads[1][0], 0.0)


def test_a_padding_only_row_of_the_model_is_finite():
    config = CONFIGS["rope"]
    tokens, ids, *_ = tokens_and_alone()
    ids = ids.at[1].set(0)
    logits = jax.jit(functools.partial(DecoderLM(config, Kernels(attention=SMALL)).apply, segment_ids=ids))(
        {"params": params_for(config)}, tokens)
    assert np.isfinite(logits).all()


def test_segment_positions_restart_at_each_document():
    ids = jnp.asarray([[1, 1, 1, 2, 2, 3, 0, 0], [4, 4, 4, 4, 4, 0, 5, 5]], jnp.int32)
    np.testing.assert_array_equal(segment_positions(ids), [[0, 1, 2, 0, 1, 0, 0, 0], [0, 1, 2, 3, 4, 0, 0, 1]])
    np.testing.assert_array_equal(jax.jit(segment_positions)(ids), segment_positions(ids))
    with pytest.raises(ValueError, match=r"segment_ids row 0 splits a document into several runs"):
        segment_positions(jnp.asarray([[1, 1, 2, 1]], jnp.int32))
    mask = combine_masks(causal_mask(8), segment_mask(ids, ids))  # [B, 1, T, S]
    assert mask.shape == (2, 1, 8, 8) and not mask[0, 0, 3, :3].any() and mask[0, 0, 4, 3:5].all()
    assert not mask[1, 0, 5].any() and not mask[1, 0, :, 5].any()  # padding: attends to nothing, never attended


def test_bad_segment_ids_are_one_clear_error_before_tracing():
    q, k, v = qkv(T=9)
    good = jnp.ones((2, 9), jnp.int32)
    cases = [
        (ValueError, r"segment_ids must be \[B, T\] = \(2, 9\), got shape \(2, 8\) for query \(2, 9, 4, 8\)",
         dict(segment_ids=good[:, :8])),
        (ValueError, r"segment_ids must be \[B, T\] = \(2, 9\), got shape \(9,\)", dict(segment_ids=good[0])),
        (TypeError, r"segment_ids must be an integer array \[B, T\] = \(2, 9\), got dtype float32 of shape \(2, 9\)",
         dict(segment_ids=good.astype(jnp.float32))),
        (TypeError, r"segment_ids must be an integer array .* got list", dict(segment_ids=[[1] * 9] * 2)),
    ]
    for error, message, kw in cases:  # under jit: shapes and dtypes are known when tracing
        for implementation in ("xla", SMALL):
            with pytest.raises(error, match=message):
                jax.jit(lambda q, k, v: scaled_dot_product_attention(q, k, v, implementation=implementation, **kw))(
                    q, k, v)
    with pytest.raises(ValueError, match=r"segment_ids must be >= 0"):  # values: only where they are known
        scaled_dot_product_attention(q, k, v, segment_ids=good.at[0, 0].set(-1))
    with pytest.raises(ValueError, match=r"segment_ids mark the documents of a packed self-attention.*T=9, S=6"):
        scaled_dot_product_attention(q, k[:, :6], v[:, :6], segment_ids=good)
    config = CONFIGS["rope"]
    tokens, ids, *_ = tokens_and_alone()
    model, params = DecoderLM(config), {"params": params_for(config)}
    with pytest.raises(ValueError, match=r"segment_ids must be \[B, T\] = \(2, 16\), got shape \(2, 15\) for tokens"):
        jax.jit(lambda p, t, s: model.apply(p, t, segment_ids=s))(params, tokens, ids[:, 1:])
    with pytest.raises(TypeError, match=r"segment_ids must be an integer array \[B, T\] = \(2, 16\), got dtype bool"):
        model.apply(params, tokens, segment_ids=ids > 0)


def test_unbatched_calls_take_segment_ids_of_the_queries_shape():
    q, k, v = qkv(T=9)
    ids = jnp.asarray([[1, 1, 1, 2, 2, 2, 2, 0, 0]] * 2, jnp.int32)
    batched = scaled_dot_product_attention(q, k, v, is_causal=True, segment_ids=ids, implementation="xla")
    one = scaled_dot_product_attention(q[0], k[0], v[0], is_causal=True, segment_ids=ids[0], implementation="xla")
    np.testing.assert_allclose(one, batched[0], atol=1e-6)


def test_cudnn_falls_back_and_the_rules_pick_kernels_that_take_segment_ids():
    call = AttentionCall(T=2048, S=2048, N=8, K=2, H=64, Hv=64, dtype="bfloat16", is_causal=True, segments=True)
    name, reason = auto.gpu_rule(call)
    assert name == "chunked" and "cudnn cannot: segment ids of packed rows" in reason
    assert not any(c.isdigit() for c in reason.split(";")[0])  # the refusal quotes no figures
    assert auto.tpu_rule(call)[0] == "splash" and auto.cpu_rule(call)[0] == "chunked"
    q, k, v = (x.astype(jnp.bfloat16) for x in qkv(T=9))
    ids = jnp.asarray([[1, 1, 1, 2, 2, 2, 2, 0, 0]] * 2, jnp.int32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = scaled_dot_product_attention(q, k, v, is_causal=True, segment_ids=ids, implementation="cudnn")
    assert [str(w.message) for w in caught if w.category is KernelFallbackWarning] == [
        "cuDNN attention cannot take this call: segment ids of packed rows (jax.nn.dot_product_attention in this "
        "JAX takes none); running the reference (xla)"]
    expected = scaled_dot_product_attention(q, k, v, is_causal=True, segment_ids=ids, implementation="xla")
    np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("causal, window", [(True, (4, 0)), (False, None)], ids=["window", "full"])
def test_splash_takes_segment_ids_in_interpret_mode(causal, window):
    ids = jnp.asarray([[1] * 30 + [2] * 45 + [3] * 20 + [0] * 5, [1] * 60 + [2] * 40], jnp.int32)
    q, k, v = qkv(T=100, H=32, seed=3)
    kw = dict(is_causal=causal, local_window_size=window, segment_ids=ids)
    loss = lambda impl: lambda q, k, v: jnp.sum(  # noqa: E731
        scaled_dot_product_attention(q, k, v, implementation=impl, **kw) * v[:, :1, :1])
    with warnings.catch_warnings():
        warnings.simplefilter("error", KernelFallbackWarning)  # splash takes the call: no fallback
        out, expected, grads, expected_grads = jax.jit(lambda q, k, v: (
            scaled_dot_product_attention(q, k, v, implementation="splash", **kw), reference_attention(q, k, v, **kw),
            jax.grad(loss("splash"), (0, 1, 2))(q, k, v), jax.grad(loss("xla"), (0, 1, 2))(q, k, v)))(q, k, v)
    np.testing.assert_allclose(out, expected, atol=2e-6, rtol=2e-5)
    np.testing.assert_array_equal(out[0, 95:], 0.0)
    for g, g_expected in zip(grads, expected_grads):
        np.testing.assert_allclose(g, g_expected, atol=1e-5, rtol=1e-5)
