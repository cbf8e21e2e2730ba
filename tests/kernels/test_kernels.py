"""Every implementation behind the seam equals the reference, and "auto" follows the rules (docs/theory.md §15).

The tests iterate `jaxattn.kernels.IMPLEMENTATIONS`, so an implementation added
there is checked against the reference without a new test.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn import kernels
from jaxattn.attention import cached_attention, reference_attention, scaled_dot_product_attention
from jaxattn.cache.containers import write_rows
from jaxattn.kernels import Kernels, Platform, choices, custom_vjp, resolve_kernels
from jaxattn.kernels.select import read_cpu_flags
from jaxattn.masks import padding_mask, sliding_window_mask, visible_cache_slots

# cuDNN needs a CUDA GPU, and splash (and the GPU/TPU rules that pick them) run for minutes in interpret
# mode at these many cases: tests/kernels/test_auto_attention.py checks them.
ACCELERATOR_ONLY = ("cudnn", "splash", "auto_gpu", "auto_tpu")
RUNS_HERE = [name for name in choices("attention") if name not in ACCELERATOR_ONLY]
# The alternatives to the reference; "auto_cpu" runs one of them per call (tests/kernels/test_auto_attention.py).
ATTENTION = [name for name in RUNS_HERE if name not in ("xla", "auto_cpu")]
HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}


def qkv(B=2, T=5, S=6, N=4, K=2, H=8, Hv=4, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal(s, np.float32)) for s in ((B, T, N, H), (B, S, K, H), (B, S, K, Hv)))


@pytest.fixture
def no_rank_promotion():
    with jax.numpy_rank_promotion("raise"):
        yield


MASKS = {
    "none": dict(),
    "causal": dict(is_causal=True),
    "padding_bias": dict(mask=padding_mask(jnp.array([6, 2]), 6), bias=True),
    "window": dict(mask=sliding_window_mask(5, 6, 3)),
    "empty_rows": dict(mask=padding_mask(jnp.array([6, 0]), 6), is_causal=True),  # row 1: no key at all
    # The newer models' features: two-sided windows, soft caps and sinks, alone and together.
    "two_sided_window_lengths": dict(local_window_size=(1, 2), key_value_seq_lengths=jnp.array([6, 3])),
    "causal_window_cap_bias": dict(is_causal=True, local_window_size=(2, 1), logits_soft_cap=1.5, bias=True),
    "sinks_empty_rows": dict(mask=padding_mask(jnp.array([6, 0]), 6), is_causal=True, sinks=True),
    "everything": dict(is_causal=True, local_window_size=(3, 0), key_value_seq_lengths=jnp.array([5, 6]),
                       logits_soft_cap=2.0, sinks=True, bias=True, mask=padding_mask(jnp.array([6, 4]), 6)),
}


def _value_and_grads(implementations, q, k, v, case):
    """`{implementation: (loss, gradients)}`: the loss `<out, W>` and its gradients wrt q, k, v, the bias
    (zeros unless the case has one) and the sinks (when the case has them), under rank promotion "raise";
    one compiled program for every implementation (compiling dominates these tests)."""
    kw = dict(MASKS[case])
    bias = jnp.asarray(np.random.default_rng(2).standard_normal((1, q.shape[2], q.shape[1], k.shape[1]), np.float32))
    bias = bias if kw.pop("bias", False) else jnp.zeros_like(bias)
    sinks = jnp.asarray(np.random.default_rng(3).standard_normal(q.shape[2]), jnp.float32) if kw.pop("sinks", False) \
        else None
    weights = jnp.asarray(np.random.default_rng(5).standard_normal(q.shape[:3] + v.shape[-1:], np.float32))
    argnums = (0, 1, 2, 3) + ((4,) if sinks is not None else ())

    def value_and_grad(implementation):
        def loss(q, k, v, bias, sinks):
            out = scaled_dot_product_attention(q, k, v, bias=bias, sinks=sinks, implementation=implementation, **kw)
            return jnp.vdot(out, weights)
        return jax.value_and_grad(loss, argnums=argnums)
    with jax.numpy_rank_promotion("raise"):
        return jax.jit(lambda *args: {name: value_and_grad(name)(*args) for name in implementations})(
            q, k, v, bias, sinks)


@functools.cache
def _attention_answers(heads, case):
    """`_value_and_grads` of the reference and every alternative, once per heads and case."""
    N, K = HEADS[heads]
    return _value_and_grads(("xla", *ATTENTION), *qkv(N=N, K=K), case)


@pytest.mark.parametrize("implementation", ATTENTION)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("case", MASKS)
def test_attention_kernels_equal_the_reference(implementation, heads, case):
    """Values and gradients (q, k, v, bias, sinks) equal to float32 summation order, every mask kind
    and feature.

    The implementations contract in different orders (heads-major batched matmuls against the
    grouped einsum), so float32 rounding differs by a few ulp per sum: 1e-5 relative on the
    loss, a weighted sum of 160 outputs."""
    answers = _attention_answers(heads, case)
    loss, grads = answers["xla"]
    loss_i, grads_i = answers[implementation]
    np.testing.assert_allclose(loss_i, loss, rtol=1e-5)
    for name, g, g_i in zip("qkvbs", grads, grads_i):
        assert np.all(np.isfinite(g_i)), name
        np.testing.assert_allclose(g_i, g, rtol=1e-4, atol=1e-5, err_msg=name)


# Causal self-attention (T == S) in blocks of query rows ("causal_blocks"): the cases above have T != S, which
# it runs densely; these have T == S == 12 in blocks of 4 rows, of 5 (uneven: 4 + 4 + 4 after evening out)
# and of 11 (two), with every feature that reaches a causal self-attention.
SELF = {
    "causal": dict(),
    "cap_bias_sinks": dict(logits_soft_cap=1.5, bias=True, sinks=True),
    "window_lengths": dict(local_window_size=(3, 0), key_value_seq_lengths=jnp.array([12, 7])),
    "segments": dict(segment_ids=jnp.array([[1] * 5 + [2] * 7, [1] * 3 + [2] * 4 + [0] * 5], jnp.int32)),
    "empty_rows_residual": dict(mask=padding_mask(jnp.array([12, 0]), 12), sinks=True, return_residual=True),
}


@functools.cache
def _blocks_answers(case, dtype):
    """Loss `<out, W> (+ sum of the residual)` and its gradients wrt q, k, v, the bias and the sinks, of the
    reference and of custom_vjp in no blocks and in blocks of 4, 5 and 11 rows, in one compiled program."""
    rng = np.random.default_rng(7)
    q, k, v, weights = (jnp.asarray(rng.standard_normal(shape), dtype)
                        for shape in ((2, 12, 4, 8), (2, 12, 2, 8), (2, 12, 2, 8), (2, 12, 4, 8)))
    bias = jnp.asarray(rng.standard_normal((1, 4, 12, 12)), dtype)
    sinks = jnp.asarray(rng.standard_normal(4), jnp.float32)
    kw = dict(SELF[case])
    with_bias, with_sinks = kw.pop("bias", False), kw.pop("sinks", False)
    arguments = {"mask": None, "is_causal": True, "scale": 0.3, "dropout_rate": 0.0, "dropout_rng": None,
                 "return_weights": False, **kw}

    def loss(attend, q, k, v, bias, sinks):
        out, _, residual = attend(q, k, v, bias=bias if with_bias else None, sinks=sinks if with_sinks else None,
                                  **arguments)
        total = jnp.vdot(out.astype(jnp.float32), weights.astype(jnp.float32))
        return total if residual is None else total + jnp.sum(jnp.where(jnp.isfinite(residual), residual, 0.0))
    attends = {"xla": kernels.attention_kernel("xla"),
               **{f"rows {rows}": functools.partial(custom_vjp.attention, rows_per_block=rows) for rows in (None, 4, 5, 11)}}
    return jax.jit(lambda *a: {name: jax.value_and_grad(functools.partial(loss, attend), argnums=(0, 1, 2, 3, 4))(*a)
                               for name, attend in attends.items()})(q, k, v, bias, sinks)


@pytest.mark.parametrize("rows", [4, 5, 11])
@pytest.mark.parametrize("case", SELF)
def test_causal_blocks_equal_the_reference_and_the_dense_kernel(case, rows):
    """float32: the reference's values and gradients to float32 summation order. bfloat16: the dense
    kernel's, to one rounding of the gradients (each block's dK, dV partial is summed in float32, then
    rounded once)."""
    answers = _blocks_answers(case, jnp.float32)
    (loss, grads), (loss_b, grads_b) = answers["xla"], answers[f"rows {rows}"]
    np.testing.assert_allclose(loss_b, loss, rtol=1e-5)
    for name, g, g_b in zip("qkvbs", grads, grads_b):
        assert np.all(np.isfinite(g_b)), name
        np.testing.assert_allclose(g_b, g, rtol=1e-4, atol=1e-5, err_msg=name)
    answers = _blocks_answers(case, jnp.bfloat16)
    (loss, grads), (loss_b, grads_b) = answers["rows None"], answers[f"rows {rows}"]
    np.testing.assert_allclose(loss_b, loss, rtol=1e-2)
    for name, g, g_b in zip("qkvbs", grads, grads_b):
        assert g_b.dtype == g.dtype, name
        np.testing.assert_allclose(np.asarray(g_b, np.float32), np.asarray(g, np.float32), rtol=2e-2, atol=2e-2,
                                   err_msg=name)


def test_causal_row_blocks_cover_the_rows_evenly_and_only_for_causal_self_attention():
    assert custom_vjp.causal_row_blocks(12, 12, True, 5) == ((0, 4), (4, 8), (8, 12))
    assert custom_vjp.causal_row_blocks(12, 12, True, 12) == ((0, 12),)
    assert custom_vjp.causal_row_blocks(12, 13, True, 4) == ((0, 12),)  # T != S: dense
    assert custom_vjp.causal_row_blocks(12, 12, False, 4) == ((0, 12),)
    assert custom_vjp.causal_row_blocks(12, 12, True, None) == ((0, 12),)
    for T in (33, 64, 256, 257, 1000, 1023):
        blocks = custom_vjp.causal_row_blocks(T, T, True, custom_vjp.block_rows(T))
        assert blocks[0][0] == 0 and blocks[-1][1] == T and all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))
        sizes = [stop - start for start, stop in blocks]
        assert max(sizes) - min(sizes) <= 1 and max(sizes) <= custom_vjp.block_rows(T)
        assert 2 <= len(blocks) <= custom_vjp.MOST_BLOCKS
    assert custom_vjp.block_rows(256) == 32 and custom_vjp.block_rows(1024) == 128


@pytest.mark.parametrize("implementation", RUNS_HERE)
def test_every_attention_kernel_equals_the_textbook_reference(implementation, no_rank_promotion):
    q, k, v = qkv(N=4, K=1)
    mask = padding_mask(jnp.array([6, 4]), 6)
    out = scaled_dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation=implementation)
    np.testing.assert_allclose(out, reference_attention(q, k, v, mask=mask, is_causal=True), rtol=1e-5, atol=1e-6)
    features = dict(mask=mask, local_window_size=(2, 1), logits_soft_cap=1.0, sinks=jnp.array([0.5, -1.0, 0.0, 2.0]),
                    return_residual=True)
    out, residual = scaled_dot_product_attention(q, k, v, implementation=implementation, **features)
    out_r, residual_r = reference_attention(q, k, v, **features)
    np.testing.assert_allclose(out, out_r, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(residual, residual_r, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("implementation", RUNS_HERE)
def test_every_kernel_returns_the_contracts_three_results(implementation, no_rank_promotion):
    """(out, weights or None, residual or None), each only when asked for; the residual of a row with no
    key and no sink is -inf, as the reference's."""
    q, k, v = qkv(N=4, K=2)
    kw = dict(mask=padding_mask(jnp.array([6, 0]), 6), bias=None, is_causal=False, scale=0.3, dropout_rate=0.0,
              dropout_rng=None, local_window_size=None, key_value_seq_lengths=None, logits_soft_cap=None,
              sinks=None)
    attend = kernels.attention_kernel(implementation)
    out, weights, residual = attend(q, k, v, return_weights=False, return_residual=False, **kw)
    assert out.shape == (2, 5, 4, 4) and weights is None and residual is None
    _, _, residual = attend(q, k, v, return_weights=False, return_residual=True, **kw)
    _, _, expected = kernels.attention_kernel("xla")(q, k, v, return_weights=False, return_residual=True, **kw)
    assert residual.dtype == jnp.float32 and residual.shape == (2, 5, 4) and np.all(residual[1] == -np.inf)
    np.testing.assert_allclose(residual, expected, rtol=1e-5, atol=1e-6)
    _, weights, _ = attend(q, k, v, return_weights=True, return_residual=False, **kw)
    assert weights.shape == (2, 4, 5, 6)


