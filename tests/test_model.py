"""DecoderLM: causality for every attention kind x position scheme, training, padding, counts."""


import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxattn.config import MLAConfig, ModelConfig
from jaxattn.kernels import Kernels
from jaxattn.model import DecoderLM, attention_weights, count_params
from tiny_models import (FAST_KERNELS, KINDS, POSITIONS, T, VOCAB, learned_params, params_for, tiny_config,
                         tiny_kernels)

def init(config, batch=2, length=T, seed=0):
    """Params (shared across position schemes, see `params_for`) and random tokens."""
    tokens = jax.random.randint(jax.random.PRNGKey(seed), (batch, length), 0, VOCAB)
    return params_for(config), tokens


def forward(config, kernels=Kernels(), **kwargs):
    """`(params, tokens) -> DecoderLM(config, kernels).apply(...)`, run eagerly (tiny shapes
    compile faster op by op than as one program)."""
    return lambda p, tok: DecoderLM(config, kernels).apply({"params": p}, tok, **kwargs)


@pytest.mark.parametrize("positions", POSITIONS)
@pytest.mark.parametrize("kind", KINDS)
def test_changing_token_t_never_changes_earlier_logits(kind, positions):
    config = tiny_config(kind, positions)
    params, tokens = init(config)
    t = 5
    changed = tokens.at[:, t].set((tokens[:, t] + 1) % VOCAB)
    both = forward(config, tiny_kernels(kind))(params, jnp.concatenate([tokens, changed]))
    before, after = both[:2], both[2:]
    chex.assert_shape(before, (2, T, VOCAB))
    assert before.dtype == jnp.float32
    np.testing.assert_allclose(before[:, :t], after[:, :t], atol=1e-6, rtol=0)
    assert np.abs(before[:, t:] - after[:, t:]).max() > 1e-4  # and the change is seen from t on


