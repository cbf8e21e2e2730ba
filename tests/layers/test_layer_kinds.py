"""Every layer its own attention: per-layer kinds (local/global, NoPE, own RoPE base, partial rotary),
soft caps, sinks, the softmax scale, both q/k norm widths, norm placements, residuals, (1 + w) RMSNorm
and the embedding scale. Each feature against its formula, with a negative control that must fail the
same tolerance; cached decoding equals full recomputation for every new kind with MHA, GQA and MLA.

Tiny models, every parameter re-drawn (std 0.1 around the init: norm scales near 1, or near 0 under
the unit offset; whole models' drawn with numpy, nothing compiled), sequences longer than the windows.
"""

import json

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.traverse_util import flatten_dict, unflatten_dict

import jaxattn
from jaxattn import sharding
from jaxattn.axes import MeshShape
from jaxattn.cache.build import init_cache
from jaxattn.config import AttentionSpec, LayerKind, MLAConfig, ModelConfig
from jaxattn.layers.gqa import Attention
from jaxattn.kernels import Kernels
from jaxattn.layers.mla import MultiHeadLatentAttention
from jaxattn.layers.block import Block
from jaxattn.model import DecoderLM, attention_weights
from jaxattn.layers.primitives import RMSNorm
from jaxattn.rope import RopeScaling, apply_rope, rope_frequencies, rotary_dims
from tiny_models import drawn_params

VOCAB, T, W = 13, 10, 3  # sequences longer than the window
TOL = dict(atol=2e-5, rtol=2e-5)
CONTROL = 1e-3  # a negative control must miss its formula by more than this (50x the tolerance)
MLA = MLAConfig(kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4)
ATTENTION = {"mha": dict(), "gqa": dict(num_kv_heads=2), "mla": dict(mla=MLA)}
LOCAL, GLOBAL, NOPE = LayerKind(local=True), LayerKind(), LayerKind(rope=False)


def config_for(attention="mha", **changes):
    base = dict(vocab_size=VOCAB, d_model=16, num_layers=2, num_heads=4, max_seq_len=16, positions="rope",
                norm="rmsnorm", mlp="swiglu", mlp_hidden=32)
    return ModelConfig(**{**base, **ATTENTION[attention], **changes})


def redrawn(params, seed=0, std=0.1):
    """Every leaf re-drawn: normal(init, std) around its init (so norm scales stay near their identity)."""
    flat = flatten_dict(nn.unbox(params))
    keys = jax.random.split(jax.random.PRNGKey(seed), len(flat))
    return unflatten_dict({path: leaf + std * jax.random.normal(key, leaf.shape)
                           for key, (path, leaf) in zip(keys, flat.items())})


def model_params(config, seed=0):
    return drawn_params(config, seed, std=0.1)


def tokens(batch=2, seed=3):
    return jax.random.randint(jax.random.PRNGKey(seed), (batch, T), 0, VOCAB)


def logits(config, params, toks, kernels=Kernels()):
    return DecoderLM(config, kernels).apply({"params": params}, toks)


def assert_control_fails(control, expected):
    """A negative control: `control` misses `expected` by far more than the tolerance."""
    assert np.abs(np.asarray(control) - np.asarray(expected)).max() > CONTROL


# ----------------------------------------------------------------------------- the config


