"""Cached extension equals full recomputation; cache pytrees, sizes and per-row writes."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.cache.containers import DecodeCache, LatentCache, write_rows
from jaxattn.cache.build import cache_bytes_per_token, init_cache
from jaxattn.kernels import Kernels, choices
from jaxattn.masks import visible_cache_slots
from jaxattn.model import DecoderLM
from tiny_models import FAST_KERNELS, KINDS, MAX_LEN, POSITIONS, T, VOCAB, params_for, tiny_config, tiny_kernels


def full(config, params, tokens, kernels=Kernels()):
    return DecoderLM(config, kernels).apply({"params": params}, tokens)


def extend(config, params, tokens, cache, num_new=None, kernels=Kernels()):
    return DecoderLM(config, kernels).apply({"params": params}, tokens, cache, num_new=num_new,
                                            method=DecoderLM.extend)


def random_tokens(shape, seed=0):
    return jax.random.randint(jax.random.PRNGKey(seed), shape, 0, VOCAB)


@pytest.mark.parametrize("positions", POSITIONS)
@pytest.mark.parametrize("kind", KINDS)
def test_prefill_then_steps_equal_the_full_forward(kind, positions):
    """Every kind and position scheme; the decode kernels alternate between the reference and XLA:CPU's."""
    config = tiny_config(kind, positions)
    decode = choices("decode")[(list(KINDS).index(kind) + POSITIONS.index(positions)) % 2]
    kernels = tiny_kernels(kind).replace(decode=decode)
    params = params_for(config)
    tokens = random_tokens((2, T))
    expected = full(config, params, tokens, kernels)  # causal: position t only sees tokens <= t
    prefill = 5
    logits, cache = extend(config, params, tokens[:, :prefill], init_cache(config, 2, MAX_LEN), kernels=kernels)
    np.testing.assert_allclose(logits, expected[:, :prefill], atol=2e-5, rtol=1e-5)
    for t in range(prefill, T):
        logits, cache = extend(config, params, tokens[:, t:t + 1], cache, kernels=kernels)
        chex.assert_shape(logits, (2, 1, VOCAB))
        np.testing.assert_allclose(logits[:, 0], expected[:, t], atol=2e-5, rtol=1e-5)
    np.testing.assert_array_equal(cache.lengths, [T, T])


@pytest.mark.parametrize("kind,batch", [("mha", 1), ("mla_absorb", 2)])
def test_cached_steps_equal_the_full_forward_with_bfloat16_matmuls(kind, batch):
    """Same bf16-rounded products on both paths; only float32 summation order differs,
    which can flip a bf16 rounding of an activation: hence 1e-2 rather than 2e-5.
    Batch 1 decode steps are matrix-vector products (XLA's own dot, not YNNPACK)."""
    config = tiny_config(kind, "rope")
    kernels = FAST_KERNELS.replace(mla=tiny_kernels(kind).mla)
    params = params_for(config)
    tokens = random_tokens((batch, T))
    # Jitted, as a run uses these kernels: three programs, where running eagerly compiles each operation.
    step = jax.jit(functools.partial(extend, config, kernels=kernels))
    expected = jax.jit(functools.partial(full, config, kernels=kernels))(params, tokens)
    logits, cache = step(params, tokens[:, :3], init_cache(config, batch, MAX_LEN))
    np.testing.assert_allclose(logits, expected[:, :3], atol=1e-2, rtol=0)
    for t in range(3, T):
        logits, cache = step(params, tokens[:, t:t + 1], cache)
        np.testing.assert_allclose(logits[:, 0], expected[:, t], atol=1e-2, rtol=0)


