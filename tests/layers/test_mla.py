"""Multi-head Latent Attention: absorbed equals naive, latent attention equals MQA on the latent."""

import math

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.attention import scaled_dot_product_attention
from jaxattn.cache.containers import LatentCache
from jaxattn.cache.build import init_cache
from jaxattn.config import MLAConfig, ModelConfig
from jaxattn.kernels import Kernels
from jaxattn.layers.mla import MultiHeadLatentAttention, latent_attention
from jaxattn.rope import RopeScaling, rope_attention_factor

B, T, D = 2, 7, 32


def mla_config(q_lora_rank=None, **changes):
    mla = MLAConfig(kv_lora_rank=16, q_lora_rank=q_lora_rank, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)
    base = dict(d_model=D, num_heads=4, num_layers=2, positions="rope", mla=mla)
    return ModelConfig(**{**base, **changes})


def setup_mla(config, seed=0):
    x = jax.random.normal(jax.random.PRNGKey(seed), (B, T, D))
    params = nn.unbox(MultiHeadLatentAttention(config).init(jax.random.PRNGKey(seed + 1), x)["params"])
    # std 0.3 rather than 0.02 so that attention is far from uniform and paths can differ
    params = jax.tree_util.tree_map(lambda w: w * 15 if w.ndim > 1 else w, params)
    return x, params


def run(config, params, *args, path="naive", **kwargs):
    return MultiHeadLatentAttention(config, Kernels(mla=path)).apply({"params": params}, *args, **kwargs)


def run_with_weights(config, params, *args, path, **kwargs):
    """`(out, weights [B, N, T, S])`: the weights the layer sows into "intermediates"."""
    out, state = MultiHeadLatentAttention(config, Kernels(mla=path)).apply(
        {"params": params}, *args, mutable=["intermediates"], **kwargs)
    return out, state["intermediates"]["attention_weights"][0]