def test_a_pattern_gives_each_layer_its_attention():
    local = LayerKind(local=True, rope_theta=10_000.0, rope_scaling="none")
    config = config_for(num_layers=7, sliding_window=W, rope_theta=1e6, layer_pattern=(local,) * 5 + (GLOBAL,),
                        rope_scaling=RopeScaling("linear", 8.0), attn_logits_soft_cap=50.0, attn_sinks=True)
    specs = [config.layer_attention(i) for i in range(7)]
    assert [s.window for s in specs] == [W] * 5 + [None] + [W]  # the period repeats
    assert [s.rope_theta for s in specs] == [10_000.0] * 5 + [1e6] + [10_000.0]
    assert specs[0].rope_scaling is None and specs[5].rope_scaling == RopeScaling("linear", 8.0)
    assert all(s.logits_soft_cap == 50.0 and s.sinks and s.rotary_fraction == 1.0 for s in specs)
    # No pattern: every layer as today's models, local exactly when there is a window.
    assert config_for(sliding_window=W).layer_attention(1) == AttentionSpec(
        window=W, rope=True, rope_theta=10000.0, rope_scaling=None, rotary_fraction=1.0,
        logits_soft_cap=None, sinks=False)
    assert config_for(positions="learned").layer_attention(0).rope is False
    assert config_for(layer_pattern=(NOPE, GLOBAL)).layer_attention(0).rope is False
    with pytest.raises(ValueError, match=r"layer must be an integer in \[0, num_layers=7\), got 7"):
        config.layer_attention(7)


@pytest.mark.parametrize("changes,error,words", [
    (dict(layer_pattern=(LOCAL,)), ValueError, "local layers but sliding_window is None"),
    (dict(layer_pattern=(GLOBAL,), sliding_window=4), ValueError, "no kind of layer_pattern is local"),
    (dict(layer_pattern=({"local": True},)), TypeError, "layer_pattern must be a tuple of jaxattn.LayerKind"),
    (dict(rotary_fraction=0.0), ValueError, r"rotary_fraction must be a number in \(0, 1\]"),
    (dict(rotary_fraction=1.5), ValueError, r"rotary_fraction must be a number in \(0, 1\]"),
    (dict(rotary_fraction=0.1), ValueError, "rotary_fraction=0.1 of head_dim=4 rotates no pair"),
    (dict(mla=MLA, rotary_fraction=0.5), ValueError, "MLA's rotary dims are already separate"),
    (dict(attn_logits_soft_cap=0.0), ValueError, "attn_logits_soft_cap must be a positive number"),
    (dict(final_logits_soft_cap=-30.0), ValueError, "final_logits_soft_cap must be a positive number"),
    (dict(attn_scale=float("inf")), ValueError, "attn_scale must be a positive number"),
    (dict(embed_multiplier=0), ValueError, "embed_multiplier must be a positive number"),
    (dict(attn_sinks=1), TypeError, "attn_sinks must be true or false"),
    (dict(norm_unit_offset="yes"), TypeError, "norm_unit_offset must be true or false"),
    (dict(norm_unit_offset=True, norm="layernorm"), ValueError, r"norm_unit_offset scales RMSNorm by \(1 \+ w\)"),
    (dict(residual="gpt-j"), ValueError, r"residual must be one of \('sequential', 'parallel'\)"),
    (dict(norm_placement="after"), ValueError, r"norm_placement must be one of \('pre', 'sandwich', 'post'\)"),
    (dict(qk_norm="rms"), ValueError, r"qk_norm must be one of \('none', 'head', 'full'\)"),
    (dict(qk_norm="full", mla=MLA), ValueError, "qk_norm applies to standard attention"),
])
def test_bad_settings_name_the_field(changes, error, words):
    with pytest.raises(error, match=words):
        config_for(**changes)


@pytest.mark.parametrize("kind,error,words", [
    (dict(local=1), TypeError, "LayerKind.local must be true or false"),
    (dict(rope_theta=-1.0), ValueError, "LayerKind.rope_theta must be a positive number"),
    (dict(rope_scaling="linear"), TypeError, "LayerKind.rope_scaling must be a jaxattn.RopeScaling"),
    (dict(rotary_fraction=2.0), ValueError, r"LayerKind.rotary_fraction must be a number in \(0, 1\]"),
])
def test_bad_layer_kinds_name_the_field(kind, error, words):
    with pytest.raises(error, match=words):
        LayerKind(**kind)