@pytest.mark.parametrize("implementation", choices("decode"))
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("num_queries", [1, 3])
@pytest.mark.parametrize("features", ["plain", "window_cap_sinks"])
def test_cached_attention_kernels_equal_the_reference(implementation, heads, num_queries, features):
    """Against the reference decode kernel, and against attention on the transposed cache with the
    visibility rule as its mask; rows at different positions, batch 1 and 2; soft cap and sinks."""
    for answers in _cached_answers(heads, num_queries, features):  # batch 1, then batch 2
        np.testing.assert_allclose(answers[implementation], answers["reference"], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(answers[implementation], answers["general"], rtol=1e-5, atol=1e-6)


@functools.cache
def _cached_answers(heads, num_queries, features):
    """For batch 1 and batch 2: `{implementation: out}` of every decode implementation, the default's
    as "reference" and attention on the transposed cache as "general"; one compiled program for all."""
    N, K = HEADS[heads]
    kw = dict(scale=0.3)
    if features != "plain":
        kw.update(window=3, logits_soft_cap=0.8, sinks=jnp.array([0.5, -1.0, 0.0, 2.0]))

    def answers(query, key_cache, value_cache, positions):
        out = {name: cached_attention(query, key_cache, value_cache, positions, implementation=name, **kw)
               for name in choices("decode")}
        out["reference"] = cached_attention(query, key_cache, value_cache, positions, **kw)
        out["general"] = scaled_dot_product_attention(
            query, key_cache.transpose(0, 2, 1, 3), value_cache.transpose(0, 2, 1, 3),
            mask=visible_cache_slots(positions, 9, kw.get("window")), scale=0.3,
            logits_soft_cap=kw.get("logits_soft_cap"), sinks=kw.get("sinks"))
        return out
    rng = np.random.default_rng(3)
    batches = [(rng.standard_normal((B, num_queries, N, 8), np.float32),
                rng.standard_normal((B, K, 9, 8), np.float32), rng.standard_normal((B, K, 9, 8), np.float32),
                (np.array([[2], [6]]) + np.arange(num_queries)[None])[:B]) for B in (1, 2)]
    with jax.numpy_rank_promotion("raise"):
        return jax.jit(lambda batches: [answers(*batch) for batch in batches])(batches)


@pytest.mark.parametrize("implementation", choices("decode"))
def test_cache_writers_equal_the_reference(implementation):
    buffer = jax.random.normal(jax.random.PRNGKey(0), (3, 2, 7, 4))  # [B, K, L, H]
    update = jax.random.normal(jax.random.PRNGKey(1), (3, 2, 2, 4)).astype(jnp.bfloat16)  # cast to the buffer's
    starts = jnp.array([0, 5, 2])
    expected = np.asarray(buffer).copy()
    for b, s in enumerate([0, 5, 2]):
        expected[b, :, s:s + 2] = np.asarray(update[b].astype(jnp.float32))
    out = write_rows(buffer, update, starts, axis=2, implementation=implementation)
    assert out.dtype == buffer.dtype
    np.testing.assert_array_equal(out, expected)


# --------------------------------------------------------------------------------------------
# Dense matmuls. Oracle: float64 numpy on the bfloat16-rounded operands.


def _rounded(x):
    return np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32)).astype(np.float64)