@pytest.mark.parametrize("q_lora_rank", [None, 12])
def test_absorbed_equals_naive(q_lora_rank):
    config = mla_config(q_lora_rank=q_lora_rank)
    x, params = setup_mla(config)
    assert ("wq_a" in params) == (q_lora_rank is not None)
    mask = (jnp.arange(T)[None, :] < jnp.array([[T], [4]]))[:, None, None, :]  # padding [B, 1, 1, S]
    for causal in (True, False):
        naive, w_naive = run_with_weights(config, params, x, path="naive", mask=mask, is_causal=causal)
        absorb, w_absorb = run_with_weights(config, params, x, path="absorb", mask=mask, is_causal=causal)
        chex.assert_shape([w_naive, w_absorb], (B, 4, T, T))
        assert float(w_naive.std()) > 0.05  # far from uniform: a real check
        np.testing.assert_allclose(absorb, naive, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(w_absorb, w_naive, atol=1e-6)


def test_step_shapes():
    config = mla_config(q_lora_rank=12)
    x, params = setup_mla(config)
    mla = MultiHeadLatentAttention(config)
    q_nope, q_rope = mla.apply({"params": params}, x, method=MultiHeadLatentAttention.project_query)
    chex.assert_shape([q_nope, q_rope], [(B, T, 4, 8), (B, T, 4, 4)])
    c_kv, k_rope = mla.apply({"params": params}, x, method=MultiHeadLatentAttention.compress_kv)
    chex.assert_shape([c_kv, k_rope], [(B, T, 16), (B, T, 4)])  # one rotary key for all heads
    np.testing.assert_allclose(jnp.sqrt(jnp.mean(c_kv ** 2, -1)), 1.0, atol=1e-3)  # RMSNorm, scale 1
    chex.assert_shape(params["wkv_b"], (16, 4, 8 + 6))  # [R, N, P + V]: W_UK | W_UV
    out = run(config, params, x, is_causal=True)
    chex.assert_shape(out, (B, T, D))


def test_latent_attention_is_mqa_with_one_latent_kv_head():
    keys = jax.random.split(jax.random.PRNGKey(3), 4)
    q_latent = jax.random.normal(keys[0], (B, T, 4, 16))
    q_rope = jax.random.normal(keys[1], (B, T, 4, 4))
    c_kv = jax.random.normal(keys[2], (B, 9, 16))
    k_rope = jax.random.normal(keys[3], (B, 9, 4))
    out, weights = latent_attention(q_latent, q_rope, c_kv, k_rope, scale=0.3, is_causal=True)
    query = jnp.concatenate([q_latent, q_rope], -1)  # [B, T, N, R + E]
    key = jnp.concatenate([c_kv, k_rope], -1)[:, :, None]  # [B, S, 1, R + E]
    expected, expected_w = scaled_dot_product_attention(
        query, key, c_kv[:, :, None], scale=0.3, is_causal=True, return_weights=True)
    np.testing.assert_allclose(out, expected, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(weights, expected_w, atol=1e-6)


def test_yarn_scales_the_rotary_dims_and_the_softmax_as_deepseek():
    # DeepSeek-V3's own rope settings: factor 40, mscale = mscale_all_dim = 1.
    deepseek = RopeScaling("yarn", 40.0, original_max_position=64, mscale=1.0, mscale_all_dim=1.0)
    plain = RopeScaling("yarn", 40.0, original_max_position=64)
    _, params = setup_mla(mla_config())
    for scaling, softmax_mscale, rope_factor in ((None, 1.0, 1.0), (deepseek, 1 + 0.1 * math.log(40), 1.0),
                                                 (plain, 1.0, 1 + 0.1 * math.log(40))):
        config = mla_config(rope_scaling=scaling)
        scale, factor = MultiHeadLatentAttention(config).apply(
            {"params": params}, method=lambda m: (m.scale, m.rope_factor))
        assert math.isclose(scale, softmax_mscale ** 2 / math.sqrt(8 + 4))
        assert math.isclose(factor, rope_factor)
    assert rope_attention_factor(deepseek) == 1.0


def test_yarn_attention_factor_reaches_only_the_rotary_logits():
    # With a factor on the rotary dims only, the logits are q_nope.k_nope + f^2 q_rope.k_rope;
    # the old bug scaled both terms by f^2.
    plain = RopeScaling("yarn", 40.0, original_max_position=64)
    config = mla_config(rope_scaling=plain)
    x, params = setup_mla(config)
    positions = jnp.arange(x.shape[1])

    def logits(m):
        (q_nope, q_rope), (c_kv, k_rope) = m.rotate(*m.project(x), positions, positions)
        w_uk = m.wkv_b[..., :config.mla.qk_nope_head_dim]
        k_nope = jnp.einsum("BSR,RNP->BSNP", c_kv, w_uk)
        return (jnp.einsum("BTNP,BSNP->BNTS", q_nope, k_nope), jnp.einsum("BTNE,BSE->BNTS", q_rope, k_rope))

    nope, rope = MultiHeadLatentAttention(config).apply({"params": params}, method=logits)
    nope0, rope0 = MultiHeadLatentAttention(config.replace(rope_scaling=plain.__class__(
        "yarn", 40.0, original_max_position=64, attention_factor=1.0))).apply({"params": params}, method=logits)
    f = rope_attention_factor(plain)
    np.testing.assert_allclose(nope, nope0, rtol=1e-6)
    np.testing.assert_allclose(rope, f ** 2 * rope0, rtol=1e-5, atol=1e-6)


def test_extend_stores_only_the_latent_and_the_rotary_key():
    config = mla_config()
    x, params = setup_mla(config)
    cache = init_cache(config, B, 10).layers[0]
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))  # an empty cache: the rows start at position 0
    out, cache = run(config, params, x, cache, positions, method=MultiHeadLatentAttention.extend)
    assert isinstance(cache, LatentCache)
    chex.assert_shape([cache.c_kv, cache.k_rope], [(B, 10, 16), (B, 10, 4)])
    assert sum(a.shape[-1] for a in (cache.c_kv, cache.k_rope)) == 16 + 4  # R + E per token
    np.testing.assert_allclose(out, run(config, params, x, is_causal=True, path="naive"),
                               atol=1e-5, rtol=1e-5)
    assert float(jnp.abs(cache.c_kv[:, T:]).max()) == 0.0  # nothing written past the tokens


def test_the_kernels_choose_the_path_and_a_bad_path_raises():
    config = mla_config()
    x, params = setup_mla(config)
    absorbed = MultiHeadLatentAttention(config, Kernels(mla="absorb")).apply({"params": params}, x, is_causal=True)
    np.testing.assert_allclose(absorbed, run(config, params, x, path="absorb", is_causal=True), atol=0, rtol=0)
    with pytest.raises(ValueError, match=r"Kernels.mla is \"auto\": resolve it for a platform first"):
        run(config, params, x, path="auto")  # never detected by a model
    with pytest.raises(ValueError, match=r"Kernels.mla must be one of \('naive', 'absorb', 'auto'\), got 'fast'"):
        Kernels(mla="fast")
    with pytest.raises(ValueError, match="self-attention only"):
        run(config, params, x, x)
    with pytest.raises(ValueError, match="needs ModelConfig.mla"):
        MultiHeadLatentAttention(config.replace(mla=None)).init(jax.random.PRNGKey(0), x)