def test_configs_round_trip_and_old_ones_load_unchanged():
    kinds = (LayerKind(local=True, rope_scaling="none", rotary_fraction=0.5),
             LayerKind(rope_scaling=RopeScaling("yarn", 4.0, original_max_position=8)), NOPE)
    config = config_for(num_layers=3, sliding_window=W, layer_pattern=kinds, qk_norm="full", attn_sinks=True,
                        residual="parallel", norm_placement="sandwich", norm_unit_offset=True)
    again = ModelConfig.from_dict(json.loads(json.dumps(config.to_dict())))
    assert again == config and hash(again) == hash(config)
    # A config saved before the per-layer fields existed: qk_norm a switch, none of the new fields.
    new = {"layer_pattern", "rotary_fraction", "attn_logits_soft_cap", "final_logits_soft_cap", "attn_scale",
           "attn_sinks", "residual", "norm_placement", "norm_unit_offset", "embed_multiplier"}
    old = {k: v for k, v in ModelConfig().to_dict().items() if k not in new}
    assert ModelConfig.from_dict({**old, "qk_norm": False}) == ModelConfig()
    assert ModelConfig.from_dict({**old, "qk_norm": True}) == ModelConfig(qk_norm="head")


def test_a_pattern_of_todays_layer_is_todays_model_bit_for_bit():
    toks = tokens()
    for plain, patterned in ((config_for(), config_for(layer_pattern=(GLOBAL,))),
                             (config_for(sliding_window=W), config_for(sliding_window=W, layer_pattern=(LOCAL,)))):
        params = model_params(plain)
        np.testing.assert_array_equal(logits(patterned, params, toks), logits(plain, params, toks))


# ----------------------------------------------------------------------------- the attention maths of a layer


