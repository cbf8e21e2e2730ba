"""Attention (MHA/MQA/GQA), norms and MLP against the seed formulas."""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.config import ModelConfig
from jaxattn.layers.gqa import Attention
from jaxattn.kernels import Kernels
from jaxattn.layers.primitives import (
    MLP,
    LayerNorm,
    RMSNorm,
    fused_to_separate_qkv,
    separate_to_fused_qkv,
    with_fused_qkv,
)
from jaxattn.rope import RopeScaling


def attention_config(**changes):
    base = dict(d_model=32, num_heads=4, num_layers=2, positions="none", fused_qkv=False)
    return ModelConfig(**{**base, **changes})


def init(config, x, context=None, seed=0):
    return nn.unbox(Attention(config).init(jax.random.PRNGKey(seed), x, context)["params"])


def run(config, params, *args, method=None, **kwargs):
    return Attention(config).apply({"params": params}, *args, method=method, **kwargs)


def run_with_weights(config, params, *args, **kwargs):
    """`(out, weights [B, N, T, S])`: the weights the layer sows into "intermediates"."""
    out, state = Attention(config).apply({"params": params}, *args, mutable=["intermediates"], **kwargs)
    return out, state["intermediates"]["attention_weights"][0]


def inputs(*shape, seed=0):
    return jax.random.normal(jax.random.PRNGKey(seed), shape)


def test_dimension_walk_through_the_named_steps():
    config = ModelConfig(d_model=512, num_heads=8, num_layers=1, positions="rope")
    x = inputs(1, 50, 512)  # [B, T, D]
    attn = Attention(config)
    params = nn.unbox(attn.init(jax.random.PRNGKey(0), x)["params"])
    q, (k, v) = attn.apply({"params": params}, x, method=Attention.project)
    chex.assert_shape([q, k, v], (1, 50, 8, 64))  # split heads: [B, T, N, H]
    q, (k, v) = attn.apply({"params": params}, q, (k, v), method=Attention.normalise)  # no q/k norm: identity
    positions = jnp.arange(50)
    q, (k, v) = attn.apply({"params": params}, q, (k, v), positions, positions, method=Attention.rotate)
    chex.assert_shape(q.transpose(0, 2, 1, 3), (1, 8, 50, 64))  # the textbook [B, N, T, H] view
    out, weights = attn.apply({"params": params}, q, (k, v), is_causal=True, return_weights=True,
                              method=Attention.attend)
    chex.assert_shape(weights, (1, 8, 50, 50))  # scores [B, N, T, S]
    chex.assert_shape(out, (1, 50, 8, 64))  # our layout keeps heads after time: no transpose back
    y = attn.apply({"params": params}, out, method=Attention.project_out)
    chex.assert_shape(y, (1, 50, 512))  # merged heads and W_O
    np.testing.assert_allclose(y, attn.apply({"params": params}, x, is_causal=True), atol=1e-5)


def textbook_forward(q, k, v, wq, wk, wv, wo, n_heads, is_causal):
    """The textbook PyTorch MultiHeadAttention.forward, in numpy (nn.Linear(x) = x @ W here; no dropout)."""
    bsz, seqlen, _ = q.shape
    head_dim = wq.shape[1] // n_heads
    xq, xk, xv = q @ wq, k @ wk, v @ wv
    xq = xq.reshape(bsz, seqlen, n_heads, head_dim).transpose(0, 2, 1, 3)
    xk = xk.reshape(bsz, k.shape[1], n_heads, head_dim).transpose(0, 2, 1, 3)
    xv = xv.reshape(bsz, v.shape[1], n_heads, head_dim).transpose(0, 2, 1, 3)
    scores = xq @ xk.transpose(0, 1, 3, 2) / np.sqrt(head_dim)
    if is_causal:
        scores = scores + np.triu(np.full((seqlen, seqlen), -np.inf), 1)[None, None]
    scores = np.exp(scores - scores.max(-1, keepdims=True))
    scores = scores / scores.sum(-1, keepdims=True)
    output = (scores @ xv).transpose(0, 2, 1, 3).reshape(bsz, seqlen, -1)
    return output @ wo


@pytest.mark.parametrize("is_causal", [False, True])
def test_mha_equals_a_numpy_transcription_of_the_textbook_module(is_causal):
    config = attention_config()
    x = inputs(2, 6, 32)
    params = init(config, x)
    weights = [np.asarray(params[name]["kernel"], np.float64) for name in ("query", "key", "value", "out")]
    expected = textbook_forward(*(np.asarray(x, np.float64),) * 3, *weights, 4, is_causal)
    np.testing.assert_allclose(run(config, params, x, is_causal=is_causal), expected, atol=2e-5)


