"""The per-call "auto" attention rules and the accelerator kernels behind them (jaxattn.kernels.auto).

The rules are pure functions of an `AttentionCall`, tested here for every
platform. Splash runs in Pallas's interpret mode on a CPU, so the TPU path is
checked against the reference in CI; cuDNN needs a CUDA GPU, so its equality
test runs only where there is one (the rule and the fallbacks are tested here).
"""

from __future__ import annotations

import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn import reference_attention, scaled_dot_product_attention
from jaxattn.kernels import Kernels, Platform, auto, custom_vjp, resolve_kernels
from jaxattn.kernels._call import AttentionCall, KernelFallbackWarning

LONG = auto.CHUNKED_FROM_KEYS


def call(**changes) -> AttentionCall:
    base = dict(T=256, S=256, N=8, K=2, H=64, Hv=64, dtype="bfloat16", is_causal=True)
    return AttentionCall(**{**base, **changes})


def qkv(B=1, T=8, S=8, N=4, K=2, H=16, dtype=jnp.float32, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(keys[0], (B, T, N, H), dtype), jax.random.normal(keys[1], (B, S, K, H), dtype),
            jax.random.normal(keys[2], (B, S, K, H), dtype))


@pytest.mark.parametrize("changes, expected", [
    (dict(), "causal_blocks"),
    (dict(S=LONG - 1, T=LONG - 1), "causal_blocks"),
    (dict(is_causal=False), "custom_vjp"),
    (dict(T=1), "custom_vjp"),
    (dict(T=32, S=32), "custom_vjp"),
    (dict(T=33, S=33, dtype="float32", segments=True), "causal_blocks"),
    (dict(S=LONG, T=1), "chunked"),
    (dict(S=4 * LONG, T=4 * LONG, dtype="float32", is_causal=False), "chunked"),
    (dict(S=4 * LONG, weights=True), "xla"),
    (dict(dropout=True), "xla"),
    (dict(mask=True, bias=True, S=2 * LONG), "chunked"),
    (dict(soft_cap=True, sinks=True, residual=True, window=(3, 2)), "causal_blocks"),
    (dict(soft_cap=True, sinks=True, residual=True, window=(3, 2), S=LONG), "chunked"),
], ids=["short", "just-short", "not-causal", "one-query", "one-block", "two-blocks", "long-keys", "long-f32", "weights", "dropout", "mask-and-bias",
        "features-short", "features-long"])
def test_the_cpu_rule_is_dense_below_the_threshold_and_blockwise_from_it(changes, expected):
    name, reason = auto.cpu_rule(call(**changes))
    assert name == expected and reason
    if name == "causal_blocks":
        assert f"blocks of {custom_vjp.block_rows(call(**changes).T)} rows" in reason


@pytest.mark.parametrize("changes, why", [
    (dict(dtype="float32"), "float32 inputs"),
    (dict(H=256, Hv=256), "head dim H=256"),
    (dict(H=36, Hv=36), "head dim H=36"),
    (dict(T=1, S=256), "a causal mask or window with T=1 != S=256"),
    (dict(lengths=True), "key_value_seq_lengths"),
    (dict(weights=True), "attention weights requested"),
    (dict(dropout=True), "dropout"),
    (dict(mask=True), "a dense boolean mask"),
    (dict(bias=True), "an additive bias"),
    (dict(Hv=32), "value head dim Hv=32"),
    (dict(soft_cap=True), "a logit soft cap"),
    (dict(sinks=True), "attention sinks"),
    (dict(is_causal=False, window=(3, 2)), "a window (3, 2) reaching right without is_causal"),
    (dict(T=200, window=(3, 0)), "a causal mask or window with T=200 != S=256"),
])
def test_the_gpu_rule_takes_cudnn_where_it_can_and_says_why_not(changes, why):
    assert auto.gpu_rule(call()) == ("cudnn", "cudnn takes this call")
    assert auto.gpu_rule(call(is_causal=False, T=3, S=700, window=None))[0] == "cudnn"
    for window in ((3, 2), (3, 0)):  # causal cuts the right side; without it, left-only windows pass
        assert auto.gpu_rule(call(window=window, residual=True))[0] == "cudnn"
    assert auto.gpu_rule(call(is_causal=False, window=(5, 0)))[0] == "cudnn"
    name, reason = auto.gpu_rule(call(**changes))
    assert name in ("xla", "chunked") and why in reason and "\n" not in reason
    assert auto.gpu_rule(call(dtype="float32", S=2 * LONG, T=2 * LONG))[0] == "chunked"