def reference_attention(q, k, v, *, scale, window=None, cap=None, sinks=None):
    """Causal attention in float64 numpy, written out: q `[B, T, N, H]`, k, v `[B, S, K, H]`."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    groups = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, groups, axis=2), np.repeat(v, groups, axis=2)
    s = np.einsum("btnh,bsnh->bnts", q, k) * scale
    if cap is not None:
        s = cap * np.tanh(s / cap)
    i, j = np.arange(q.shape[1])[:, None], np.arange(k.shape[1])[None, :]
    s = np.where((j <= i) & ((i - j < window) if window else True), s, -np.inf)
    top, sink = s.max(-1, keepdims=True), 0.0
    if sinks is not None:  # one more logit in each row's denominator, with no value
        sink_logit = np.asarray(sinks, np.float64)[None, :, None, None]
        top = np.maximum(top, sink_logit)
        sink = np.exp(sink_logit - top)
    e = np.exp(s - top)
    return np.einsum("bnts,bsnh->btnh", e / (e.sum(-1, keepdims=True) + sink), v)


FEATURES = {  # feature: (its settings, the negative control's)
    "soft_cap": (dict(attn_logits_soft_cap=0.3), dict()),
    "sinks": (dict(attn_sinks=True), dict()),
    "attn_scale": (dict(attn_scale=2.0), dict()),
    "window": (dict(sliding_window=W), dict()),
}


def layer_and_params(config, layer=0, seed=0):
    x = jax.random.normal(jax.random.PRNGKey(seed), (2, T, config.d_model))
    module = (Attention if config.mla is None else MultiHeadLatentAttention)(config, layer=layer)
    params = redrawn(module.init(jax.random.PRNGKey(seed + 1), x)["params"], seed, std=0.5)  # sharp attention
    return module, params, x


@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("attention", ["mha", "gqa"])
def test_the_layer_gives_its_features_to_the_attention(feature, attention):
    settings, control = FEATURES[feature]
    config = config_for(attention, **settings)
    module, params, x = layer_and_params(config)

    def steps(m):
        q, kv = m.normalise(*m.project(x))
        return m.rotate(q, kv, jnp.arange(T), jnp.arange(T))

    q, (k, v) = module.apply({"params": params}, method=steps)
    sinks = params.get("sinks")
    expected = reference_attention(q, k, v, scale=config.attn_scale or 0.5, window=config.sliding_window,
                                   cap=config.attn_logits_soft_cap, sinks=sinks)
    project_out = lambda out: module.apply({"params": params}, jnp.asarray(out, jnp.float32),  # noqa: E731
                                           method=Attention.project_out)
    np.testing.assert_allclose(module.apply({"params": params}, x, is_causal=True), project_out(expected), **TOL)
    without = Attention(config_for(attention, **control))
    control_params = {k: p for k, p in params.items() if k != "sinks"}
    assert_control_fails(without.apply({"params": control_params}, x, is_causal=True), project_out(expected))


def test_mla_paths_agree_with_soft_cap_sinks_and_a_window():
    config = config_for("mla", attn_logits_soft_cap=0.3, attn_sinks=True, sliding_window=W)
    module, params, x = layer_and_params(config)
    run = lambda path: MultiHeadLatentAttention(config, Kernels(mla=path)).apply(  # noqa: E731
        {"params": params}, x, is_causal=True, mutable=["intermediates"])
    (naive, naive_state), (absorbed, absorbed_state) = run("naive"), run("absorb")
    np.testing.assert_allclose(absorbed, naive, **TOL)
    weights = [s["intermediates"]["attention_weights"][0] for s in (naive_state, absorbed_state)]
    np.testing.assert_allclose(weights[1], weights[0], atol=1e-6)
    assert float(weights[0].sum(-1).max()) < 1 - 1e-3  # the sinks take their share
    assert float(jnp.abs(jnp.tril(weights[0], -W)).max()) == 0.0  # nothing W or more back
    plain = config.replace(attn_logits_soft_cap=None, attn_sinks=False, sliding_window=None)
    control = MultiHeadLatentAttention(plain).apply({"params": {k: p for k, p in params.items() if k != "sinks"}},
                                                    x, is_causal=True)
    assert_control_fails(control, naive)


# ----------------------------------------------------------------------------- rotary, q/k norms, RMSNorm


def neox_partial_rope(x, positions, rotary, theta, interleaved):
    """GPT-NeoX / Phi-3's partial rotary, in numpy: the first `rotary` dims rotated with frequencies
    over those dims (transformers: inv_freq from dim = rotary_ndims), the rest passed through."""
    x = np.asarray(x, np.float64)
    inv_freq = 1.0 / theta ** (np.arange(0, rotary, 2) / rotary)
    angles = np.asarray(positions)[:, None] * inv_freq  # [T, R/2]
    cos, sin = np.cos(angles)[None, :, None, :], np.sin(angles)[None, :, None, :]
    part = x[..., :rotary]
    if interleaved:
        a, b = part[..., 0::2], part[..., 1::2]
        turned = np.stack([a * cos - b * sin, a * sin + b * cos], -1).reshape(part.shape)
    else:
        a, b = part[..., :rotary // 2], part[..., rotary // 2:]
        turned = np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)
    return np.concatenate([turned, x[..., rotary:]], -1)


@pytest.mark.parametrize("interleaved", [False, True])
def test_partial_rotary_rotates_the_first_dims_with_their_own_frequencies(interleaved):
    x = jax.random.normal(jax.random.PRNGKey(0), (1, T, 2, 16))
    positions = jnp.arange(T) + 3
    assert rotary_dims(16, 0.25) == 4 and rotary_dims(16, 0.3) == 4 and rotary_dims(80, 0.4) == 32
    expected = neox_partial_rope(x, positions, 4, 100.0, interleaved)
    inv_freq = rope_frequencies(4, theta=100.0)
    got = apply_rope(x, positions, interleaved=interleaved, inv_freq=inv_freq)
    np.testing.assert_allclose(got, expected, **TOL)
    np.testing.assert_allclose(apply_rope(x, positions, interleaved=interleaved, theta=100.0, rotary_dim=4),
                               expected, **TOL)
    np.testing.assert_array_equal(got[..., 4:], x[..., 4:])  # passed through untouched
    # Negative control: full rotary (every dim, frequencies over all 16).
    assert_control_fails(apply_rope(x, positions, interleaved=interleaved, theta=100.0), expected)


def test_a_partial_rotary_layer_rotates_its_first_dims():
    config = config_for(d_model=32, rotary_fraction=0.5, rope_theta=100.0)  # H = 8: R = 4
    module, params, x = layer_and_params(config)
    positions = jnp.arange(T)

    def rotated(m):
        q, kv = m.project(x)
        return q, m.rotate(q, kv, positions, positions)[0]

    q, turned = module.apply({"params": params}, method=rotated)
    np.testing.assert_allclose(turned, neox_partial_rope(q, positions, 4, 100.0, False), **TOL)
    full = Attention(config.replace(rotary_fraction=1.0)).apply({"params": params}, method=rotated)[1]
    assert_control_fails(full, turned)


def rms(x, eps=1e-5):
    x = np.asarray(x, np.float64)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)


@pytest.mark.parametrize("attention", ["mha", "gqa"])
def test_full_width_qk_norm_normalises_the_whole_projection(attention):
    config = config_for(attention, qk_norm="full", positions="none")
    module, params, x = layer_and_params(config)
    N, K, H = config.num_heads, config.num_kv_heads, config.head_dim
    chex.assert_shape([params["q_norm"]["scale"], params["k_norm"]["scale"]], [(N * H,), (K * H,)])
    q, (k, _) = module.apply({"params": params}, method=lambda m: m.project(x))
    normed_q, (normed_k, _) = module.apply({"params": params}, method=lambda m: m.normalise(*m.project(x)))
    flat = lambda a: np.asarray(a).reshape(2, T, -1)  # noqa: E731
    expected_q = rms(flat(q)) * np.asarray(params["q_norm"]["scale"])
    np.testing.assert_allclose(flat(normed_q), expected_q, **TOL)
    np.testing.assert_allclose(flat(normed_k), rms(flat(k)) * np.asarray(params["k_norm"]["scale"]), **TOL)
    # Negative control: per-head norm (OLMo 2 is not Qwen3): each head normalised on its own.
    per_head = rms(q).reshape(2, T, -1) * np.asarray(params["q_norm"]["scale"])
    assert_control_fails(per_head, expected_q)


def test_unit_offset_rmsnorm_scales_by_one_plus_w():
    x = jax.random.normal(jax.random.PRNGKey(0), (3, 8)) * 3 + 1
    w = jnp.linspace(-0.5, 0.5, 8)
    fresh = RMSNorm(eps=1e-6, unit_offset=True).init(jax.random.PRNGKey(0), x)["params"]
    assert float(jnp.abs(nn.unbox(fresh)["scale"]).max()) == 0.0  # w starts at 0: the identity scaling
    got = RMSNorm(eps=1e-6, unit_offset=True).apply({"params": {"scale": w}}, x)
    expected = rms(x, eps=1e-6) * (1 + np.asarray(w))
    np.testing.assert_allclose(got, expected, **TOL)
    assert_control_fails(RMSNorm(eps=1e-6).apply({"params": {"scale": w}}, x), expected)
    # Every RMSNorm of a model takes it: the blocks', the final one and the q/k norms.
    config = config_for(norm_unit_offset=True, qk_norm="head")
    scales = {"/".join(p): v for p, v in flatten_dict(nn.unbox(DecoderLM(config).init(
        jax.random.PRNGKey(0), jnp.zeros((1, 2), jnp.int32))["params"])).items() if p[-1] == "scale"}
    assert len(scales) == 9 and all(float(jnp.abs(v).max()) == 0.0 for v in scales.values())


# ----------------------------------------------------------------------------- blocks: placements and residuals


def block_and_params(config, seed=0):
    x = jax.random.normal(jax.random.PRNGKey(seed), (2, T, config.d_model))
    params = redrawn(Block(config).init(jax.random.PRNGKey(seed + 1), x, positions=jnp.arange(T))["params"], seed)
    return params, x


def block_formula(config, params, x):
    """The block written out from its parts (each part applied on its own with its own params)."""
    part = lambda module, name, h: module.apply({"params": params[name]}, h)  # noqa: E731
    attn = lambda h: Attention(config).apply({"params": params["attn"]}, h, is_causal=True)  # noqa: E731
    norm = lambda name, h: part(RMSNorm(eps=config.norm_eps), name, h)  # noqa: E731
    mlp = lambda h: part(jaxattn.MLP(config), "mlp", h)  # noqa: E731
    if config.norm_placement == "pre":
        branch = lambda f, h, which: f(norm(f"{which}_norm", h))  # noqa: E731
    elif config.norm_placement == "sandwich":
        branch = lambda f, h, which: norm(f"post_{which}_norm", f(norm(f"{which}_norm", h)))  # noqa: E731
    else:
        branch = lambda f, h, which: norm(f"post_{which}_norm", f(h))  # noqa: E731
    if config.residual == "parallel":
        return x + branch(attn, x, "attn") + branch(mlp, x, "mlp")
    h = x + branch(attn, x, "attn")
    return h + branch(mlp, h, "mlp")


PLACEMENTS = {  # (settings, the negative control's settings, how the control's params are named)
    "post": (dict(norm_placement="post"), dict(), {"post_attn_norm": "attn_norm", "post_mlp_norm": "mlp_norm"}),
    "sandwich": (dict(norm_placement="sandwich"), dict(), {}),
    "parallel": (dict(residual="parallel"), dict(), {}),
    "parallel_sandwich": (dict(residual="parallel", norm_placement="sandwich"),
                          dict(norm_placement="sandwich"), {}),
}


@pytest.mark.parametrize("case", PLACEMENTS)
def test_blocks_follow_their_norm_placement_and_residual(case):
    settings, control, renamed = PLACEMENTS[case]
    config = config_for(**settings)
    params, x = block_and_params(config)
    names = set(params)
    assert ("attn_norm" in names) == (config.norm_placement != "post")
    assert ("post_attn_norm" in names) == (config.norm_placement != "pre")
    expected = block_formula(config, params, x)
    got = Block(config).apply({"params": params}, x, positions=jnp.arange(T))
    np.testing.assert_allclose(got, expected, **TOL)
    # Negative control: the same weights in the other placement / residual (post: as pre-norms).
    other = config_for(**control)
    kept = {renamed.get(name, name): p for name, p in params.items()
            if renamed.get(name, name) in nn.unbox(Block(other).init(jax.random.PRNGKey(0), x, positions=jnp.arange(T))["params"])}
    assert_control_fails(Block(other).apply({"params": kept}, x, positions=jnp.arange(T)), expected)


# ----------------------------------------------------------------------------- the model: embedding, final cap


def test_embedding_multiplier_and_final_soft_cap():
    config = config_for(embed_multiplier=4.0, final_logits_soft_cap=0.5)
    params, toks = model_params(config), tokens()
    embedded = DecoderLM(config).apply({"params": params}, toks, jnp.arange(T), method=DecoderLM.embed)
    np.testing.assert_allclose(embedded, 4.0 * params["wte"]["embedding"][toks], **TOL)
    assert_control_fails(DecoderLM(config.replace(embed_multiplier=1.0)).apply(
        {"params": params}, toks, jnp.arange(T), method=DecoderLM.embed), embedded)
    raw = logits(config.replace(final_logits_soft_cap=None), params, toks)
    capped = logits(config, params, toks)
    assert capped.dtype == jnp.float32 and float(jnp.abs(capped).max()) < 0.5
    np.testing.assert_allclose(capped, 0.5 * np.tanh(np.asarray(raw, np.float64) / 0.5), **TOL)
    assert_control_fails(raw, capped)  # negative control: no soft cap


# ----------------------------------------------------------------------------- the model: per-layer dispatch


def composed_logits(layer_configs, params, toks):
    """Embedding, then block i run as a model whose every layer is layer i's kind, then the head."""
    model = DecoderLM(layer_configs[0])
    x = model.apply({"params": params}, toks, jnp.arange(T), method=DecoderLM.embed)
    for i, config in enumerate(layer_configs):
        x = Block(config, layer=i).apply({"params": params[f"blocks_{i}"]}, x, positions=jnp.arange(T))
    return model.apply({"params": params}, x, method=DecoderLM.logits)


