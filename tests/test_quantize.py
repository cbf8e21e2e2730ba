"""Weight-only quantization (`jaxattn.quantization`) and its matmuls behind `Kernels.quantized`.

The int8 and int4 round trips stay within half a scale per weight; the native loop equals the
reference (dequantize, then a float32 dot) to float32 summation order; a quantized tiny model runs
under jit, in `generate`'s scan and in the serving engine, close to its float32 self.
"""

import os
import platform
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn as ja
from jaxattn import decoding, quantization
from jaxattn.kernels import (IMPLEMENTATIONS, Kernels, Platform, call_kernels, choices, default_kernels,
                             native_build, quant_matmul, resolve_kernels)
from jaxattn.quantization import QuantizedWeight, dequantize, quantize, quantize_weight, unpack
from jaxattn.serving import Engine, EngineConfig, SamplingParams
from tiny_models import drawn_params, tiny_config

HAS_CXX = native_build.compiler() is not None
needs_cxx = pytest.mark.skipif(not HAS_CXX, reason="no C++ compiler for the native kernel")
MODES = ("int8", "int8:channel", "int4", "int4:64", "int4:asym")


def weight(K, N, seed=0):
    return np.random.default_rng(seed).normal(size=(K, N)).astype(np.float32)


@pytest.mark.parametrize("mode", MODES)
def test_round_trip_is_within_half_a_scale(mode):
    w = weight(128, 40)
    q = quantize_weight(w, mode)
    bits, group = quantization.parse_mode(mode)
    group = group or 128
    assert (q.bits, q.group, q.shape, q.values.dtype, q.scales.dtype) == (
        bits, group, (128, 40), jnp.int8 if bits == 8 else jnp.int32, jnp.float32)
    assert q.values.shape == ((128, 40) if bits == 8 else (16, 40)) and q.scales.shape == (128 // group, 40)
    err = np.abs(np.asarray(dequantize(q)) - w).reshape(128 // group, group, 40)
    scale = np.abs(np.asarray(q.scales))[:, None, :]
    if mode.endswith("asym"):  # the scale rounded to float16: the largest value up to 15 * 2**-11 scales below
        bound = scale * (0.5 + 15 * 2.0**-11)
    elif bits == 4:  # Q4_0's rule: the extreme at -8, so a value of the other sign past 7.5 scales is clipped to 7
        bound = np.maximum(scale / 2, np.abs(w).reshape(err.shape) - 7 * scale)
    else:
        bound = scale / 2
    assert (err <= bound * (1 + 1e-6)).all()
    values = np.asarray(unpack(q))
    assert values.min() >= (-127 if bits == 8 else -8) and values.max() <= (127 if bits == 8 else 7)
    if mode.endswith("asym"):  # each group's minimum at nibble 0 (value -8), its maximum at 15 (value 7)
        grouped = values.reshape(128 // group, group, 40)
        assert (grouped.min(axis=1) == -8).all() and (grouped.max(axis=1) == 7).all()
    else:  # the largest magnitude uses the full range: +-127, or -8 (Q4_0's rule)
        assert (np.abs(values).max(axis=0) == (127 if bits == 8 else 8)).all()


def test_int8_is_in_groups_of_32_as_q8_0_and_per_channel_is_named_so():
    assert quantization.parse_mode("int8") == quantization.parse_mode("int8:32") == (8, 32)
    assert quantization.parse_mode("int8:channel") == (8, None)
    w = weight(96, 24)
    grouped, synonym, per_channel = (quantize_weight(w, mode) for mode in ("int8", "int8:32", "int8:channel"))
    assert (grouped.group, grouped.scales.shape, per_channel.group, per_channel.scales.shape) == (32, (3, 24), 96,
                                                                                                   (1, 24))
    np.testing.assert_array_equal(grouped.values, synonym.values)
    np.testing.assert_array_equal(grouped.scales, synonym.scales)


def test_an_all_zero_column_stays_zero():
    w = weight(64, 3)
    w[:, 1] = 0.0
    for mode in MODES:
        assert np.all(np.asarray(dequantize(quantize_weight(w, mode)))[:, 1] == 0.0)


def test_refusals_name_the_mode_or_the_parameter():
    config = tiny_config("gqa", positions="rope", d_model=16, mlp_hidden=48)
    params = drawn_params(config)
    with pytest.raises(ValueError, match=r"mode must be one of .*got 'int3'"):
        quantize(params, config, "int3")
    with pytest.raises(ValueError, match=r"blocks_0/attn/\w+/kernel: int4 quantizes in groups of 32 input rows: "
                                         r"the in-dimension 16 is not a multiple"):
        quantize(params, config, "int4")
    with pytest.raises(ValueError, match=r"int8 quantizes in groups of 32 input rows: the in-dimension 16"):
        quantize(params, config, "int8")  # groups of 32 by default, as llama.cpp's Q8_0
    assert quantize(params, config, "int8:channel")["blocks_0"]["mlp"]["c_fc"]["kernel"].group == 16
    with pytest.raises(TypeError, match="ModelConfig"):
        quantize(params, {"d_model": 16}, "int8")
    assert "native_cpu" in choices("quantized") and Kernels().quantized == "xla"


def tiny(**changes):
    config = tiny_config("gqa", positions="rope", d_model=64, mlp_hidden=128, num_heads=4, norm="rmsnorm",
                         mlp="swiglu", vocab_size=32, max_seq_len=24, **changes)
    return config, drawn_params(config, seed=1, std=0.05)


def test_every_linear_kernel_and_only_those_are_quantized():
    config, params = tiny(tie_embeddings=False)
    q = quantize(params, config, "int8")
    flat = jax.tree_util.tree_flatten_with_path(q, is_leaf=lambda x: isinstance(x, QuantizedWeight))[0]
    names = {"/".join(str(k.key) for k in path): type(leaf) for path, leaf in flat}
    quantized = {n for n, t in names.items() if t is QuantizedWeight}
    assert quantized and all(n.endswith("/kernel") for n in quantized)
    assert {n for n in names if n.endswith("/kernel")} == quantized
    assert any("lm_head" in n for n in quantized)  # the untied head
    assert any("embed" in n or "wte" in n for n in names if n not in quantized)  # embeddings stay float


@pytest.mark.parametrize("mode, tolerance", [("int8", 0.03), ("int8:channel", 0.03), ("int4", 0.3)])
def test_a_quantized_model_is_close_to_float32_under_jit(mode, tolerance):
    config, params = tiny()
    q = quantize(params, config, mode)
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 32, (2, 10)))
    model = ja.DecoderLM(config)
    apply = jax.jit(lambda p, t: model.apply({"params": p}, t))
    reference, logits = apply(params, tokens), apply(q, tokens)
    scale = float(jnp.max(jnp.abs(reference)))
    assert float(jnp.max(jnp.abs(logits - reference))) <= tolerance * scale
    # The quantized model is the float model with the dequantized weights, exactly so to rounding.
    back = jax.tree_util.tree_map(lambda x: dequantize(x) if isinstance(x, QuantizedWeight) else x, q,
                                  is_leaf=lambda x: isinstance(x, QuantizedWeight))
    np.testing.assert_allclose(logits, apply(back, tokens), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernels", [Kernels(), pytest.param(Kernels(quantized="native_cpu"), marks=needs_cxx)],
                         ids=["xla", "native_cpu"])
def test_greedy_generate_with_int8_weights_equals_float32(kernels):
    config, params = tiny()
    prompt = np.array([[3, 1, 4, 1, 5, 9], [2, 7, 1, 8, 0, 0]])
    lengths = np.array([6, 4])
    run = dict(max_new_tokens=6, rng=jax.random.PRNGKey(0), temperature=0.0, return_logits=True)
    expected = ja.generate(params, config, prompt, lengths, **run)
    got = ja.generate(quantize(params, config, "int8"), config, prompt, lengths, kernels=kernels, **run)
    np.testing.assert_array_equal(got.tokens, expected.tokens)
    scale = float(jnp.max(jnp.abs(expected.logits)))
    assert float(jnp.max(jnp.abs(got.logits - expected.logits))) <= 0.03 * scale


def native_here() -> str:
    """What "auto" makes `Kernels.quantized` on this machine (a native loop on a CPU with a C++ compiler)."""
    return resolve_kernels(Kernels.auto())[0].quantized


@needs_cxx
def test_the_serving_engine_steps_with_quantized_weights_on_the_native_path_unasked():
    config, params = tiny()
    q = quantize(params, config, "int8")
    engine_config = EngineConfig(max_seqs=2, page_size=4, chunk=8, prefill_rows=2, num_pages=12)
    prompts = [[3, 1, 4, 1, 5], [2, 7, 1]]
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    reference = Engine(q, config, engine_config, kernels=Kernels())
    unasked = Engine(q, config, engine_config)
    native = native_here()
    assert native.startswith("native_cpu") and unasked.kernels == Kernels(quantized=native)
    assert reference.kernels == Kernels()
    for engine in (reference, unasked):  # each engine's tokens are generate's with the same kernels
        direct = [ja.generate(q, config, np.array([p]), np.array([len(p)]), max_new_tokens=4, temperature=0.0,
                              rng=jax.random.PRNGKey(0), kernels=engine.kernels).tokens[0].tolist() for p in prompts]
        assert engine.generate(prompts, greedy) == direct


def test_unasked_kernels_are_the_reference_but_for_a_quantized_models_matmuls_by_the_platforms_rule():
    config, params = tiny()
    q = quantize(params, config, "int4")
    vnni = Platform("cpu", frozenset({"avx512_vnni"}), cxx=True)
    assert default_kernels(q, vnni) == Kernels(quantized="native_cpu_q8act")
    assert default_kernels(q, Platform("cpu", cxx=True)) == Kernels(quantized="native_cpu")
    assert default_kernels(q, Platform("cpu")) == default_kernels(q, Platform("gpu")) == Kernels()  # no native loop
    assert default_kernels(params, vnni) == Kernels()  # float weights: the reference throughout
    kernels, same = call_kernels(q, None, on_mesh=True)  # on a mesh: the reference, the weights as given
    assert kernels == Kernels() and same is q
    asked = Kernels(quantized="native_cpu_q8act")
    assert call_kernels(q, asked)[0] is asked and call_kernels(q, asked)[1] is q  # asked for: nothing moves


@needs_cxx
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_generate_runs_a_quantized_model_on_the_native_path_unasked(mode, monkeypatch):
    config, params = tiny()
    q = quantize(params, config, mode)
    native = native_here()
    assert native.startswith("native_cpu") and default_kernels(q) == Kernels(quantized=native)
    kernels, prepared = call_kernels(q, None)
    assert kernels == Kernels(quantized=native)  # and the weights laid out for it (the layouts are in the treedef)
    assert jax.tree.structure(prepared) == jax.tree.structure(ja.prepare_weights(q, kernels))
    # Float weights: exactly the reference and the params as given, so the same programs as before.
    assert default_kernels(params) == Kernels() and call_kernels(params, None)[1] is params
    ran = []  # a spy on every quantized kernel: which one each freshly traced program calls
    for name in choices("quantized"):
        monkeypatch.setitem(IMPLEMENTATIONS["quantized"], name, lambda x, w, name=name, kernel=(
            IMPLEMENTATIONS["quantized"][name]): (ran.append(name), kernel(x, w))[1])
    prompt, lengths = np.array([[3, 1, 4, 1, 5, 9], [2, 7, 1, 8, 0, 0]]), np.array([6, 4])
    run = dict(max_new_tokens=5, rng=jax.random.PRNGKey(0), temperature=0.0, return_logits=True)
    outputs = {}
    try:
        for what, asked in (("unasked", None), ("asked", Kernels(quantized=native)), ("reference", Kernels())):
            decoding._generate_cached.clear_cache()  # traced anew: the spies see it
            ran.clear()
            outputs[what] = ja.generate(q, config, prompt, lengths, kernels=asked, **run)
            assert set(ran) == {"xla" if what == "reference" else native}, what
    finally:
        decoding._generate_cached.clear_cache()  # no program holding a spy outlives the test
    np.testing.assert_array_equal(outputs["unasked"].tokens, outputs["asked"].tokens)
    np.testing.assert_allclose(outputs["unasked"].logits, outputs["asked"].logits, rtol=1e-5, atol=1e-5)
    scale = float(jnp.max(jnp.abs(outputs["reference"].logits)))
    assert float(jnp.max(jnp.abs(outputs["unasked"].logits - outputs["reference"].logits))) <= 0.03 * scale


@needs_cxx
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("M", [1, 3, 8])
@pytest.mark.parametrize("K, N", [(64, 17), (192, 72), (128, 531)])
def test_native_equals_the_reference(mode, M, K, N):
    q = quantize_weight(weight(K, N, seed=K + N), mode)
    x = np.random.default_rng(M).normal(size=(M, K)).astype(np.float32)
    expected = quant_matmul.matmul(x, q)
    got = jax.jit(quant_matmul.native_matmul)(x, q)
    assert got.shape == (M, N) and got.dtype == jnp.float32
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(expected))))