@pytest.mark.parametrize("changes, why", [
    (dict(T=300, S=200), "T=300 > S=200 with the causal mask leaves query rows with no key"),
    (dict(lengths=True), "key_value_seq_lengths"),
    (dict(mask=True), "a dense boolean mask"),
    (dict(weights=True), "attention weights requested"),
    (dict(sinks=True), "attention sinks"),
    (dict(residual=True), "the logsumexp residual"),
    (dict(is_causal=False, window=(4, 3), T=260, S=256), "T=260 > S=256 with the window (4, 3) leaves"),
])
def test_the_tpu_rule_takes_splash_where_it_can_and_says_why_not(changes, why):
    assert auto.tpu_rule(call(dtype="float32")) == ("splash", "splash takes this call")
    assert auto.tpu_rule(call(window=(63, 0), T=100))[0] == "splash"
    assert auto.tpu_rule(call(is_causal=False, window=(4, 4), T=260, S=256, soft_cap=True))[0] == "splash"
    name, reason = auto.tpu_rule(call(**changes))
    assert name != "splash" and why in reason


@pytest.mark.parametrize("platform, rule", [(Platform("cpu"), "auto_cpu"), (Platform("gpu"), "auto_gpu"),
                                            (Platform("tpu"), "auto_tpu")])
def test_auto_resolves_to_the_platforms_per_call_rule(platform, rule):
    chosen, reasons = resolve_kernels(Kernels.auto(), platform)
    assert chosen.attention == rule and f"{LONG} keys" in reasons["attention"]


def test_the_default_implementation_is_this_platforms_rule():
    q, k, v = qkv(T=LONG + 5, S=LONG + 5, N=2, K=1, H=8)
    assert auto.choose("auto_cpu", q, k, v, is_causal=True)[0] == "chunked"
    out = jax.jit(lambda q, k, v: scaled_dot_product_attention(q, k, v, is_causal=True))(q, k, v)
    chex.assert_trees_all_close(out, reference_attention(q, k, v, is_causal=True), atol=2e-6, rtol=2e-5)
    chosen = jax.jit(lambda q, k, v: scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                  implementation="chunked"))(q, k, v)
    np.testing.assert_array_equal(out, chosen)  # the program the rule picks, exactly


def test_auto_cpu_gives_the_reference_values_and_gradients_on_both_sides_of_the_threshold(monkeypatch):
    monkeypatch.setattr(auto, "CHUNKED_FROM_KEYS", 48)  # both sides at shapes that compile fast
    for S in (40, 48):
        q, k, v = qkv(T=16, S=S, N=4, K=2, H=8, seed=S)
        f = lambda impl: lambda q, k, v: (scaled_dot_product_attention(  # noqa: E731
            q, k, v, is_causal=True, implementation=impl) ** 2).sum()
        assert auto.choose("auto_cpu", q, k, v, is_causal=True)[0] == ("chunked" if S == 48 else "custom_vjp")
        grads, expected = jax.jit(lambda q, k, v: (jax.grad(f("auto_cpu"), (0, 1, 2))(q, k, v),
                                                   jax.grad(f("xla"), (0, 1, 2))(q, k, v)))(q, k, v)
        chex.assert_trees_all_close(grads, expected, atol=1e-5, rtol=1e-5)


def test_an_accelerator_rule_warns_once_in_one_line_when_it_falls_back():
    q, k, v = qkv()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = scaled_dot_product_attention(q, k, v, is_causal=True, implementation="auto_gpu")
    chex.assert_trees_all_close(out, reference_attention(q, k, v, is_causal=True), atol=2e-6)
    [warning] = [w for w in caught if issubclass(w.category, KernelFallbackWarning)]
    message = str(warning.message)
    assert message.startswith("attention auto_gpu runs xla: cudnn cannot: float32 inputs") and "\n" not in message