PATTERNS = {  # name: (pattern settings, each layer's uniform settings, the negative control's settings)
    "local_global": (dict(sliding_window=W, layer_pattern=(LOCAL, GLOBAL)),
                     [dict(sliding_window=W), dict()], dict()),
    "rope_base_per_layer": (dict(sliding_window=W, layer_pattern=(LayerKind(local=True, rope_theta=10.0), GLOBAL),
                                 rope_theta=10_000.0),
                            [dict(sliding_window=W, rope_theta=10.0), dict(rope_theta=10_000.0)],
                            dict(sliding_window=W, layer_pattern=(LOCAL, GLOBAL), rope_theta=10_000.0)),
    "nope": (dict(layer_pattern=(GLOBAL, NOPE)), [dict(), dict(positions="none")], dict()),
    "partial_rotary": (dict(d_model=32, layer_pattern=(LayerKind(rotary_fraction=0.5), GLOBAL)),
                       [dict(d_model=32, rotary_fraction=0.5), dict(d_model=32)], dict(d_model=32)),
}


@pytest.mark.parametrize("name", PATTERNS)
def test_each_layer_runs_its_own_kind(name):
    settings, layers, control = PATTERNS[name]
    config = config_for(**settings)
    params, toks = model_params(config), tokens()
    got = logits(config, params, toks)
    np.testing.assert_allclose(got, composed_logits([config_for(**c) for c in layers], params, toks), **TOL)
    assert_control_fails(logits(config_for(**control), params, toks), got)  # all global, one base, all RoPE, full


