"""The int8 KV cache (`jaxattn.cache.int8`): int8 values and a float32 scale per token and head
(per token for MLA's latent and rotary key), in the dense cache and in the engine's pages.

* a number read back is off by at most half its vector's scale, through every write and gather;
* what a token costs counts values and scales, and is what the pools allocate: about four times
  float32's pages fit the same memory;
* greedy tokens equal float32's for 32 tokens on the baby model, and on MLA;
* the engine's int8 pages give `generate`'s int8 tokens under a schedule with prefix sharing, with
  every paged kernel;
* the paged kernels on int8 pools equal the dense attention on the dequantized cache.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn as ja
from jaxattn import sharding
from jaxattn.axes import MeshShape
from jaxattn.cache.containers import CacheField, gather_pages, write_pages, write_rows
from jaxattn.cache.build import cache_bytes_per_token, init_cache, init_pools
from jaxattn.cache.int8 import QuantizedTokens, dequantize, is_quantized, quantize
from jaxattn.serving import Engine, EngineConfig
from tests.kernels.test_paged_attention import _cached, close, dense, gathered, inputs, ragged
from tests.serving.test_serving import CONTEXT, ENGINE, MAX_NEW, MODELS, draw_requests, model, run_schedule
from tiny_models import drawn_params
from train.config import load_config

BABY = load_config("shakespeare_char_baby").model  # 4 layers, 4 heads of head_dim 32
BABY_MLA = load_config("shakespeare_char_baby_mla").model


def nbytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def test_a_number_read_back_is_off_by_at_most_half_its_scale():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 5, 2, 32)) * np.exp(rng.normal(0, 3, (3, 5, 2, 1)))  # magnitudes 1e-4 .. 1e4
    x[0, 0, 1] = 0.0  # a vector of zeros
    q = quantize(jnp.asarray(x, jnp.float32))
    assert q.values.dtype == jnp.int8 and q.scales.dtype == jnp.float32 and q.scales.shape == (3, 5, 2)
    scales = np.asarray(q.scales)
    np.testing.assert_allclose(scales, np.abs(x).max(-1) / 127, rtol=1e-6)
    error = np.abs(np.asarray(dequantize(q)) - x.astype(np.float32))
    assert np.all(error <= scales[..., None] / 2 * (1 + 1e-5))
    top = np.abs(np.asarray(q.values)).max(-1)
    assert top[0, 0, 1] == 0 and scales[0, 0, 1] == 0 and np.all(np.delete(top.ravel(), 1) == 127)


round_trip = jax.jit(lambda x: dequantize(quantize(x)))  # what a float array reads back as
round_trip_of = jax.jit(dequantize)  # what a written cache reads back as


@functools.partial(jax.jit, static_argnames="implementation")
def written_and_gathered(update, tokens, *, implementation):
    """Dense rows of `update [B=2, T=3, K, H]` written at slots 0 and 2 of 6, and `tokens [5, K, H]` to
    slots 3, 0, 7, 8 (past the pool: padding), 4 of 4 pages of 2, gathered by the table [[1, 0], [3, 2]]."""
    field = CacheField(shape=update.shape[2:], axes=(None, None), slot_axis=1)  # [K, H] heads-major, as keys
    empty = QuantizedTokens(jnp.zeros(field.dense_shape(2, 6), jnp.int8),
                            jnp.zeros(field.scale_field().dense_shape(2, 6)))
    dense_cache = write_rows(empty, field.to_dense(update), jnp.array([0, 2]), axis=2, implementation=implementation)
    pool = QuantizedTokens(jnp.zeros((4, 2, *tokens.shape[1:]), jnp.int8), jnp.zeros((4, 2, tokens.shape[1])))
    pool = write_pages(pool, tokens, jnp.array([3, 0, 7, 8, 4]))
    return dense_cache, gather_pages(pool, jnp.array([[1, 0], [3, 2]]))


@pytest.mark.parametrize("implementation", ["xla", "xla_cpu"])
def test_writes_and_gathers_keep_values_and_scales_together(implementation):
    """Each written token reads back as itself quantized, at its slot; the rest stays 0."""
    rng = np.random.default_rng(1)
    update = jnp.asarray(rng.standard_normal((2, 3, 2, 8)), jnp.float32)  # [B, T, K, H]
    tokens = jnp.asarray(rng.standard_normal((5, 2, 8)), jnp.float32)  # [Tf, K, H]
    buffer, rows = written_and_gathered(update, tokens, implementation=implementation)
    assert is_quantized(buffer) and buffer.values.shape == (2, 2, 6, 8) and buffer.scales.shape == (2, 2, 6)
    expected = np.zeros((2, 6, 2, 8), np.float32)  # tokens first
    expected[0, 0:3], expected[1, 2:5] = round_trip(update)
    np.testing.assert_array_equal(round_trip_of(buffer), expected.transpose(0, 2, 1, 3))
    assert is_quantized(rows) and rows.values.shape == (2, 4, 2, 8) and rows.scales.shape == (2, 4, 2)
    want = np.zeros((8, 2, 8), np.float32)  # the pool's slots in order
    want[[3, 0, 7, 4]] = np.asarray(round_trip(tokens))[[0, 1, 2, 4]]
    np.testing.assert_array_equal(round_trip_of(rows), want[[2, 3, 0, 1, 6, 7, 4, 5]].reshape(2, 4, 2, 8))


def test_a_token_costs_its_values_and_scales_so_about_four_times_the_pages_fit():
    """Standard attention: 2*K*H + 2*K*4 bytes a layer against float32's 2*K*H*4 (H = 32: 3.56x);
    MLA: R + E + 2*4. The pools and the dense cache allocate exactly what is counted."""
    K, H, L = BABY.num_kv_heads, BABY.head_dim, BABY.num_layers
    f32, int8 = (cache_bytes_per_token(BABY, dtype)["bytes"] for dtype in (jnp.float32, "int8"))
    assert f32 == L * 2 * K * H * 4 and int8 == L * (2 * K * H + 2 * K * 4)
    assert f32 / int8 >= 3.5
    m = BABY_MLA.mla
    assert cache_bytes_per_token(BABY_MLA, "int8")["bytes"] == BABY_MLA.num_layers * (
        m.kv_lora_rank + m.qk_rope_head_dim + 2 * 4)
    pool = init_pools(BABY, 3, 4, "int8")[0].k
    assert is_quantized(pool) and pool.values.shape == (3, 4, K, H) and pool.scales.shape == (3, 4, K)
    for config in (BABY, BABY_MLA):
        for dtype in (jnp.float32, "int8"):
            token = cache_bytes_per_token(config, dtype)["bytes"]
            assert nbytes(init_pools(config, 3, 4, dtype)) == 3 * 4 * token
            assert nbytes(init_cache(config, 2, 5, dtype).layers) == 2 * 5 * token
    # A memory budget: the engine's page count from it (`EngineConfig.kv_memory_gib`), float32 and int8.
    budget, page_size = 2 ** 30, 16
    pages = {dtype: budget // (page_size * cache_bytes_per_token(BABY, dtype)["bytes"])
             for dtype in (jnp.float32, "int8")}
    assert pages["int8"] >= 3.5 * pages[jnp.float32]


def test_greedy_tokens_equal_float32_s_for_32_tokens_on_the_baby_model():
    """At the model's own initialisation scale, three prompts of different lengths (padding in the
    prefill): the same 32 greedy tokens, every logit within 5% of the logits' spread of float32's,
    and not bit-equal (int8 ran)."""
    params = drawn_params(BABY, seed=0, std=0.02)
    rng = np.random.default_rng(2)
    lengths = np.array([5, 16, 11])
    prompts = rng.integers(0, BABY.vocab_size, (3, 16)).astype(np.int32)
    outs = {kv: ja.generate(params, BABY, prompts, lengths, max_new_tokens=32, rng=jax.random.PRNGKey(0),
                            temperature=0.0, return_logits=True, kv_cache=kv) for kv in ("auto", "int8")}
    full, int8 = outs["auto"], outs["int8"]
    np.testing.assert_array_equal(int8.tokens, full.tokens)
    difference = float(jnp.max(jnp.abs(int8.logits - full.logits)))
    assert 0 < difference < 0.05 * float(jnp.std(full.logits)), difference


# ------------------------------------------------------------------------ the engine's int8 pages


# A tiny model with head_dim 32 (so scales cost what they cost at real sizes) and one of MLA.
ENGINE_MODELS = {"gqa32": dict(d_model=64, num_heads=2, num_kv_heads=1), "mla": MODELS["mla"]}
# test_serving's engine with one decode shape and one prefill shape: three step programs to compile.
SMALL_ENGINE = dataclasses.replace(ENGINE, decode_buckets=(ENGINE.max_seqs,), short_chunk=0)


@functools.lru_cache(maxsize=None)
def engine_model(name):
    config, _, kernels = model("mha")
    config = config.replace(**ENGINE_MODELS[name])
    return config, drawn_params(config, seed=3, std=0.2), kernels.replace(mla="absorb" if name == "mla" else "naive")


@functools.lru_cache(maxsize=None)
def expected(name, prompt: tuple, kv_cache: str = "int8"):
    """`generate`'s greedy tokens (one row, `MAX_NEW` of them) and their logits on the prompt alone."""
    config, params, kernels = engine_model(name)
    return ja.generate(params, config, np.array([prompt]), np.array([len(prompt)]), max_new_tokens=MAX_NEW,
                       rng=jax.random.PRNGKey(0), temperature=0.0, kernels=kernels, kv_cache=kv_cache,
                       return_logits=True)