@needs_cxx
def test_native_cpu_goes_native_up_to_its_rows_and_to_the_reference_beyond():
    q = quantize_weight(weight(64, 24), "int8")
    rows = quant_matmul.NATIVE_UP_TO
    x = np.random.default_rng(0).normal(size=(rows + 1, 64)).astype(np.float32)
    assert "jaxattn_quant_matmul" in jax.jit(quant_matmul.matmul_cpu).lower(x[:rows], q).as_text()
    assert "jaxattn_quant_matmul" not in jax.jit(quant_matmul.matmul_cpu).lower(x, q).as_text()
    np.testing.assert_allclose(quant_matmul.matmul_cpu(x, q), quant_matmul.matmul(x, q), rtol=1e-5, atol=1e-5)


def test_a_missing_compiler_names_the_way_out(monkeypatch):
    monkeypatch.setattr(native_build, "compiler", lambda: None)
    with pytest.raises(native_build.NativeBuildError, match=r"native_cpu' needs a C\+\+ compiler.*quantized='xla'"):
        quant_matmul.library_path()


@needs_cxx
@pytest.mark.parametrize("mode", ["int4", "int4:64"])
def test_int4_generate_native_equals_the_reference(mode):
    config, params = tiny()
    q = quantize(params, config, mode)
    prompt, lengths = np.array([[3, 1, 4, 1, 5, 9], [2, 7, 1, 8, 0, 0]]), np.array([6, 4])
    run = dict(max_new_tokens=5, rng=jax.random.PRNGKey(0), temperature=0.0, return_logits=True)
    expected = ja.generate(q, config, prompt, lengths, kernels=Kernels(), **run)
    got = ja.generate(q, config, prompt, lengths, kernels=Kernels(quantized="native_cpu"), **run)
    np.testing.assert_array_equal(got.tokens, expected.tokens)
    np.testing.assert_allclose(got.logits, expected.logits, rtol=1e-4, atol=1e-4)