@pytest.mark.parametrize("positions", POSITIONS)
@pytest.mark.parametrize("kind", KINDS)
def test_right_padded_rows_match_their_unpadded_single_row_runs(kind, positions):
    config = tiny_config(kind, positions)
    kernels = tiny_kernels(kind).replace(decode=choices("decode")[POSITIONS.index(positions) % 2])
    params = params_for(config)
    sequences = random_tokens((2, T), seed=1)
    lengths = np.array([6, 3])  # prompt lengths; row 1 is right-padded with junk
    prompts = jnp.where(jnp.arange(6)[None, :] < lengths[:, None], sequences[:, :6], VOCAB - 1)
    logits, cache = extend(config, params, prompts, init_cache(config, 2, MAX_LEN),
                           num_new=jnp.asarray(lengths), kernels=kernels)
    np.testing.assert_array_equal(cache.lengths, lengths)
    # decode two more tokens of each row's own sequence, rows at different positions
    step_logits = []
    for step in range(2):
        next_tokens = sequences[jnp.arange(2), jnp.asarray(lengths) + step][:, None]
        out, cache = extend(config, params, next_tokens, cache, kernels=kernels)
        step_logits.append(out[:, 0])
    for row in range(2):
        n = int(lengths[row])
        alone = full(config, params, sequences[row:row + 1, :n + 2], kernels)[0]
        np.testing.assert_allclose(logits[row, :n], alone[:n], atol=2e-5, rtol=1e-5)
        for step in range(2):
            np.testing.assert_allclose(step_logits[step][row], alone[n + step], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_cache_bytes_per_token_match_the_arrays(kind):
    for dtype in ("float32", "bfloat16"):
        config = tiny_config(kind, dtype=dtype)
        B, L = 3, 7
        cache = init_cache(config, B, L)
        arrays = [x for layer in cache.layers for x in jax.tree_util.tree_leaves(layer)]
        size = cache_bytes_per_token(config)
        assert size["bytes"] == sum(x.nbytes for x in arrays) // (B * L)
        assert size["numbers"] == sum(x.size for x in arrays) // (B * L)
        assert size["bytes_per_layer"] * config.num_layers == size["bytes"]
        if config.attention == "mla":
            assert size["numbers_per_layer"] == config.mla.kv_lora_rank + config.mla.qk_rope_head_dim
        else:
            assert size["numbers_per_layer"] == 2 * config.num_kv_heads * config.head_dim


def test_init_cache_shapes_and_pytree():
    config = tiny_config("gqa", num_layers=3)
    cache = init_cache(config, 2, 10)
    assert isinstance(cache, DecodeCache) and len(cache.layers) == 3 and cache.max_len == 10
    chex.assert_shape([cache.layers[0].k, cache.layers[0].v], (2, 2, 10, 4))  # [B, K, L, H]: K heads, not N
    assert cache.lengths.dtype == jnp.int32
    leaves = jax.tree_util.tree_leaves(cache)
    assert len(leaves) == 3 * 2 + 1  # a pytree: jit/scan carry it
    mla = init_cache(tiny_config("mla_naive"), 2, 10, dtype=jnp.bfloat16)
    assert isinstance(mla.layers[0], LatentCache)
    chex.assert_shape([mla.layers[0].c_kv, mla.layers[0].k_rope], [(2, 10, 8), (2, 10, 4)])
    assert mla.layers[0].c_kv.dtype == jnp.bfloat16


@pytest.mark.parametrize("implementation", choices("decode"))
def test_write_rows_writes_each_row_at_its_own_start(implementation):
    buffer = jnp.zeros((2, 6, 1))
    update = jnp.ones((2, 2, 1)) * jnp.array([1.0, 2.0])[:, None, None]
    out = write_rows(buffer, update, jnp.array([0, 3]), implementation=implementation)
    np.testing.assert_array_equal(out[..., 0], [[1, 1, 0, 0, 0, 0], [0, 0, 0, 2, 2, 0]])


@pytest.mark.parametrize("implementation", choices("decode"))
def test_write_rows_along_the_slot_axis_of_a_heads_major_buffer(implementation):
    buffer = jnp.zeros((2, 3, 6, 1))  # [B, K, L, H]
    update = jnp.ones((2, 3, 2, 1)) * jnp.array([1.0, 2.0])[:, None, None, None]
    out = write_rows(buffer, update, jnp.array([1, 4]), axis=2, implementation=implementation)
    for head in range(3):
        np.testing.assert_array_equal(out[:, head, :, 0], [[0, 1, 1, 0, 0, 0], [0, 0, 0, 0, 2, 2]])


def test_visible_cache_slots_are_by_absolute_position():
    mask = visible_cache_slots(jnp.array([[2], [4]]), 6)
    chex.assert_shape(mask, (2, 1, 1, 6))
    np.testing.assert_array_equal(mask[:, 0, 0], [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0]])