def _data(M, K, N, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal(s, np.float32)) for s in ((M, K), (K, N), (M, N)))


def _grads(name, x, w, dy):
    return jax.jit(jax.grad(lambda x, w: jnp.vdot(kernels.matmul_kernel(name)(x, w), dy), argnums=(0, 1)))(x, w)


@pytest.mark.parametrize("M,K,N", [(24, 8, 32), (24, 32, 8)], ids=["x-narrower-than-dy", "x-wider-than-dy"])
@pytest.mark.parametrize("name", ["bfloat16", "bfloat16_cpu"])
def test_bfloat16_matmuls_are_rounded_operands_summed_in_float32(name, M, K, N):
    """Values and gradients are the oracle to float32 summation order; both branches of the CPU
    backward (which operand gets transposed) are covered."""
    x, w, dy = _data(M, K, N)
    y = jax.jit(kernels.matmul_kernel(name))(x, w)
    assert y.dtype == jnp.float32
    np.testing.assert_allclose(y, _rounded(x) @ _rounded(w), rtol=1e-5, atol=1e-5)
    dx, dw = _grads(name, x, w, dy)
    assert dx.dtype == dw.dtype == jnp.float32
    np.testing.assert_allclose(dx, _rounded(dy) @ _rounded(w).T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, _rounded(x).T @ _rounded(dy), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", choices("matmul"))
def test_matmul_kernels_equal_the_reference(name):
    """Every matmul equals float32 within bfloat16 rounding (8 mantissa bits: each product is off by
    ~2^-8 relative, sums of K=64 terms of random sign by about that times sqrt(K))."""
    x, w, dy = _data(16, 64, 32, seed=1)
    np.testing.assert_allclose(kernels.matmul_kernel(name)(x, w), x @ w, rtol=0, atol=0.2)
    for a, b in zip(_grads(name, x, w, dy), _grads("xla", x, w, dy)):
        np.testing.assert_allclose(a, b, rtol=0, atol=0.2)
    np.testing.assert_array_equal(kernels.matmul_kernel("xla")(x, w), jnp.dot(x, w))


def test_gradients_keep_the_input_dtypes_and_bfloat16_backwards_are_reverse_mode_only():
    x, w, dy = _data(8, 4, 4)
    for name in ("bfloat16", "bfloat16_cpu"):
        dx, dw = jax.grad(lambda x, w: jnp.vdot(kernels.matmul_kernel(name)(x, w), dy), argnums=(0, 1))(
            x.astype(jnp.bfloat16), w)
        assert dx.dtype == jnp.bfloat16 and dw.dtype == jnp.float32
        with pytest.raises(TypeError, match="custom_vjp"):
            jax.jvp(lambda x: kernels.matmul_kernel(name)(x, w), (x,), (x,))
    jax.jvp(lambda x: kernels.matmul_kernel("xla")(x, w), (x,), (x,))  # the reference: any mode


# --------------------------------------------------------------------------------------------
# The registry and the rules of "auto".


def test_names_are_checked_and_auto_must_be_resolved():
    with pytest.raises(ValueError,
                       match=r"Kernels.decode must be one of \('xla', 'xla_cpu', 'blocked', 'auto_cpu', 'auto'\), got 'gpu'"):
        Kernels(decode="gpu")
    with pytest.raises(ValueError, match=r'Kernels.attention is "auto": resolve it for a platform first'):
        kernels.attention_kernel("auto")
    with pytest.raises(ValueError, match=r"matmul implementation must be one of"):
        kernels.matmul_kernel("float16")
    assert Kernels() == Kernels(attention="xla", decode="xla", matmul="xla", mla="naive", moe="dense",
                                paged="gather")  # the references
    assert all(choices(field)[0] == getattr(Kernels(), field) for field in kernels.IMPLEMENTATIONS)


AMX = frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})
AVX512 = frozenset({"avx2", "avx512f", "avx512_bf16"})
AVX2 = frozenset({"avx2", "fma"})
CPU_AUTO = dict(attention="auto_cpu", decode="auto_cpu", moe="auto_cpu", paged="ragged")  # every CPU alike
# (without a C++ compiler: with one, paged is "ragged_cpu" and quantized a native loop)