def test_mla_projections_are_quantized_and_decode():
    config = tiny_config("mla_absorb", positions="rope", d_model=32, mlp_hidden=64, vocab_size=32, max_seq_len=16)
    params = drawn_params(config, seed=4, std=0.05)
    q = quantize(params, config, "int8:channel")  # the latent's rank (8) is no multiple of 32
    leaves = jax.tree_util.tree_leaves(q["blocks_0"]["attn"], is_leaf=lambda x: isinstance(x, QuantizedWeight))
    assert sum(isinstance(x, QuantizedWeight) for x in leaves) == 5  # wq_a, wq_b, wkv_a, wo and wkv_b
    R, N, PV = params["blocks_0"]["attn"]["wkv_b"].shape
    assert q["blocks_0"]["attn"]["wkv_b"].shape == (R, N * PV)  # the [R, N(P + V)] matmul
    kernels = Kernels(mla="absorb", quantized="native_cpu" if HAS_CXX else "xla")
    prompt, lengths = np.array([[3, 1, 4, 1]]), np.array([4])
    run = dict(max_new_tokens=4, rng=jax.random.PRNGKey(0), temperature=0.0, return_logits=True)
    expected = ja.generate(params, config, prompt, lengths, kernels=Kernels(mla="absorb"), **run)
    got = ja.generate(q, config, prompt, lengths, kernels=kernels, **run)
    scale = float(jnp.max(jnp.abs(expected.logits)))
    assert float(jnp.max(jnp.abs(got.logits - expected.logits))) <= 0.03 * scale


