"""Layers compiled once (`ModelConfig.scan_layers`, `jaxattn.scan_plan`): the plan, the layouts,
and the scanned model equal to the unrolled one (logits, gradients, cached decoding, attention
weights, layer losses), for uniform, patterned, mixed dense/MoE, value-embedding and MLA models."""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from jaxattn import LayerKind, MLAConfig, ModelConfig, MoEConfig, hf, sharding
from jaxattn.axes import MeshShape
from jaxattn.cache.build import init_cache
from jaxattn.decoding import generate
from jaxattn.layer_losses import COLLECTION, mean_over_layers
from jaxattn.model import DecoderLM, attention_weights
from jaxattn.scan_plan import LayerPlan, plan_layers, stack_caches, stack_params, unstack_caches, unstack_params
from train.config import TrainConfig
from train.run import optim

LOCAL, GLOBAL = LayerKind(local=True), LayerKind()
BASE = dict(vocab_size=61, d_model=32, num_heads=4, num_kv_heads=2, max_seq_len=32, positions="rope",
            norm="rmsnorm", mlp="swiglu", mlp_hidden=48)
CONFIGS = {
    "uniform": ModelConfig(**BASE, num_layers=4),
    # Gemma 3's period: five local layers and one global; 14 layers = 2 periods and 2 left over.
    "pattern": ModelConfig(**BASE, num_layers=14, sliding_window=4, layer_pattern=(LOCAL,) * 5 + (GLOBAL,)),
    # DeepSeek: a dense first layer before the mixtures of experts.
    "moe_dense_first": ModelConfig(**BASE, num_layers=4, dense_layers=(0,),
                                   moe=MoEConfig(num_experts=4, experts_per_token=2, expert_hidden=16)),
    "value_embeddings": ModelConfig(**{**BASE, "positions": "learned"}, num_layers=6, value_embeddings=1),
    "mla": ModelConfig(**{**BASE, "num_kv_heads": None}, num_layers=3,
                       mla=MLAConfig(kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4)),
}


def scanned(config):
    return config.replace(scan_layers=True)


def test_plans():
    assert plan_layers(CONFIGS["uniform"]) == LayerPlan(4, first=4, period=1, repeats=0)  # not asked to scan
    assert plan_layers(scanned(CONFIGS["uniform"])) == LayerPlan(4, first=0, period=1, repeats=4)
    pattern = plan_layers(scanned(CONFIGS["pattern"]))
    assert (pattern.first, pattern.period, pattern.repeats, pattern.suffix) == (0, 6, 2, (12, 13))
    moe = plan_layers(scanned(CONFIGS["moe_dense_first"]))
    assert (moe.prefix, moe.period, moe.repeats) == ((0,), 1, 3)
    values = plan_layers(scanned(CONFIGS["value_embeddings"]))  # tables in the first and last layer only
    assert (values.prefix, values.period, values.repeats, values.suffix) == ((0,), 1, 4, (5,))
    assert [kind for kind, _ in pattern.units] == ["scanned"] * 6 + ["layer"] * 2
    assert pattern.unit_layers()[1] == (1, 7) and pattern.layer(1, 5) == 11


def test_scan_layers_must_be_a_bool():
    with pytest.raises(TypeError, match="scan_layers"):
        ModelConfig(scan_layers="yes")


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request):
    """(name, unrolled config, scanned config, unrolled params, the same params stacked, tokens)."""
    config = CONFIGS[request.param]
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 9), 0, config.vocab_size)
    params = nn.unbox(DecoderLM(config).init(jax.random.PRNGKey(0), tokens)["params"])
    return request.param, config, scanned(config), params, stack_params(params, scanned(config)), tokens