# ----------------------------------------------------------------------------- cached decoding


KINDS = {  # every new kind of layer, in a model that mixes it with a plain global RoPE layer
    "local": dict(sliding_window=W, layer_pattern=(LOCAL, GLOBAL)),
    "nope": dict(layer_pattern=(NOPE, GLOBAL)),
    "soft_capped": dict(attn_logits_soft_cap=0.3),
    "sinks": dict(attn_sinks=True),
    "partial_rotary": dict(layer_pattern=(LayerKind(rotary_fraction=0.5), GLOBAL)),
    "gemma_like": dict(sliding_window=W, layer_pattern=(LayerKind(local=True, rope_theta=100.0), GLOBAL),
                       attn_logits_soft_cap=0.5, final_logits_soft_cap=2.0, attn_scale=0.3, qk_norm="head",
                       norm_placement="sandwich", norm_unit_offset=True, embed_multiplier=4.0, mlp="geglu"),
    "olmo2_like": dict(qk_norm="full", norm_placement="post"),
    "neox_like": dict(norm="layernorm", mlp="gelu", residual="parallel", use_bias=True, rotary_fraction=0.5),
}


def decoded_logits(config, params, toks, kernels=Kernels()):
    """Prefill 4 tokens, then decode the rest one at a time: `[B, T, V]`."""
    model = DecoderLM(config, kernels)
    cache = init_cache(config, toks.shape[0], 16)
    steps, cache = model.apply({"params": params}, toks[:, :4], cache, method=DecoderLM.extend)
    steps = [steps]
    for t in range(4, T):
        step, cache = model.apply({"params": params}, toks[:, t:t + 1], cache, method=DecoderLM.extend)
        steps.append(step)
    return jnp.concatenate(steps, axis=1)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("attention", ["mha", "gqa", "mla"])