def test_int4_words_hold_eight_rows_of_a_column_as_unsigned_nibbles():
    values = np.arange(-8, 8).reshape(16, 1).repeat(2, axis=1)  # rows -8 .. 7, two columns
    values[:, 1] = values[::-1, 1]
    words = np.asarray(quantization.pack_int4(jnp.asarray(values))).view(np.uint32)
    assert words.shape == (2, 2)
    for t in range(2):
        for j in range(2):
            assert [(int(words[t, j]) >> (4 * i)) & 15 for i in range(8)] == list(values[8 * t:8 * t + 8, j] + 8)
    w = QuantizedWeight(quantization.pack_int4(jnp.asarray(values)), jnp.ones((1, 2)), bits=4, group=16)
    np.testing.assert_array_equal(unpack(w), values)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_weight_with_leading_axes_is_quantized_slice_by_slice(mode):
    w = np.random.default_rng(3).normal(size=(2, 3, 64, 24)).astype(np.float32)  # e.g. [layers, experts, in, out]
    q = quantize_weight(w, mode)
    assert q.shape == (2, 3, 64, 24) and q.values.shape[:2] == q.scales.shape[:2] == (2, 3)
    for i in range(2):
        for e in range(3):
            one = quantize_weight(w[i, e], mode)
            np.testing.assert_array_equal(q.values[i, e], one.values)
            np.testing.assert_array_equal(q.scales[i, e], one.scales)
    np.testing.assert_array_equal(dequantize(q)[1, 2], dequantize(quantize_weight(w[1, 2], mode)))
    # Stacked layers' kernels (a scan's parameters) keep their leading axis.
    config, params = tiny()
    stacked = {"params": {**params, "blocks": {"mlp": {"kernel": w[0]}}}}
    assert quantize(stacked, config, mode)["params"]["blocks"]["mlp"]["kernel"].values.shape[0] == 3


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_tied_head_is_quantized_beside_the_float_table(mode):
    config, params = tiny()
    assert config.tie_embeddings
    q = quantize(params, config, mode)
    np.testing.assert_array_equal(q["wte"]["embedding"], params["wte"]["embedding"])  # the lookup stays float
    head = q[quantization.TIED_HEAD]
    assert isinstance(head, QuantizedWeight) and head.shape == (64, 32)
    np.testing.assert_array_equal(head.values, quantize_weight(params["wte"]["embedding"].T, mode).values)
    tokens = jnp.asarray(np.random.default_rng(5).integers(0, 32, (1, 7)))
    model = ja.DecoderLM(config)
    logits = model.apply({"params": q}, tokens)
    by_hand = dict(q)
    by_hand[quantization.TIED_HEAD] = dequantize(head)  # the head as float: the same logits to rounding
    np.testing.assert_allclose(logits, model.apply({"params": by_hand}, tokens), rtol=1e-5, atol=1e-5)
    float_head = dict(q)
    del float_head[quantization.TIED_HEAD]
    assert float(jnp.max(jnp.abs(logits - model.apply({"params": float_head}, tokens)))) > 0  # the head was used