def test_cudnn_asked_for_off_a_gpu_is_a_clear_error_and_falls_back_for_what_it_cannot_take():
    q, k, v = qkv(dtype=jnp.bfloat16)
    if jax.default_backend() != "gpu":
        with pytest.raises(ValueError, match='implementation "cudnn" needs a CUDA GPU; this process runs on cpu'):
            scaled_dot_product_attention(q, k, v, implementation="cudnn")
    with pytest.warns(KernelFallbackWarning, match="cuDNN attention cannot take this call: attention weights"):
        out, weights = scaled_dot_product_attention(q, k, v, return_weights=True, implementation="cudnn")
    assert weights.shape == (1, 4, 8, 8)


@pytest.mark.parametrize("T, S, N, K, causal, window, cap", [
    (70, 100, 4, 1, True, None, None),    # MQA, end-aligned causal, T and S padded to a block
    (40, 90, 2, 2, False, None, None),    # padded keys hidden by their segment id
    (100, 100, 4, 2, True, (19, 0), None),  # GQA, the model's sliding window W = 20
    (60, 90, 2, 1, False, (7, 5), 1.5),   # two-sided window reaching padded keys, soft cap
], ids=["mqa-causal-padded", "mha-full-padded", "gqa-window", "two-sided-window-soft-cap"])
def test_splash_equals_the_reference_in_interpret_mode(T, S, N, K, causal, window, cap):
    q, k, v = qkv(T=T, S=S, N=N, K=K, H=32, seed=T + S)
    kwargs = dict(is_causal=causal, local_window_size=window, logits_soft_cap=cap)
    loss = lambda impl: lambda q, k, v: (scaled_dot_product_attention(  # noqa: E731
        q, k, v, implementation=impl, **kwargs) * v[:, :1, :1].sum()).sum()
    with jax.numpy_rank_promotion("raise"):  # one compiled program for the four (compiling dominates)
        grads, expected_grads, out, expected = jax.jit(lambda q, k, v: (
            jax.grad(loss("splash"), (0, 1, 2))(q, k, v), jax.grad(loss("xla"), (0, 1, 2))(q, k, v),
            scaled_dot_product_attention(q, k, v, implementation="auto_tpu", **kwargs),
            reference_attention(q, k, v, **kwargs)))(q, k, v)
    chex.assert_trees_all_close(grads, expected_grads, atol=1e-5, rtol=1e-5)
    chex.assert_trees_all_close(out, expected, atol=2e-6, rtol=2e-5)


def test_splash_and_cudnn_fall_back_in_one_line_for_sinks_and_soft_caps():
    q, k, v = qkv()
    with pytest.warns(KernelFallbackWarning, match=r"splash attention cannot take this call: attention sinks \(splash "
                                                   r"has none\); running the reference \(xla\)"):
        out = scaled_dot_product_attention(q, k, v, sinks=jnp.zeros(4), implementation="splash")
    chex.assert_trees_all_close(out, reference_attention(q, k, v, sinks=jnp.zeros(4)), atol=2e-6)
    with pytest.warns(KernelFallbackWarning, match=r"cuDNN attention cannot take this call: float32 inputs"):
        scaled_dot_product_attention(q, k, v, logits_soft_cap=2.0, implementation="cudnn")
    q16, k16, v16 = qkv(dtype=jnp.bfloat16)
    with pytest.warns(KernelFallbackWarning, match=r"cuDNN attention cannot take this call: a logit soft cap"):
        scaled_dot_product_attention(q16, k16, v16, logits_soft_cap=2.0, implementation="cudnn")


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN needs a CUDA GPU")
@pytest.mark.parametrize("causal", [False, True])
def test_cudnn_on_a_gpu_equals_the_reference_in_bfloat16(causal):
    q, k, v = qkv(B=2, T=256, S=256, N=8, K=2, H=64, dtype=jnp.bfloat16)
    f = lambda impl: lambda q, k, v: scaled_dot_product_attention(  # noqa: E731
        q, k, v, is_causal=causal, implementation=impl).astype(jnp.float32).sum()
    assert auto.choose("auto_gpu", q, k, v, is_causal=causal)[0] == "cudnn"
    out = scaled_dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")
    ref = reference_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), is_causal=causal)
    chex.assert_trees_all_close(out.astype(jnp.float32), ref, atol=2e-2, rtol=2e-2)
    grads = jax.grad(f("cudnn"), (0, 1, 2))(q, k, v)
    expected = jax.grad(f("xla"), (0, 1, 2))(q, k, v)
    for g, e in zip(grads, expected):
        chex.assert_trees_all_close(g.astype(jnp.float32), e.astype(jnp.float32), atol=5e-2, rtol=5e-2)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN needs a CUDA GPU")