def test_cross_attention_equals_the_textbook_module_with_keys_and_values_from_the_context():
    config = attention_config()
    x, context = inputs(2, 6, 32), inputs(2, 9, 32, seed=1)
    params = init(config, x, context)
    weights = [np.asarray(params[name]["kernel"], np.float64) for name in ("query", "key", "value", "out")]
    c = np.asarray(context, np.float64)
    expected = textbook_forward(np.asarray(x, np.float64), c, c, *weights, 4, False)
    np.testing.assert_allclose(run(config, params, x, context), expected, atol=2e-5)


def test_cross_attention_padding_mask_hides_padded_context():
    config = attention_config(num_kv_heads=2, fused_qkv=True)
    x, context = inputs(2, 5, 32), inputs(2, 9, 32, seed=1)
    params = init(config, x, context)
    mask = (jnp.arange(9) < 6)[None, None, None, :]  # [1, 1, 1, S]
    masked = run(config, params, x, context, mask=mask)
    np.testing.assert_allclose(masked, run(config, params, x, context[:, :6]), atol=1e-6)


@pytest.mark.parametrize("changes", [dict(), dict(num_kv_heads=2, use_bias=True),
                                     dict(num_kv_heads=1, head_dim=12, positions="rope")])
def test_fused_and_separate_qkv_agree_for_the_same_weights(changes):
    separate = attention_config(**changes)
    fused = separate.replace(fused_qkv=True)
    x = inputs(2, 7, 32)
    params = init(separate, x)
    fused_params = separate_to_fused_qkv(params)
    chex.assert_shape(fused_params["qkv"]["kernel"],
                      (32, (separate.num_heads + 2 * separate.num_kv_heads) * separate.head_dim))
    for causal in (False, True):
        np.testing.assert_allclose(run(fused, fused_params, x, is_causal=causal),
                                   run(separate, params, x, is_causal=causal), atol=1e-6)
    chex.assert_trees_all_close(fused_to_separate_qkv(fused_params, separate), params)


def test_gqa_equals_mha_with_each_kv_head_repeated_over_its_group():
    gqa = attention_config(num_kv_heads=2)
    x = inputs(2, 6, 32)
    params = init(gqa, x)
    mha_params = dict(params)
    for name in ("key", "value"):
        kernel = params[name]["kernel"].reshape(32, 2, 8)  # [D, K, H]
        mha_params[name] = {"kernel": jnp.repeat(kernel, 2, axis=1).reshape(32, 32)}  # head n <- n // G
    np.testing.assert_allclose(run(gqa, params, x, is_causal=True),
                               run(attention_config(), mha_params, x, is_causal=True), atol=1e-6)


def test_head_dim_is_independent_of_d_model_and_weights_are_returned():
    config = attention_config(head_dim=8, num_kv_heads=2, fused_qkv=True)
    x = inputs(2, 5, 32)
    params = init(config, x)
    chex.assert_shape(params["qkv"]["kernel"], (32, (4 + 2 * 2) * 8))
    chex.assert_shape(params["out"]["kernel"], (4 * 8, 32))
    y, weights = run_with_weights(config, params, x, is_causal=True)
    chex.assert_shape(y, (2, 5, 32))
    chex.assert_shape(weights, (2, 4, 5, 5))
    np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-6)
    assert float(jnp.abs(jnp.triu(weights, 1)).max()) == 0.0


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_attention_depends_only_on_relative_positions(interleaved):
    config = attention_config(positions="rope", rope_interleaved=interleaved,
                              rope_scaling=RopeScaling("yarn", 4.0, original_max_position=16))
    x = inputs(1, 6, 32)
    params = jax.tree_util.tree_map(lambda w: 25 * w, init(config, x))  # std 0.5: sharp attention
    at_zero = run(config, params, x, is_causal=True)
    shifted = run(config, params, x, positions=jnp.arange(6) + 11, is_causal=True)
    np.testing.assert_allclose(at_zero, shifted, atol=2e-4, rtol=1e-4)
    unrotated = run(config.replace(positions="none"), params, x, is_causal=True)
    assert np.abs(at_zero - unrotated).max() > 0.1