def test_layouts_convert_both_ways(pair):
    _, config, scan, params, stacked, _ = pair
    plan = plan_layers(scan)
    fresh = nn.unbox(jax.eval_shape(lambda: DecoderLM(scan).init(jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32))))
    chex.assert_trees_all_equal_shapes_and_dtypes(stacked, fresh["params"])  # the layout the scanned model makes
    for j in range(plan.period):
        leaf = jax.tree.leaves(stacked["layers"][f"blocks_{j}"])[0]
        assert leaf.shape[0] == plan.repeats
    chex.assert_trees_all_equal(unstack_params(stacked, scan), params)
    assert stack_params(stacked, scan) is stacked and unstack_params(params, config) is params


def test_logits_and_gradients_equal_the_unrolled_model(pair):
    _, config, scan, params, stacked, tokens = pair

    def loss(model, p):
        logits = model.apply({"params": p}, tokens)
        return -jnp.mean(jax.nn.log_softmax(logits)[..., 0]), logits

    (want_loss, want), want_grads = jax.value_and_grad(lambda p: loss(DecoderLM(config), p), has_aux=True)(params)
    (got_loss, got), got_grads = jax.value_and_grad(lambda p: loss(DecoderLM(scan), p), has_aux=True)(stacked)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    chex.assert_trees_all_close(unstack_params(got_grads, scan), want_grads, atol=2e-6, rtol=1e-4)


def test_cached_decoding_equals_the_unrolled_model(pair):
    name, config, scan, params, stacked, tokens = pair
    lengths = jnp.array([9, 5])
    kwargs = dict(max_new_tokens=6, rng=jax.random.PRNGKey(3), temperature=0.0, return_logits=True)
    want = generate(params, config, tokens, lengths, **kwargs)
    got = generate(stacked, scan, tokens, lengths, **kwargs)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_allclose(got.logits, want.logits, atol=5e-5, rtol=1e-5)


def test_the_dense_cache_follows_the_plan(pair):
    _, config, scan, _, _, _ = pair
    plan, cache = plan_layers(scan), init_cache(scan, 2, 8)
    assert len(cache.layers) == len(plan.units)
    for (kind, _), layer in zip(plan.units, cache.layers):
        lead = jax.tree.leaves(layer)[0].shape[0]
        assert lead == (plan.repeats if kind == "scanned" else 2)
    unrolled = init_cache(config, 2, 8).layers
    restacked = stack_caches(unstack_caches(cache.layers, scan), scan)
    chex.assert_trees_all_equal_shapes(unstack_caches(cache.layers, scan), unrolled)
    chex.assert_trees_all_equal_shapes(restacked, cache.layers)


def test_attention_weights_and_layer_losses_in_layer_order(pair):
    name, config, scan, params, stacked, tokens = pair
    _, want = attention_weights(DecoderLM(config), {"params": params}, tokens)
    _, got = attention_weights(DecoderLM(scan), {"params": stacked}, tokens)
    assert len(got) == len(want) == config.num_layers
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=1e-6)
    if config.moe is not None:
        _, want_state = DecoderLM(config).apply({"params": params}, tokens, mutable=[COLLECTION])
        _, got_state = DecoderLM(scan).apply({"params": stacked}, tokens, mutable=[COLLECTION])
        want_losses, got_losses = mean_over_layers(want_state), mean_over_layers(got_state)
        assert set(got_losses) == set(want_losses) and want_losses
        for key in want_losses:
            np.testing.assert_allclose(got_losses[key], want_losses[key], rtol=1e-5)


def test_a_paged_step_refuses_scanned_layers():
    config = scanned(CONFIGS["uniform"])
    params = nn.unbox(jax.eval_shape(lambda: DecoderLM(config).init(jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32))))
    with pytest.raises(ValueError, match="unrolled"):
        DecoderLM(config).apply(params, jnp.zeros((2,), jnp.int32), (), None, method="extend_paged")