@pytest.mark.parametrize("causal, window", [(True, (3, 2)), (False, (5, 0))])
def test_cudnn_on_a_gpu_takes_windows_and_returns_the_residual(causal, window):
    q, k, v = qkv(B=2, T=256, S=256, N=8, K=2, H=64, dtype=jnp.bfloat16)
    kw = dict(is_causal=causal, local_window_size=window, return_residual=True)
    assert auto.choose("auto_gpu", q, k, v, **kw)[0] == "cudnn"
    out, residual = scaled_dot_product_attention(q, k, v, implementation="cudnn", **kw)
    ref, ref_residual = reference_attention(*(x.astype(jnp.float32) for x in (q, k, v)), **kw)
    assert residual.dtype == jnp.bfloat16  # the query's, as jax.nn's
    chex.assert_trees_all_close(out.astype(jnp.float32), ref, atol=2e-2, rtol=2e-2)
    chex.assert_trees_all_close(residual.astype(jnp.float32), ref_residual, atol=5e-2, rtol=2e-2)


@pytest.mark.skipif(jax.default_backend() != "tpu", reason="compiled splash needs a TPU")
def test_splash_compiled_on_a_tpu_equals_the_reference():
    q, k, v = qkv(B=2, T=1024, S=1024, N=8, K=2, H=128)
    from jaxattn.kernels import splash
    out, _, _ = splash.attention(q, k, v, mask=None, bias=None, is_causal=True, scale=128 ** -0.5, dropout_rate=0.0,
                                 dropout_rng=None, return_weights=False, interpret=False)
    chex.assert_trees_all_close(out, reference_attention(q, k, v, is_causal=True), atol=2e-3, rtol=2e-3)


def test_the_long_context_config_trains_with_the_blockwise_kernel_on_a_cpu():
    from train.config import load_config
    config = load_config("shakespeare_char_long")
    T = config.train.block_size
    assert T >= 1024 and config.model.max_seq_len >= T and config.runtime.attention == "auto"
    model = config.model
    heads = AttentionCall(T=T, S=T, N=model.num_heads, K=model.num_heads, H=model.d_model // model.num_heads,
                          Hv=model.d_model // model.num_heads, dtype="float32", is_causal=True)
    assert auto.cpu_rule(heads)[0] == "chunked"


def test_the_cpu_decode_rule_reads_only_the_filled_blocks_at_batch_one():
    from jaxattn.kernels import blocked_decode, xla_cpu
    assert auto.cpu_decode_rule(1, 256)[0] == "blocked" and auto.cpu_decode_rule(8, 1024)[0] == "xla_cpu"
    assert auto.cpu_decode_rule(8, auto.BLOCKED_FROM_SLOTS)[0] == "blocked"
    keys = jax.random.split(jax.random.key(3), 3)
    for batch, expected in ((1, blocked_decode), (3, xla_cpu)):
        q = jax.random.normal(keys[0], (batch, 1, 4, 8))
        k_cache, v_cache = (jax.random.normal(key, (batch, 2, 40, 8)) for key in keys[1:])
        positions = jnp.full((batch, 1), 9)
        out = auto.cpu_cached_attention(q, k_cache, v_cache, positions, scale=0.3, window=None)
        np.testing.assert_array_equal(out, expected.cached_attention(q, k_cache, v_cache, positions, scale=0.3))