def test_dropout_is_off_when_deterministic_and_on_otherwise():
    config = attention_config(dropout=0.5)
    x = inputs(2, 6, 32)
    params = init(config, x)
    a = run(config, params, x)
    np.testing.assert_array_equal(a, run(config, params, x, deterministic=True))
    b = run(config, params, x, deterministic=False, rngs={"dropout": jax.random.PRNGKey(1)})
    c = run(config, params, x, deterministic=False, rngs={"dropout": jax.random.PRNGKey(2)})
    assert np.abs(a - b).max() > 1e-3 and np.abs(b - c).max() > 1e-3


def test_norms_match_their_formulas():
    x = inputs(3, 8) * 3 + 1
    xn = np.asarray(x)
    rms = RMSNorm(eps=1e-6).apply({"params": {"scale": jnp.full(8, 2.0)}}, x)
    np.testing.assert_allclose(rms, 2 * xn / np.sqrt((xn ** 2).mean(-1, keepdims=True) + 1e-6),
                               rtol=1e-5)
    ln = LayerNorm(eps=1e-5).apply({"params": {"scale": jnp.ones(8), "bias": jnp.ones(8)}}, x)
    expected = (xn - xn.mean(-1, keepdims=True)) / np.sqrt(xn.var(-1, keepdims=True) + 1e-5) + 1
    np.testing.assert_allclose(ln, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["gelu", "swiglu"])
def test_mlp_shapes(kind):
    config = ModelConfig(d_model=16, num_heads=2, mlp=kind, mlp_hidden=24, use_bias=True)
    x = inputs(2, 3, 16)
    params = nn.unbox(MLP(config).init(jax.random.PRNGKey(0), x)["params"])
    chex.assert_shape(MLP(config).apply({"params": params}, x), (2, 3, 16))
    hidden = params["gate_up" if kind == "swiglu" else "c_fc"]["kernel"]
    chex.assert_shape(hidden, (16, 2 * 24 if kind == "swiglu" else 24))


def test_bad_inputs_raise_clear_errors():
    config = attention_config(fused_qkv=True)
    x = inputs(2, 5, 32)
    with pytest.raises(ValueError, match="fused QKV shares one input width"):
        init(config, x, inputs(2, 4, 16))
    with pytest.raises(ValueError, match=r"x must be \[B, T, D\]"):
        init(config, x[0])
    with pytest.raises(ValueError, match="context must be"):
        init(config, x, inputs(3, 4, 32))
    with pytest.raises(TypeError, match="ModelConfig"):
        Attention({"d_model": 32}).init(jax.random.PRNGKey(0), x)
    with pytest.raises(TypeError, match="kernels must be a jaxattn.Kernels"):
        Attention(config, "custom_vjp").init(jax.random.PRNGKey(0), x)
    with pytest.raises(ValueError, match=r"Kernels.attention is \"auto\""):
        Attention(config, Kernels(attention="auto")).init(jax.random.PRNGKey(0), x)


def test_a_models_separate_projections_fuse_into_one_with_the_same_logits_unrolled_or_scanned():
    from jaxattn.scan_plan import relayout
    from jaxattn.model import DecoderLM
    from jaxattn.quantization import quantize
    config = ModelConfig(vocab_size=64, d_model=32, num_layers=3, num_heads=4, num_kv_heads=2, positions="rope",
                         norm="rmsnorm", mlp="swiglu", fused_qkv=False, qkv_bias=True, max_seq_len=32)
    params = nn.unbox(DecoderLM(config).init(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))["params"])
    params = jax.tree.map(lambda x: x + 0.02 * jax.random.normal(jax.random.PRNGKey(1), x.shape), params)  # biases too
    tokens = jax.random.randint(jax.random.PRNGKey(2), (2, 8), 0, 64)
    expected = DecoderLM(config).apply({"params": params}, tokens)
    for layout in (params, relayout(params, config, True)[0]):
        given = config.replace(scan_layers="layers" in layout)
        fused, fused_config = with_fused_qkv(layout, given)
        assert fused_config == given.replace(fused_qkv=True)
        attn = fused["layers"]["blocks_0"]["attn"] if given.scan_layers else fused["blocks_2"]["attn"]
        assert set(attn) == {"qkv", "out"} and attn["qkv"]["bias"].shape[-1] == (4 + 2 * 2) * 8
        np.testing.assert_allclose(DecoderLM(fused_config).apply({"params": fused}, tokens), expected, atol=1e-5)
    # nothing to fuse: already fused, or the projections are quantized (fuse first)
    again, quantized = with_fused_qkv(fused, fused_config), quantize(params, config, "int8")
    assert again[0] is fused and again[1] is fused_config
    kept = with_fused_qkv(quantized, config)
    assert kept[0] is quantized and kept[1] is config