def test_stacking_names_the_missing_layers():
    config = scanned(CONFIGS["uniform"])
    with pytest.raises(ValueError, match="blocks_0"):
        stack_params({"wte": {}}, config)


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_training_steps_equal_the_unrolled_model(optimizer):
    """Three optimizer steps from the same weights give the same losses and weights: Muon
    orthogonalises each layer's matrix (not the stack), and decay skips each layer's norms."""
    config = CONFIGS["uniform"]
    tc = TrainConfig(optimizer=optimizer, lr=1e-2, muon_lr=2e-2, weight_decay=0.1, warmup_iters=0)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 9), 0, config.vocab_size)
    params = nn.unbox(DecoderLM(config).init(jax.random.PRNGKey(0), tokens)["params"])

    def run(cfg, p):
        opt = optim.make_optimizer(tc, sharding.logical_names(cfg))
        state, losses = opt.init(p), []
        loss_fn = lambda q: -jnp.mean(jax.nn.log_softmax(DecoderLM(cfg).apply({"params": q}, tokens))[..., 1])  # noqa: E731
        for _ in range(3):
            loss, grads = jax.value_and_grad(loss_fn)(p)
            updates, state = opt.update(grads, state, p)
            p = optax.apply_updates(p, updates)
            losses.append(float(loss))
        return losses, p

    want_losses, want = run(config, params)
    got_losses, got = run(scanned(config), stack_params(params, scanned(config)))
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5)
    chex.assert_trees_all_close(unstack_params(got, scanned(config)), want, atol=1e-5, rtol=1e-4)


def test_hugging_face_save_and_load_through_the_scan(tmp_path):
    """A scanned model saves the files an unrolled one saves, and loads back stacked."""
    config = CONFIGS["uniform"]
    tokens = jax.random.randint(jax.random.PRNGKey(1), (1, 6), 0, config.vocab_size)
    params = nn.unbox(DecoderLM(config).init(jax.random.PRNGKey(0), tokens)["params"])
    hf.save_pretrained(tmp_path / "unrolled", config, params)
    hf.save_pretrained(tmp_path / "scanned", scanned(config), stack_params(params, scanned(config)))
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / "unrolled" / name).read_bytes() == (tmp_path / "scanned" / name).read_bytes()
    loaded_config, loaded = hf.load_pretrained(tmp_path / "scanned", scan_layers=True)
    assert loaded_config.scan_layers and "layers" in loaded
    np.testing.assert_allclose(DecoderLM(loaded_config).apply({"params": loaded}, tokens),
                               DecoderLM(config).apply({"params": params}, tokens), atol=2e-5)


def test_mesh_specs_keep_the_layer_axis_whole():
    """A stacked parameter splits as one layer's would, with its leading layer axis whole; so does
    a stacked cache (meshes themselves run in tests/mesh_script.py)."""
    config, mesh = CONFIGS["uniform"], MeshShape(fsdp=2, tensor=2)
    unrolled = sharding.param_layout(config, mesh).specs
    stacked = sharding.param_layout(scanned(config), mesh).specs["layers"]["blocks_0"]
    for path, spec in jax.tree_util.tree_leaves_with_path(stacked, is_leaf=lambda x: isinstance(x, P)):
        one_layer = unrolled["blocks_0"]
        for key in path:
            one_layer = one_layer[key.key]
        assert tuple(spec) == (None, *one_layer), path
    cache = init_cache(scanned(config), 4, 8)
    specs = sharding.cache_specs(cache, scanned(config), mesh)
    assert tuple(specs.layers[0].k)[0] is None and tuple(specs.layers[0].k)[1:] == \
        tuple(sharding.cache_specs(init_cache(config, 4, 8), config, mesh).layers[0].k)


def test_an_int8_cache_decodes_alike_scanned_and_unrolled():
    config = CONFIGS["pattern"]
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 9), 0, config.vocab_size)
    params = nn.unbox(DecoderLM(config).init(jax.random.PRNGKey(0), tokens)["params"])
    kwargs = dict(max_new_tokens=6, rng=jax.random.PRNGKey(3), temperature=0.0, return_logits=True, kv_cache="int8")
    want = generate(params, config, tokens, jnp.array([9, 5]), **kwargs)
    got = generate(stack_params(params, scanned(config)), scanned(config), tokens, jnp.array([9, 5]), **kwargs)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_allclose(got.logits, want.logits, atol=5e-5, rtol=1e-5)