@pytest.mark.parametrize("platform, expected", [
    (Platform("cpu", AMX), Kernels(**CPU_AUTO, matmul="bfloat16_cpu")),
    (Platform("cpu", AVX512), Kernels(**CPU_AUTO, matmul="xla")),
    (Platform("cpu", AVX2), Kernels(**CPU_AUTO, matmul="xla")),
    (Platform("cpu"), Kernels(**CPU_AUTO, matmul="xla")),
    (Platform("cpu", AVX2, cxx=True), Kernels(**{**CPU_AUTO, "paged": "ragged_cpu"}, matmul="native_cpu",
                                              quantized="native_cpu_q8act")),  # AVX2's integer dots and tiles
    (Platform("cpu", frozenset({"sse4_2"}), cxx=True), Kernels(**{**CPU_AUTO, "paged": "ragged_cpu"}, matmul="xla",
                                                               quantized="native_cpu")),  # no integer-dot path, no tiles
    (Platform("cpu", frozenset({"fp", "asimd", "asimddp"}), cxx=True),
     Kernels(**{**CPU_AUTO, "paged": "ragged_cpu"}, matmul="native_cpu", quantized="native_cpu_q8act")),  # ARM's
    (Platform("cpu", AVX512 | {"avx512_vnni"}, cxx=True), Kernels(**{**CPU_AUTO, "paged": "ragged_cpu"},
                                                                   matmul="native_cpu", quantized="native_cpu_q8act")),
    (Platform("cpu", AMX, cxx=True), Kernels(**{**CPU_AUTO, "paged": "ragged_cpu"}, matmul="bfloat16_cpu",
                                             quantized="native_cpu_q8act")),  # AMX: bfloat16 dots still
    (Platform("gpu", AMX, cxx=True), Kernels(attention="auto_gpu", matmul="bfloat16", moe="grouped")),  # the host's AMX: no matter
    (Platform("tpu"), Kernels(attention="auto_tpu", matmul="bfloat16", moe="grouped")),
], ids=["cpu-amx", "cpu-avx512-no-amx", "cpu-amd-avx2", "cpu-unknown", "cpu-avx2-with-cxx", "cpu-sse-with-cxx",
       "cpu-arm-dotprod-with-cxx", "cpu-vnni-with-cxx", "cpu-amx-with-cxx", "gpu", "tpu"])
