"""The switches real checkpoints need: sliding window, q/k norm, GELU forms, gated GELU, per-group biases."""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.cache.build import init_cache
from jaxattn.config import ModelConfig
from jaxattn.layers.gqa import Attention
from jaxattn.model import DecoderLM
from jaxattn.layers.primitives import MLP
from tiny_models import TINY_MLA, VOCAB, drawn_params, tiny_config

T = 10


def sharpened_params(config, seed=0):
    """Random params with std ~0.3 (biases and norm scales too) so every term shows in the logits."""
    return drawn_params(config, seed, std=0.3)


def tokens(batch=2, length=T, seed=3):
    return jax.random.randint(jax.random.PRNGKey(seed), (batch, length), 0, VOCAB)


def logits(config, params, toks):
    return DecoderLM(config).apply({"params": params}, toks)


@pytest.mark.parametrize("kind", ["mha", "gqa", "mla_naive"])
def test_a_one_layer_window_sees_exactly_the_last_w_tokens(kind):
    # RoPE is relative, so with one layer the logits at t are those of the W tokens ending at t alone.
    W = 3
    config = tiny_config(kind, "rope", num_layers=1, sliding_window=W, max_seq_len=16)
    params, toks = sharpened_params(config), tokens()
    windowed = logits(config, params, toks)
    full = config.replace(sliding_window=None)
    for t in (W - 1, 5, T - 1):
        alone = logits(full, params, toks[:, t - W + 1:t + 1])[:, -1]
        np.testing.assert_allclose(windowed[:, t], alone, atol=2e-5, rtol=2e-5)
    # Negative control: without the window the late positions differ.
    assert np.abs(logits(full, params, toks)[:, -1] - windowed[:, -1]).max() > 1e-2


@pytest.mark.parametrize("kind", ["mha", "gqa", "mla_absorb"])
def test_cached_decoding_applies_the_window_like_the_whole_sequence(kind):
    config = tiny_config(kind, "rope", sliding_window=3, max_seq_len=16)
    params, toks = sharpened_params(config), tokens()
    expected = logits(config, params, toks)
    model = DecoderLM(config)
    cache = init_cache(config, 2, 16)
    prefill, cache = model.apply({"params": params}, toks[:, :4], cache, method=DecoderLM.extend)
    steps = [prefill]
    for t in range(4, T):
        step, cache = model.apply({"params": params}, toks[:, t:t + 1], cache, method=DecoderLM.extend)
        steps.append(step)
    np.testing.assert_allclose(jnp.concatenate(steps, axis=1), expected, atol=2e-5, rtol=2e-5)


def scale_queries(params, config, factor):
    """params with every layer's query columns of the fused qkv kernel multiplied by `factor`."""
    columns = config.num_heads * config.head_dim
    out = jax.tree_util.tree_map(lambda x: x, params)  # a copy of the dict structure
    for i in range(config.num_layers):
        qkv = out[f"blocks_{i}"]["attn"]["qkv"]
        qkv["kernel"] = qkv["kernel"].at[:, :columns].mul(factor)
    return out


def without_qk_norm(params, config):
    out = jax.tree_util.tree_map(lambda x: x, params)
    for i in range(config.num_layers):
        for name in ("q_norm", "k_norm"):
            del out[f"blocks_{i}"]["attn"][name]
    return out


def test_qk_norm_normalises_each_query_and_key_head():
    config = tiny_config("gqa", "rope", qk_norm=True, norm="rmsnorm")  # no q bias: scaling is exact
    params, toks = sharpened_params(config), tokens()
    attn = params["blocks_0"]["attn"]
    chex.assert_shape([attn["q_norm"]["scale"], attn["k_norm"]["scale"]], (config.head_dim,))
    # RMSNorm makes each query head scale-free: scaling the query projection changes nothing...
    np.testing.assert_allclose(logits(config, scale_queries(params, config, 7.0), toks),
                               logits(config, params, toks), atol=5e-4, rtol=5e-4)
    # ...while without the norm (negative control) it does.
    plain, plain_params = config.replace(qk_norm=False), without_qk_norm(params, config)
    changed = logits(plain, scale_queries(plain_params, config, 7.0), toks) - logits(plain, plain_params, toks)
    assert np.abs(changed).max() > 1e-2


@pytest.mark.parametrize("mlp,approximate", [("gelu", True), ("gelu", False), ("geglu", True),
                                             ("geglu", False), ("swiglu", True)])