def test_cached_decoding_equals_full_recomputation(kind, attention):
    settings = KINDS[kind]
    if attention == "mla" and ("rotary_fraction" in str(settings)):
        settings = {k: v for k, v in settings.items() if k != "rotary_fraction"}
        if kind == "partial_rotary":
            pytest.skip("MLA's rotary dims are already separate: the config refuses rotary_fraction")
    if attention == "mla" and settings.get("qk_norm", "none") != "none":
        settings = {**settings, "qk_norm": "none"}  # MLA normalises its latents instead
    config = config_for(attention, **settings)
    params, toks = model_params(config), tokens()
    full = logits(config, params, toks)
    np.testing.assert_allclose(decoded_logits(config, params, toks), full, **TOL)
    if attention == "mla":  # full sequences through the naive path, the cache always absorbs
        np.testing.assert_allclose(logits(config, params, toks, Kernels(mla="absorb")), full, **TOL)


@pytest.mark.parametrize("kernels", [Kernels(attention="custom_vjp", decode="xla_cpu"),
                                     Kernels(attention="chunked", decode="blocked")], ids=["custom_vjp", "chunked"])
def test_the_fast_kernels_run_every_feature_values_and_gradients(kernels):
    config = config_for("gqa", **KINDS["gemma_like"], attn_sinks=True)
    params, toks = model_params(config), tokens()

    def loss(p, k):
        return jnp.mean(jax.nn.log_softmax(logits(config, p, toks, k))[..., 0])

    value_and_grad = jax.jit(jax.value_and_grad(loss), static_argnums=1)
    value, grads = value_and_grad(params, Kernels())
    fast_value, fast_grads = value_and_grad(params, kernels)
    np.testing.assert_allclose(fast_value, value, **TOL)
    chex.assert_trees_all_close(fast_grads, grads, atol=1e-5, rtol=1e-4)
    assert float(jnp.abs(grads["blocks_0"]["attn"]["sinks"]).max()) > 0  # the sinks learn
    np.testing.assert_allclose(decoded_logits(config, params, toks, kernels), logits(config, params, toks), **TOL)