@pytest.mark.parametrize("layout", ["rows", "panels"])
@pytest.mark.parametrize("mode", ["int8:32", "int4:asym"])
def test_a_tied_head_without_its_float_table_is_the_lookup_table(mode, layout):
    """`drop_tied_table`: tokens are looked up in the quantized head's columns, the numbers the table would
    hold were it the head dequantized (a GGUF file's quantized embedding kept once)."""
    config, params = tiny()
    q = quantization.with_layout(quantize(params, config, mode), layout, fits=lambda w: w.shape[-1] % 16 == 0)
    head = q[quantization.TIED_HEAD]
    assert head.layout == layout
    dropped = quantization.drop_tied_table(q)
    assert "wte" not in dropped and quantization.drop_tied_table(params) is params  # nothing to drop without a copy
    tokens = jnp.asarray(np.random.default_rng(6).integers(0, 32, (2, 7)))
    np.testing.assert_array_equal(quantization.take_columns(head, tokens[0]), dequantize(head).T[tokens[0]])
    as_table = dict(q, wte={"embedding": dequantize(head).T})  # the float table the head stands for
    model = ja.DecoderLM(config)
    np.testing.assert_array_equal(model.apply({"params": dropped}, tokens), model.apply({"params": as_table}, tokens))


@needs_cxx
@pytest.mark.parametrize("mode", ["int8:channel", "int4", "int4:64", "int4:asym"])  # int8 in groups: in panels, below
@pytest.mark.parametrize("M", [1, 5])
# 531: vector loops and a tail; 4096: rows a multiple of 4 KiB apart (int8 reads them four at a time)
@pytest.mark.parametrize("K, N", [(64, 17), (192, 72), (128, 531), (64, 4096)])
def test_native_q8act_equals_its_reference_and_stays_within_the_rounding_bound(mode, M, K, N):
    q = quantize_weight(weight(K, N, seed=K + N), mode)
    x = np.random.default_rng(M).normal(size=(M, K)).astype(np.float32)
    x[0, :5] *= 30  # an outlier in the first group: its rounding step is coarse
    expected = quant_matmul.matmul_q8act(x, q)
    got = jax.jit(lambda a, w: quant_matmul.native_matmul(a, w, q8act=True))(x, q)
    assert got.shape == (M, N) and got.dtype == jnp.float32
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(expected))))
    # Against the float x: each output within sum_k |x_k - xq_k xs_k| |W_kj| (plus float32 rounding).
    xq, xs = quant_matmul.quantize_rows(jnp.asarray(x))
    rounded = np.asarray(xq, np.float32) * np.repeat(np.asarray(xs), 32, axis=1)
    assert np.abs(rounded - x).max() <= np.asarray(xs).max() / 2 * (1 + 1e-6)
    bound = np.abs(rounded - x) @ np.abs(np.asarray(dequantize(q)))
    exact = np.asarray(quant_matmul.matmul(x, q))
    assert (np.abs(np.asarray(got) - exact) <= bound + 1e-5 * np.abs(exact).max()).all()
    assert np.abs(np.asarray(got) - exact).max() > 0  # the rounding is real: a formulation of its own