def test_extend_inside_jit_returns_a_cache_of_the_same_structure():
    config = tiny_config("mqa", "rope")
    params = params_for(config)
    step = jax.jit(functools.partial(extend, config))
    cache = init_cache(config, 2, MAX_LEN)
    logits, new_cache = step(params, random_tokens((2, 1)), cache)
    assert jax.tree_util.tree_structure(new_cache) == jax.tree_util.tree_structure(cache)
    chex.assert_trees_all_equal_shapes_and_dtypes(new_cache, cache)
    np.testing.assert_array_equal(new_cache.lengths, [1, 1])


def test_extend_rejects_mismatched_caches():
    config = tiny_config("mha")
    params = params_for(config)
    tokens = random_tokens((2, 3))
    with pytest.raises(ValueError, match="KVCache layers"):
        extend(config, params, tokens, init_cache(tiny_config("mla_naive"), 2, MAX_LEN))
    with pytest.raises(ValueError, match="cache.lengths"):
        extend(config, params, tokens, init_cache(config, 3, MAX_LEN))
    with pytest.raises(ValueError, match="do not fit"):
        extend(config, params, random_tokens((2, 5)), init_cache(config, 2, 4))
    with pytest.raises(TypeError, match="DecodeCache"):
        extend(config, params, tokens, {"k": 1})
    with pytest.raises(ValueError, match="num_new"):
        extend(config, params, tokens, init_cache(config, 2, MAX_LEN), num_new=jnp.array([1]))
    with pytest.raises(ValueError, match="max_len must be a positive integer"):
        init_cache(config, 2, 0)


# --------------------------------------------------------------------------
# Preconditions of extend: checked when values are known, and under jit in checked mode.


def test_extend_refuses_what_would_give_wrong_logits():
    from jaxattn.decoding import _checked_extend_program, checked_extend
    config = tiny_config("gqa", "rope")
    params = params_for(config)
    full_cache = extend(config, params, random_tokens((2, 10)), init_cache(config, 2, MAX_LEN))[1]  # 10 of 12 slots
    cases = [
        (dict(tokens=random_tokens((2, 3)), cache=full_cache), "cannot take 3 more"),  # 10 + 3 > 12
        (dict(tokens=random_tokens((2, 2)), cache=init_cache(config, 2, MAX_LEN), num_new=jnp.array([3, 1])),
         r"num_new must be in \[0, T=2\]"),
        (dict(tokens=random_tokens((2, 2)), cache=init_cache(config, 2, MAX_LEN), num_new=jnp.array([1, -1])),
         r"num_new must be in \[0, T=2\]"),
        (dict(tokens=jnp.full((2, 2), VOCAB), cache=init_cache(config, 2, MAX_LEN)),
         r"token ids must be in \[0, vocab_size=13\)"),
    ]
    model = DecoderLM(config)
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):  # eager: the values are known
            extend(config, params, kwargs["tokens"], kwargs["cache"], kwargs.get("num_new"))
        with pytest.raises(ValueError, match=message):  # under jit, checked on the device
            checked_extend(model, params, kwargs["tokens"], kwargs["cache"], num_new=kwargs.get("num_new"))
    tokens = random_tokens((2, 2))  # valid input: the checked mode returns extend's results
    logits, cache = checked_extend(model, params, tokens, full_cache)
    expected, expected_cache = extend(config, params, tokens, full_cache)
    np.testing.assert_allclose(logits, expected, atol=1e-6)
    np.testing.assert_array_equal(cache.lengths, [12, 12])
    # Equal models share one jitted program: a call retraces for new shapes only, not on every call.
    assert _checked_extend_program(DecoderLM(config)) is _checked_extend_program(model)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, vocab_size=13\)"):
        full(config, params, jnp.full((1, 3), -1))


def test_what_the_library_writes_into_a_cache_is_finite():
    """Attention needs masked values to be finite (0 * NaN is NaN): padding written by a padded
    prefill and slots never written must hold finite numbers."""
    config = tiny_config("gqa", "rope")
    prompts = jnp.where(jnp.arange(6)[None, :] < jnp.array([[6], [2]]), random_tokens((2, 6)), VOCAB - 1)
    _, cache = extend(config, params_for(config), prompts, init_cache(config, 2, MAX_LEN), num_new=jnp.array([6, 2]))
    assert all(bool(jnp.isfinite(x).all()) for x in jax.tree_util.tree_leaves(cache))