def test_mlp_forms_follow_their_formulas(mlp, approximate):
    config = ModelConfig(d_model=8, num_heads=2, mlp=mlp, gelu_approximate=approximate, mlp_hidden=12,
                         mlp_bias=True)
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 3, 8))
    params = nn.unbox(MLP(config).init(jax.random.PRNGKey(1), x)["params"])
    params = jax.tree_util.tree_map(lambda p: p + 0.5, params)
    out = MLP(config).apply({"params": params}, x)  # the library, rank-promotion clean
    with jax.numpy_rank_promotion("allow"):  # the formula as written, biases broadcast implicitly
        if mlp == "gelu":
            h = jax.nn.gelu(x @ params["c_fc"]["kernel"] + params["c_fc"]["bias"], approximate=approximate)
            expected = h @ params["c_proj"]["kernel"] + params["c_proj"]["bias"]
        else:
            gate_up = x @ params["gate_up"]["kernel"] + params["gate_up"]["bias"]
            gate, up = gate_up[..., :12], gate_up[..., 12:]
            act = jax.nn.silu(gate) if mlp == "swiglu" else jax.nn.gelu(gate, approximate=approximate)
            expected = (act * up) @ params["down"]["kernel"] + params["down"]["bias"]
    np.testing.assert_allclose(out, expected, atol=1e-5, rtol=1e-5)


def test_erf_and_tanh_gelu_differ_measurably():
    # So a checkpoint mapped with the wrong form fails a 1e-4 parity tolerance.
    x = jnp.linspace(-3, 3, 101)
    assert np.abs(jax.nn.gelu(x, approximate=True) - jax.nn.gelu(x, approximate=False)).max() > 1e-4


def param_names(config):
    shapes = jax.eval_shape(DecoderLM(config).init, jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))
    flat = jax.tree_util.tree_flatten_with_path(nn.unbox(shapes["params"]))[0]
    return {"/".join(k.key for k in path) for path, _ in flat}


def test_bias_groups_follow_use_bias_unless_given():
    config = ModelConfig(use_bias=False, qkv_bias=True)  # Qwen2
    assert (config.qkv_bias, config.out_bias, config.mlp_bias) == (True, False, False)
    assert config.replace(use_bias=True).out_bias and config.replace(use_bias=True).qkv_bias
    names = param_names(config)
    assert "blocks_0/attn/qkv/bias" in names
    assert not any(n.endswith("bias") for n in names if "/out/" in n or "/mlp/" in n or "norm" in n)
    everything = param_names(ModelConfig(use_bias=True))
    assert {"blocks_0/attn/out/bias", "blocks_0/mlp/c_fc/bias", "blocks_0/attn_norm/bias"} <= everything


def test_mla_attention_bias_sits_where_deepseek_puts_it():
    config = tiny_config("mla_absorb", "rope", qkv_bias=True, out_bias=True)
    names = {n for n in param_names(config) if n.startswith("blocks_0/attn/") and n.endswith("bias")}
    assert names == {"blocks_0/attn/wq_a/bias", "blocks_0/attn/wkv_a/bias", "blocks_0/attn/wo/bias"}


def test_attention_with_biases_and_qk_norm_runs_cross_attention_too():
    config = ModelConfig(d_model=8, num_heads=2, qk_norm=True, qkv_bias=True, fused_qkv=False)
    x, ctx = jnp.ones((1, 3, 8)), jnp.ones((1, 5, 8))
    params = nn.unbox(Attention(config).init(jax.random.PRNGKey(0), x, ctx)["params"])
    chex.assert_shape(Attention(config).apply({"params": params}, x, ctx), (1, 3, 8))


@pytest.mark.parametrize("changes,error,words", [
    (dict(sliding_window=0), ValueError, "sliding_window"),
    (dict(sliding_window=2.5), ValueError, "sliding_window"),
    (dict(qk_norm=True, mla=TINY_MLA), ValueError, "qk_norm"),
    (dict(qkv_bias="yes"), TypeError, "qkv_bias"),
    (dict(gelu_approximate=None), TypeError, "gelu_approximate"),
    (dict(mlp="reglu"), ValueError, "mlp"),
])
def test_bad_feature_settings_name_the_field(changes, error, words):
    with pytest.raises(error, match=words):
        ModelConfig(**changes)


def test_old_configs_without_the_new_fields_load_unchanged():
    old = {k: v for k, v in ModelConfig().to_dict().items()
           if k not in ("sliding_window", "qk_norm", "gelu_approximate", "qkv_bias", "out_bias", "mlp_bias")}
    assert ModelConfig.from_dict(old) == ModelConfig()