@needs_cxx
def test_native_cpu_q8act_rounds_x_only_where_the_weight_allows():
    x = np.random.default_rng(0).normal(size=(2, 64)).astype(np.float32)
    lower = jax.jit(quant_matmul.matmul_cpu_q8act).lower
    for mode in ("int4", "int8:channel"):
        q = quantize_weight(weight(64, 24), mode)
        assert "q8act = 1" in lower(x, q).as_text()
        np.testing.assert_allclose(quant_matmul.matmul_cpu_q8act(x, q), quant_matmul.matmul_q8act(x, q), rtol=1e-5,
                                   atol=1e-5)
    q8_0 = quantize_weight(weight(64, 32), "int8")  # int8 in groups of 32 (Q8_0): integer dots in panels
    assert "jaxattn_quant_matmul_int8_panels" in lower(x, q8_0).as_text()
    np.testing.assert_allclose(quant_matmul.matmul_cpu_q8act(x, q8_0), quant_matmul.matmul_q8act(x, q8_0), rtol=1e-5,
                               atol=1e-5)
    grouped = quantize_weight(weight(64, 24), "int8")  # in groups, out not a multiple of 16: the exact loop
    assert "q8act = 0" in lower(x, grouped).as_text()
    np.testing.assert_allclose(quant_matmul.matmul_cpu_q8act(x, grouped), quant_matmul.matmul(x, grouped),
                               rtol=1e-5, atol=1e-5)
    prompt = np.ones((quant_matmul.NATIVE_UP_TO + 1, 64), np.float32)
    assert "jaxattn_quant_matmul" not in lower(prompt, grouped).as_text()  # a long prompt: XLA
    with pytest.raises(ValueError, match="q8act takes an int4 weight"):
        quant_matmul.native_matmul(x, grouped, q8act=True)


@needs_cxx
def test_generate_with_q8act_stays_close_to_the_reference():
    config, params = tiny()
    q = quantize(params, config, "int4")
    prompt, lengths = np.array([[3, 1, 4, 1, 5, 9]]), np.array([6])
    run = dict(max_new_tokens=4, rng=jax.random.PRNGKey(0), temperature=0.0, return_logits=True)
    expected = ja.generate(q, config, prompt, lengths, kernels=Kernels(), **run)
    got = ja.generate(q, config, prompt, lengths, kernels=Kernels(quantized="native_cpu_q8act"), **run)
    scale = float(jnp.max(jnp.abs(expected.logits)))
    assert 0 < float(jnp.max(jnp.abs(got.logits - expected.logits))) <= 0.03 * scale