@pytest.mark.parametrize("kind", KINDS)
def test_a_few_gradient_steps_decrease_the_loss(kind):
    config = tiny_config(kind, "rope" if kind.startswith("mla") else "learned")
    params, tokens = init(config, batch=4, length=T + 1)
    model = DecoderLM(config, tiny_kernels(kind))

    def loss_fn(p):
        logits = model.apply({"params": p}, tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    opt = optax.adam(1e-2)
    state = opt.init(params)

    @jax.jit  # one program per kind: compiled once, where running it eagerly compiles each operation
    def step(p, s):
        loss, grads = jax.value_and_grad(loss_fn)(p)
        updates, s = opt.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss

    losses = []
    for _ in range(5):
        params, state, loss = step(params, state)
        losses.append(float(loss))
    assert losses[-1] < losses[0] - 0.1, losses


@pytest.mark.parametrize("kind", ["gqa", "mla_naive", "mla_absorb"])
def test_training_kernels_keep_the_float32_model_within_bfloat16_rounding(kind):
    """The kernels a CPU with AMX-BF16 trains with (bfloat16 matmuls, the custom attention
    backward) change speed, not the model: same params, logits and gradients within bf16 rounding."""
    config = tiny_config(kind, "rope")
    reference, fast = tiny_kernels(kind), FAST_KERNELS.replace(mla=tiny_kernels(kind).mla)
    params, tokens = init(config, batch=4, length=T + 1)

    def loss_fn(kernels):
        def loss(p):
            logits = DecoderLM(config, kernels).apply({"params": p}, tokens[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
        return jax.jit(jax.value_and_grad(loss))

    (loss32, g32), (loss16, g16) = loss_fn(reference)(params), loss_fn(fast)(params)
    np.testing.assert_allclose(loss16, loss32, rtol=1e-2)
    for a, b in zip(jax.tree_util.tree_leaves(g16), jax.tree_util.tree_leaves(g32)):
        scale = float(jnp.abs(b).max())
        np.testing.assert_allclose(a, b, atol=0.05 * scale, rtol=0)
    steps = optax.adam(1e-2)
    state, value_and_grad = steps.init(params), loss_fn(fast)

    @jax.jit
    def update(params, state, grads):
        updates, state = steps.update(grads, state, params)
        return optax.apply_updates(params, updates), state
    losses = []
    for _ in range(5):
        loss, grads = value_and_grad(params)
        params, state = update(params, state, grads)
        losses.append(float(loss))
    assert losses[-1] < losses[0] - 0.1, losses


def test_building_and_running_a_model_never_looks_at_the_hardware(monkeypatch):
    """Kernels are chosen when a program resolves its run, never while a model is built:
    with the detection made to fail, a model (default kernels) still builds, runs and decodes,
    and "auto" kernels say they need resolving."""
    from jaxattn import decoding
    from jaxattn.kernels import select

    def no_detection(*args, **kwargs):
        raise AssertionError("hardware detection while building or running a model")
    monkeypatch.setattr(select.Platform, "detect", classmethod(no_detection))
    monkeypatch.setattr(select, "read_cpu_flags", no_detection)
    config = tiny_config("gqa", "rope")
    params, tokens = init(config)
    chex.assert_shape(forward(config)(params, tokens), (2, T, VOCAB))
    out = decoding.generate(params, config, np.asarray(tokens[:, :3]), np.array([3, 3]), max_new_tokens=2,
                            rng=jax.random.PRNGKey(0))
    chex.assert_shape(out.tokens, (2, 2))
    with pytest.raises(ValueError, match=r'Kernels.attention is "auto": resolve it .*resolve_kernels'):
        forward(config, Kernels.auto())(params, tokens)
    with pytest.raises(ValueError, match=r'Kernels.matmul is "auto": resolve it .*resolve_kernels'):
        forward(config, Kernels.auto().replace(attention="xla"))(params, tokens)


@pytest.mark.parametrize("kind", ["gqa", "mla_absorb"])
def test_right_padding_does_not_change_the_real_tokens(kind):
    config = tiny_config(kind, "rope")
    params, tokens = init(config)
    length = 5
    pad = jnp.arange(T)[None, :] < jnp.array([[T], [length]])  # row 1 has 5 real tokens
    kernels = tiny_kernels(kind)
    padded = forward(config, kernels, padding_mask=pad)(params, tokens)
    alone = forward(config, kernels)(params, tokens[1:, :length])
    np.testing.assert_allclose(padded[1, :length], alone[0], atol=1e-5, rtol=1e-5)
    full = forward(config, kernels)(params, tokens[:1])
    np.testing.assert_allclose(padded[0], full[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["mha", "mqa", "mla_naive"])
def test_attention_weights_are_one_causal_distribution_per_layer(kind):
    config = tiny_config(kind)
    params, tokens = init(config)
    model = DecoderLM(config, tiny_kernels(kind))
    logits, weights = attention_weights(model, {"params": params}, tokens)
    np.testing.assert_array_equal(logits, model.apply({"params": params}, tokens))  # the same forward pass
    assert len(weights) == config.num_layers
    for w in weights:
        chex.assert_shape(w, (2, config.num_heads, T, T))
        np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-5)
        assert float(jnp.abs(jnp.triu(w, k=1)).max()) == 0.0


def test_dropout_only_when_not_deterministic():
    config = tiny_config("gqa", dropout=0.3)
    params, tokens = init(config)
    a = forward(config)(params, tokens)
    b = forward(config)(params, tokens)
    c = forward(config, Kernels(), deterministic=False, rngs={"dropout": jax.random.PRNGKey(3)})(params, tokens)
    np.testing.assert_array_equal(a, b)
    assert np.abs(a - c).max() > 1e-4


def test_bfloat16_compute_and_params_give_float32_logits():
    config = tiny_config("mla_absorb", "rope", dtype="bfloat16", param_dtype="bfloat16")
    params, tokens = init(config)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree_util.tree_leaves(params))
    logits = forward(config, tiny_kernels("mla_absorb"))(params, tokens)
    assert logits.dtype == jnp.float32 and bool(jnp.isfinite(logits).all())


def test_untied_head_and_swiglu_rmsnorm_build():
    config = tiny_config("gqa", "rope", tie_embeddings=False, mlp="swiglu", norm="rmsnorm")
    params, tokens = init(config)
    chex.assert_shape(params["lm_head"]["kernel"], (16, VOCAB))
    chex.assert_shape(params["blocks_0"]["mlp"]["gate_up"]["kernel"], (16, 64))
    chex.assert_shape(forward(config)(params, tokens), (2, T, VOCAB))


def gpt2_formula(V, P, D, L, F):
    """GPT-2 with tied embeddings, biases everywhere, LayerNorm with bias."""
    embeddings = V * D + P * D
    layer_norm = 2 * D
    attention = (D * 3 * D + 3 * D) + (D * D + D)  # c_attn, c_proj
    mlp = (D * F + F) + (F * D + D)  # c_fc, c_proj
    return embeddings + L * (2 * layer_norm + attention + mlp) + layer_norm


def test_gpt2_small_parameter_count_matches_the_closed_form():
    config = ModelConfig(vocab_size=50257, d_model=768, num_layers=12, num_heads=12,
                         max_seq_len=1024, positions="learned", norm="layernorm", mlp="gelu",
                         use_bias=True, tie_embeddings=True)
    shapes = nn.unbox(jax.eval_shape(lambda: DecoderLM(config).init(
        jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32)))["params"])
    expected = gpt2_formula(V=50257, P=1024, D=768, L=12, F=3072)
    assert expected == 124_439_808  # the published GPT-2 small count (with wpe)
    assert count_params(shapes) == expected


def test_gqa_and_mla_parameter_counts_match_their_formulas():
    D, L, N, K, H, F, V, P = 16, 2, 4, 2, 4, 32, VOCAB, 12
    params, _ = init(tiny_config("gqa"))
    attention = D * (N + 2 * K) * H + N * H * D
    per_layer = 2 * D + attention + 2 * D * F  # two LayerNorms (scale only: no bias), MLP
    assert count_params(params) == V * D + P * D + L * per_layer + D

    R, Pn, E, Vh, Q = 8, 4, 4, 4, 8
    params, _ = init(tiny_config("mla_absorb"))
    mla = (D * Q + Q + Q * N * (Pn + E)) + (D * (R + E) + R + R * N * (Pn + Vh)) + N * Vh * D
    per_layer = 2 * D + mla + 2 * D * F
    assert count_params(params) == V * D + P * D + L * per_layer + D


def test_one_name_per_concept_and_derived_sizes_follow_replace():
    config = ModelConfig(d_model=128, num_heads=4)
    assert (config.num_kv_heads, config.head_dim, config.mlp_hidden) == (4, 32, 512)
    wider = config.replace(d_model=256, num_heads=8)
    assert (wider.num_kv_heads, wider.head_dim, wider.mlp_hidden) == (8, 32, 1024)  # derived again
    gqa = ModelConfig(num_heads=4, num_kv_heads=2, head_dim=16)
    assert gqa.replace(num_heads=8).num_kv_heads == 2 and gqa.replace(d_model=64).head_dim == 16  # as given
    assert ModelConfig(num_kv_heads=None) == ModelConfig(num_kv_heads=4)
    assert ModelConfig.from_dict(gqa.to_dict()) == gqa
    mla = ModelConfig(mla=MLAConfig(kv_lora_rank=16))
    assert mla.attention == "mla" and config.attention == "standard"
    assert ModelConfig.from_dict(mla.to_dict()) == mla


def test_init_follows_nanogpt():
    config = ModelConfig(vocab_size=64, d_model=128, num_layers=8, num_heads=4, mlp_hidden=512)
    params = nn.unbox(DecoderLM(config).init(jax.random.PRNGKey(0), jnp.zeros((1, 2), jnp.int32))["params"])
    block = params["blocks_0"]
    assert abs(float(block["attn"]["qkv"]["kernel"].std()) - 0.02) < 0.002
    residual = 0.02 / np.sqrt(2 * 8)
    for kernel in (block["attn"]["out"]["kernel"], block["mlp"]["c_proj"]["kernel"]):
        assert abs(float(kernel.std()) - residual) < 0.1 * residual


def test_bad_configs_and_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        tiny_config("mha", num_kv_heads=3)
    with pytest.raises(ValueError, match="not divisible by num_heads"):
        ModelConfig(d_model=30, num_heads=4)
    with pytest.raises(TypeError, match="ModelConfig.mla must be a jaxattn.MLAConfig"):
        ModelConfig(mla={"kv_lora_rank": 8})
    with pytest.raises(ValueError, match=r"Kernels.matmul must be one of \('xla', 'bfloat16', 'bfloat16_cpu', 'native_cpu', 'auto'\)"):
        Kernels(matmul="float16")
    with pytest.raises(ValueError, match=r"Kernels.attention must be one of \('xla', 'custom_vjp', 'causal_blocks', 'chunked', 'cudnn', 'splash', "
                                         r"'auto_cpu', 'auto_gpu', 'auto_tpu', 'auto'\)"):
        Kernels(attention="flash")
    with pytest.raises(ValueError, match="ModelConfig.head_dim must be a positive integer"):
        ModelConfig(head_dim=0)
    with pytest.raises(ValueError, match="even d_model"):
        learned_params(tiny_config("mha", "sinusoidal", d_model=15, num_heads=3, head_dim=5))
    with pytest.raises(ValueError, match="MLAConfig.q_lora_rank must be a positive integer"):
        MLAConfig(q_lora_rank=0)
    with pytest.raises(ValueError, match="qk_rope_head_dim must be even"):
        MLAConfig(qk_rope_head_dim=3)
    with pytest.raises(TypeError, match="kernels must be a jaxattn.Kernels"):
        DecoderLM(tiny_config("mha"), {"attention": "xla"}).init(jax.random.PRNGKey(0), jnp.zeros((1, 2), jnp.int32))
    config = tiny_config("mha")
    params, tokens = init(config)
    model = DecoderLM(config)
    with pytest.raises(ValueError, match="exceeds max_seq_len=12"):
        model.apply({"params": params}, jnp.zeros((1, 13), jnp.int32))
    with pytest.raises(ValueError, match=r"tokens must be \[B, T\]"):
        model.apply({"params": params}, tokens[0])
    with pytest.raises(TypeError, match="integer ids"):
        model.apply({"params": params}, tokens.astype(jnp.float32))
    with pytest.raises(ValueError, match="padding_mask"):
        model.apply({"params": params}, tokens, padding_mask=jnp.ones((2, 3), bool))