def test_mla_s_latent_in_int8_gives_float32_s_greedy_tokens():
    """MLA's latent and rotary key, a scale per token each, in the dense cache."""
    prompt = (3, 1, 4, 1, 5, 9, 2, 6)
    int8, full = (expected("mla", prompt, kv) for kv in ("int8", "auto"))
    np.testing.assert_array_equal(int8.tokens, full.tokens)
    difference = float(jnp.max(jnp.abs(int8.logits - full.logits)))
    assert 0 < difference < 0.05 * float(jnp.std(full.logits)), difference


@pytest.mark.parametrize("name, paged", [("gqa32", "gather"), ("gqa32", "ragged_cpu"), ("mla", "ragged")])
def test_int8_pages_give_generate_s_tokens_with_four_times_the_pages(name, paged):
    """An engine sized by a memory budget: int8 holds the pages the formula says (3.5x float32's and
    more), allocates no more than the budget, and under a schedule with prefix hits on a pool that
    reuses its pages draws `generate`'s greedy tokens on the dense int8 cache. "ragged_cpu" sends int8 pools to the
    XLA loop (the native one is float32 only)."""
    config, params, kernels = engine_model(name)
    token = {kv: cache_bytes_per_token(config, kv)["bytes"] for kv in ("auto", "int8")}
    page_size = SMALL_ENGINE.page_size
    pages_per_seq = -(-CONTEXT // page_size)
    budget = (pages_per_seq + 1) * page_size * token["int8"]  # one whole sequence and a page
    ec = dataclasses.replace(SMALL_ENGINE, num_pages=None, kv_memory_gib=budget / 2 ** 30, kv_cache="int8")
    engine = Engine(params, config, ec, kernels=kernels.replace(paged=paged))
    assert engine.allocator.num_pages == pages_per_seq + 1
    assert nbytes(engine.pools) == engine.memory()["pool_bytes"] <= budget
    if name == "gqa32":
        assert engine.allocator.num_pages >= 3.5 * (budget // (page_size * token["auto"]))
    prompts, max_tokens, rng = draw_requests(5)
    for request, i in run_schedule(engine, prompts, max_tokens, rng, cancel_rate=0.0):
        assert request.output_ids == expected(name, prompts[i]).tokens[0, :max_tokens[i]].tolist(), (i, request)
    engine.allocator.check_all_free()
    assert engine.stats["prefix_hit_tokens"] > 0, dict(engine.stats)  # int8 pages shared by a later prompt


# ------------------------------------------------------------------------ the paged kernels on int8 pools


@pytest.mark.parametrize("case", ["gqa-window-cap-sinks", "mla-window-cap-sinks"])
def test_paged_kernels_on_int8_pools_equal_dense_attention_on_the_dequantized_cache(case):
    """Both kernels dequantize as they gather; the dense reference attends to the same numbers as float."""
    args, kwargs = inputs(case)
    queries, key_pages, value_pages = args[:3]
    quantized = tuple(quantize(k) for k in key_pages)
    values = quantized[0] if len(key_pages) == 2 else quantize(value_pages)  # MLA: the latent is the value
    int8_args = (queries, quantized, values, *args[3:])
    floats = [dequantize(k) for k in quantized]
    expected = _cached(jnp.concatenate(queries, -1), dense(jnp.concatenate(floats, -1)), dense(dequantize(values)),
                       args[4], implementation="xla", **kwargs)
    close(ragged(int8_args, kwargs), expected)
    close(gathered(int8_args, kwargs), expected)


# ------------------------------------------------------------------------ refusals


@pytest.mark.parametrize("call, message", [
    (lambda: init_cache(BABY, 1, 4, dtype="int4"), "cache dtype must be 'auto', a float dtype or 'int8'.*'int4'"),
    (lambda: init_pools(BABY, 2, 4, dtype=jnp.int32), "cache dtype .*int32"),
    (lambda: cache_bytes_per_token(BABY, "fp8"), "cache dtype .*'fp8'"),
    (lambda: EngineConfig(kv_cache="int4"), r"EngineConfig.kv_cache must be one of \('auto', 'int8'\), got 'int4'"),
    (lambda: ja.generate({}, BABY, np.zeros((1, 2), np.int32), np.array([2]), max_new_tokens=1,
                         rng=jax.random.PRNGKey(0), kv_cache="float8"), "kv_cache must be one of .*'float8'"),
], ids=["init_cache", "init_pools", "bytes", "engine", "generate"])
def test_an_unknown_cache_dtype_is_one_value_error_naming_it(call, message):
    with pytest.raises(ValueError, match=message):
        call()



def test_on_a_mesh_the_scales_are_split_as_their_values():
    """`jaxattn.sharding`'s specs of an int8 cache: rows over data, kv heads over tensor, for the values
    and their scales alike (a tree that matches the cache's); MLA's latent stays whole."""
    P = jax.sharding.PartitionSpec
    cache = init_cache(BABY, 4, 8, "int8")
    specs = sharding.cache_specs(cache, BABY, MeshShape(data=2, tensor=2))
    assert jax.tree.structure(specs, is_leaf=lambda x: isinstance(x, P)) == jax.tree.structure(cache)
    assert specs.layers[0].k == QuantizedTokens(P("data", "tensor", None, None), P("data", "tensor", None))
    pools = sharding.pool_specs(init_pools(BABY_MLA, 4, 2, "int8"), BABY_MLA, MeshShape(tensor=2))
    assert pools[0].c_kv == QuantizedTokens(P(None, None, None), P(None, None))