@pytest.mark.parametrize("mode", MODES)
def test_the_panels_layout_holds_the_same_weight(mode):
    rows = quantize_weight(np.stack([weight(64, 48, seed=s) for s in range(3)]), mode)  # leading axes too
    panels = quantization.to_panels(rows)
    assert panels.layout == "panels" and panels.shape == rows.shape == (3, 64, 48)
    per_row = 4 if rows.bits == 8 else 8
    assert panels.values.shape == (3, 3, 64 // per_row, 64 if rows.bits == 8 else 16)
    assert panels.scales.shape == (3, 3, 64 // rows.group, 16) and panels.nbytes == rows.nbytes
    back = quantization.to_rows(panels)
    assert back.layout == "rows"
    np.testing.assert_array_equal(back.values, rows.values)
    np.testing.assert_array_equal(back.scales, rows.scales)
    np.testing.assert_array_equal(dequantize(panels), dequantize(rows))
    np.testing.assert_array_equal(unpack(panels), unpack(rows))
    if rows.bits == 8:  # byte 4c + i of row t of panel p: W[4t + i, 16p + c]
        t, i, p, c = 5, 3, 2, 7
        assert panels.values[1, p, t, 4 * c + i] == rows.values[1, 4 * t + i, 16 * p + c]
    else:  # word c of row t of panel p: the rows layout's word [t, 16p + c]
        assert panels.values[1, 2, 5, 7] == rows.values[1, 5, 39]
    with pytest.raises(ValueError, match="multiple of 16"):
        quantization.to_panels(quantize_weight(weight(64, 24), mode))


@needs_cxx
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("M", [1, 3, 9])  # up to 4 rows a pass over a panel: one pass, one short, three
@pytest.mark.parametrize("K, N", [(64, 16), (192, 80), (128, 4096)])
def test_native_q8act_reads_panels_as_it_reads_rows(mode, M, K, N):
    q = quantize_weight(weight(K, N, seed=K + N), mode)
    x = np.random.default_rng(M).normal(size=(M, K)).astype(np.float32)
    call = jax.jit(lambda a, w: quant_matmul.native_matmul(a, w, q8act=True))
    panels = quant_matmul.prepare_weights({"kernel": q})["kernel"]
    assert panels.layout == "panels"
    assert "jaxattn_quant_matmul_int" in call.lower(x, panels).as_text()  # the panels' own target
    got, expected = call(x, panels), quant_matmul.matmul_q8act(x, q)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(expected))))
    np.testing.assert_allclose(got, call(x, q), rtol=1e-6, atol=1e-6 * float(jnp.max(jnp.abs(expected))))
    # x rounded: each output within sum_k |x_k - xq_k xs_k| |W_kj| of the float x's (plus float32 rounding)
    xq, xs = quant_matmul.quantize_rows(jnp.asarray(x))
    rounded = np.asarray(xq, np.float32) * np.repeat(np.asarray(xs), 32, axis=1)
    exact = np.asarray(quant_matmul.matmul(x, q))
    bound = np.abs(rounded - x) @ np.abs(np.asarray(dequantize(q)))
    assert (np.abs(np.asarray(got) - exact) <= bound + 1e-5 * np.abs(exact).max()).all()
    # Every other formulation reads panels too (putting them back in rows): the same numbers.
    np.testing.assert_allclose(quant_matmul.matmul(x, panels), quant_matmul.matmul(x, q), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(quant_matmul.native_matmul(x, panels), quant_matmul.native_matmul(x, q), rtol=1e-6,
                               atol=1e-6)


@needs_cxx
@pytest.mark.parametrize("scan_layers", [False, True], ids=["unrolled", "scanned"])
def test_prepared_weights_decode_as_the_weights_they_came_from(scan_layers):
    config, params = tiny(tie_embeddings=True, scan_layers=scan_layers)
    q = quantize(params, config, "int4")
    kernels = Kernels(quantized="native_cpu_q8act")
    prepared = ja.prepare_weights(q, kernels)
    layouts = {"/".join(str(getattr(k, "key", k)) for k in path): leaf.layout for path, leaf in
               jax.tree_util.tree_flatten_with_path(prepared, is_leaf=quantization.is_quantized)[0]
               if quantization.is_quantized(leaf)}
    assert layouts and set(layouts.values()) == {"panels"} and quantization.TIED_HEAD in layouts
    assert ja.prepare_weights(q, Kernels()) is q  # the reference reads rows: nothing to do
    with pytest.raises(ValueError, match="resolve it"):
        ja.prepare_weights(q, Kernels.auto())
    prompt, lengths = np.array([[3, 1, 4, 1, 5, 9], [2, 7, 1, 8, 0, 0]]), np.array([6, 4])
    run = dict(max_new_tokens=5, rng=jax.random.PRNGKey(0), temperature=0.0, return_logits=True)
    expected = ja.generate(q, config, prompt, lengths, kernels=kernels, **run)
    got = ja.generate(prepared, config, prompt, lengths, kernels=kernels, **run)
    np.testing.assert_array_equal(got.tokens, expected.tokens)
    np.testing.assert_allclose(got.logits, expected.logits, rtol=1e-5, atol=1e-5)
    reference = ja.generate(prepared, config, prompt, lengths, kernels=Kernels(), **run)  # "xla" on the panels
    np.testing.assert_allclose(reference.logits, ja.generate(q, config, prompt, lengths, kernels=Kernels(),
                                                             **run).logits, rtol=1e-6, atol=1e-6)


def test_moe_experts_are_quantized_per_expert_and_run():
    moe = ja.MoEConfig(num_experts=4, experts_per_token=2, expert_hidden=32)
    config = tiny_config("gqa", positions="rope", d_model=32, mlp_hidden=64, vocab_size=32, max_seq_len=16, moe=moe)
    params = drawn_params(config, seed=6, std=0.05)
    q = quantize(params, config, "int8:channel")
    mlp = q["blocks_1"]["mlp"]
    assert isinstance(mlp["experts_gate_up"], QuantizedWeight) and mlp["experts_gate_up"].shape == (4, 32, 64)
    assert mlp["experts_down"].scales.shape == (4, 1, 32)  # per expert, per output channel
    assert not isinstance(mlp["router_kernel"], QuantizedWeight)  # the choice of experts stays float
    tokens = jnp.asarray(np.random.default_rng(7).integers(0, 32, (1, 6)))
    model = ja.DecoderLM(config)
    expected, got = model.apply({"params": params}, tokens), model.apply({"params": q}, tokens)
    assert float(jnp.max(jnp.abs(got - expected))) <= 0.03 * float(jnp.max(jnp.abs(expected)))


PORTABLE = """
import jax, numpy as np
from jaxattn.kernels import native_build, quant_matmul
from jaxattn.quantization import quantize_weight, to_panels
native_build.FLAGS = tuple("-march=x86-64-v3" if f == "-march=native" else f for f in native_build.FLAGS)
rng = np.random.default_rng(0)
x = rng.normal(size=(3, 96)).astype(np.float32)
for mode in ("int8:channel", "int4"):
    q = quantize_weight(rng.normal(size=(96, 83)).astype(np.float32), mode)
    for q8act, reference in ((False, quant_matmul.matmul), (True, quant_matmul.matmul_q8act)):
        expected = np.asarray(reference(x, q))
        got = np.asarray(jax.jit(lambda a, w: quant_matmul.native_matmul(a, w, q8act=q8act))(x, q))
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    q = quantize_weight(rng.normal(size=(96, 80)).astype(np.float32), mode)  # in panels
    expected = np.asarray(quant_matmul.matmul_q8act(x, q))
    got = np.asarray(quant_matmul.native_matmul(x, to_panels(q), q8act=True))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
print("ok")
"""


@needs_cxx
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the AVX2-only build is an x86 target")
def test_the_portable_loops_without_avx512_equal_the_references(tmp_path):
    """The library built for AVX2 alone (no AVX-512, no VNNI: the plain loops) in a process of its own."""
    env = {**os.environ, "JAXATTN_NATIVE_CACHE": str(tmp_path), "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run([sys.executable, "-c", PORTABLE], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]
    assert len(list(tmp_path.glob("quant_matmul-*.so"))) == 1  # built here, for that target