def test_auto_follows_the_rules_for_each_platform(platform, expected):
    chosen, reasons = resolve_kernels(Kernels.auto(), platform)
    assert chosen == expected
    assert set(reasons) == set(kernels.IMPLEMENTATIONS) and all(reasons.values())
    assert ("AMX-BF16" in reasons["matmul"]) == platform.is_cpu


def test_only_auto_fields_are_replaced():
    chosen, reasons = resolve_kernels(Kernels.auto().replace(matmul="bfloat16", mla="absorb"), Platform("cpu", AVX2))
    assert (chosen.matmul, chosen.mla, chosen.attention) == ("bfloat16", "absorb", "auto_cpu")
    assert reasons["matmul"] == reasons["mla"] == "asked for"


def test_cpu_flags_are_read_from_the_flags_line(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Some Xeon\nflags\t\t: fpu avx512f amx_bf16\n\n"
                       "processor\t: 1\nflags\t\t: fpu avx512f amx_bf16\n")
    assert read_cpu_flags(str(cpuinfo)) == {"fpu", "avx512f", "amx_bf16"}
    assert read_cpu_flags(str(tmp_path / "missing")) == frozenset()
    assert Platform("cpu", frozenset({"avx2"})).describe() == "cpu backend (avx2)"
    assert Platform("gpu").describe() == "gpu backend"