# ----------------------------------------------------------------------------- weights, names, sharding


def test_attention_weights_come_back_per_layer_with_the_windows_and_sinks():
    config = config_for("gqa", num_layers=3, sliding_window=W, layer_pattern=(LOCAL, GLOBAL), attn_sinks=True)
    params, toks = model_params(config), tokens()
    model = DecoderLM(config)
    out, weights = jax.jit(lambda p, t: attention_weights(model, {"params": p}, t))(params, toks)
    np.testing.assert_allclose(out, logits(config, params, toks), **TOL)
    assert len(weights) == 3
    for i, w in enumerate(weights):
        chex.assert_shape(w, (2, config.num_heads, T, T))
        assert float(jnp.abs(jnp.triu(w, 1)).max()) == 0.0
        assert float(w.sum(-1).max()) < 1.0  # the sink's share is not a key's
        assert (float(jnp.abs(jnp.tril(w, -W)).max()) == 0.0) == (i != 1)  # layers 0 and 2 are local
    # Applying without the collection mutable computes no weights.
    assert isinstance(model.apply({"params": params}, toks), jax.Array)


def test_new_parameters_carry_logical_axes_the_mesh_rules_know():
    config = config_for("gqa", d_model=32, qk_norm="full", attn_sinks=True, norm_placement="sandwich")
    names = flatten_dict(sharding.logical_names(config))
    attn = {path[2:]: pair for path, pair in names.items() if path[:2] == ("blocks_0", "attn")}
    assert attn[("sinks",)] == (("heads",), (4,))
    assert attn[("q_norm", "scale")] == (("heads",), (32,)) and attn[("k_norm", "scale")] == (("kv_heads",), (16,))
    assert {("blocks_1", "post_attn_norm", "scale"), ("blocks_1", "post_mlp_norm", "scale")} <= set(names)
    layout = sharding.param_layout(config, MeshShape(tensor=2))
    specs = flatten_dict(layout.specs)
    assert specs[("blocks_0", "attn", "sinks")] == jax.sharding.PartitionSpec("tensor")
    assert specs[("blocks_0", "attn", "k_norm", "scale")] == jax.sharding.PartitionSpec("tensor")
