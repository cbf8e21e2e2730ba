"""Mixture-of-experts MLPs (jaxattn.layers.moe, jaxattn.kernels.moe).

* every implementation of the routed experts equals the dense reference, values and gradients,
  including experts that receive no row;
* each family's router and whole MoE block equal transformers' module with the same weights, and
  each routing feature matters: switched off, the same weights miss by far (a negative control);
* the two router losses equal their formulas (and transformers' balancing loss).
"""

import dataclasses
import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn import ModelConfig, layer_losses
from jaxattn.kernels import Kernels, Platform, resolve_kernels
from jaxattn.kernels import moe as moe_kernels
from jaxattn.layers.moe import (LOSS_NAMES, ROUTING, ExpertWeights, MoE, MoEConfig, RouterWeights, experts_dense,
                         gate_matrix, load_balancing_loss, route, router_z_loss)

D = 16
TOL = dict(atol=1e-5, rtol=1e-5)
# GPT-OSS's routed experts, by their maths: the clamped SwiGLU, biased projections, interleaved columns.
CLAMPED = dict(activation="clamped_swiglu", expert_bias=True, gate_up_interleaved=True)
SOWN = [layer_losses.COLLECTION, ROUTING[0]]


def sown(module: MoE, params, x, **kwargs):
    """`(y, losses {name: scalar}, routing {"router_logits", "expert_index", "gate"})` of one call."""
    y, state = module.apply({"params": params}, x, mutable=SOWN, **kwargs)
    return y, {name: state[layer_losses.COLLECTION][name][0] for name in LOSS_NAMES}, state[ROUTING[0]][ROUTING[1]][0]
# The alternatives to the reference; "auto_cpu" runs one of them per call (the module test runs it).
IMPLS = [name for name in moe_kernels.IMPLEMENTATIONS if name not in ("dense", "auto_cpu")]


def model(d_model=D) -> ModelConfig:
    return ModelConfig(d_model=d_model, num_heads=2)


def random_params(module: MoE, x, seed=0, scale=0.3):
    """The module's params re-drawn at random (biases and the correction bias too), unboxed."""
    params = nn.unbox(jax.eval_shape(module.init, jax.random.PRNGKey(seed), x))["params"]  # shapes only
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(seed + 1), len(leaves))
    return jax.tree.unflatten(tree, [scale * jax.random.normal(k, leaf.shape, leaf.dtype)
                                     for k, leaf in zip(keys, leaves)])


# --------------------------------------------------------------------------------------------
# grouped == dense


def expert_weights(E, F, biased, seed):
    rng = np.random.default_rng(seed)
    draw = lambda *shape: jnp.asarray(0.3 * rng.standard_normal(shape), jnp.float32)  # noqa: E731
    biases = (draw(E, 2 * F), draw(E, D)) if biased else ()
    return ExpertWeights(draw(E, D, 2 * F), draw(E, F, D), *biases)


def routing(E, K, M, skewed, rng):
    """K distinct experts per row among the first half of the experts (the rest receive no row at
    all); `skewed`: expert 0 in every row, so it fills several tiles of "grouped_cpu"."""
    if not skewed:
        return np.stack([rng.choice(max(E // 2, K), K, replace=False) for _ in range(M)])
    return np.stack([np.concatenate([[0], 1 + rng.choice(E // 2 - 1, K - 1, replace=False)]) for _ in range(M)])


SWIGLU = dict(activation="swiglu")
CASES = {  # (E, K, M, experts, skewed)
    "4-1-9-swiglu": (4, 1, 9, SWIGLU, False), "8-2-33-clamped": (8, 2, 33, CLAMPED, False),
    "16-4-3-swiglu": (16, 4, 3, SWIGLU, False), "64-8-40-clamped": (64, 8, 40, CLAMPED, False),
    "8-2-70-swiglu-skewed": (8, 2, 70, SWIGLU, True)}


@functools.cache
def _grouped_answers(case):
    """`(index, {implementation: (y, (loss, gradients wrt x, gate, weights))})` for the dense reference and
    every alternative, one compiled program per case."""
    E, K, M, experts, skewed = CASES[case]
    cfg = MoEConfig(num_experts=E, experts_per_token=K, expert_hidden=8, **experts)
    rng = np.random.default_rng(E * 100 + M)
    x = jnp.asarray(rng.standard_normal((M, D)), jnp.float32)
    index = jnp.asarray(routing(E, K, M, skewed, rng), jnp.int32)
    if skewed:  # the layout really overflows: expert 0's rows past its first tile go to overflow tiles
        assert M > 2 * moe_kernels.tile_rows(M * K, E)
    gate = jnp.asarray(rng.random((M, K)), jnp.float32)
    weights = expert_weights(E, 8, cfg.expert_bias, seed=E + K)

    def answers(x, gate, weights):
        out = {}
        for name in ["dense", *IMPLS]:
            def loss(x, gate, weights, fn=moe_kernels.IMPLEMENTATIONS[name]):  # the loss, and y as its aux
                y = fn(x, index, gate, weights, cfg)
                return jnp.sum(y * jnp.cos(jnp.arange(y.size, dtype=jnp.float32).reshape(y.shape))), y
            (value, y), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(x, gate, weights)
            out[name] = (y, (value, grads))
        return out
    return index, jax.jit(answers)(x, gate, weights)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", CASES)
def test_grouped_equals_dense_values_and_gradients(impl, case):
    E, K, M, _, skewed = CASES[case]
    index, answers = _grouped_answers(case)
    y_ref, (v_ref, g_ref) = answers["dense"]
    y, (v, g) = answers[impl]
    chex.assert_shape(y, (M, D))
    chex.assert_type(y, jnp.float32)
    np.testing.assert_allclose(y, y_ref, **TOL)
    np.testing.assert_allclose(v, v_ref, rtol=1e-5)
    chex.assert_trees_all_close(g, g_ref, atol=2e-5, rtol=1e-5)
    unused = np.setdiff1d(np.arange(E), np.asarray(index))
    assert unused.size and not np.any(np.asarray(g[2].gate_up)[unused])  # no row, no gradient


def test_dense_reference_is_the_gate_weighted_sum_of_every_expert():
    cfg = MoEConfig(num_experts=4, experts_per_token=2, expert_hidden=8)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, D)).astype(np.float32)
    gates = rng.random((5, 4)).astype(np.float32) * (rng.random((5, 4)) < 0.5)
    w = expert_weights(4, 8, False, seed=3)
    expected = sum(gates[:, [e]] * ((lambda gu: gu[:, :8] / (1 + np.exp(-gu[:, :8])) * gu[:, 8:])(
        x @ np.asarray(w.gate_up[e])) @ np.asarray(w.down[e])) for e in range(4))
    np.testing.assert_allclose(experts_dense(jnp.asarray(x), jnp.asarray(gates), w, cfg), expected, **TOL)


def test_the_module_equals_across_implementations_and_jits():
    cfg = MoEConfig(num_experts=8, experts_per_token=2, expert_hidden=8, num_shared_experts=1,
                    shared_expert_hidden=8, shared_gate=True, scoring="sigmoid", correction_bias=True,
                    n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.0)
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 7, D))
    dense = MoE(model(), cfg, Kernels(moe="dense"))
    params = random_params(dense, x)

    def loss(module, params, x):
        y, losses, routing = sown(module, params, x)
        return jnp.sum(jnp.sin(y)) + losses["load_balancing_loss"] + losses["router_z_loss"], (y, routing)

    grads = jax.jit(jax.grad(loss, argnums=(1, 2), has_aux=True), static_argnums=0)  # one program per module
    ref, (y_ref, _) = grads(dense, params, x)
    for impl in IMPLS + ["auto"]:
        kernels = resolve_kernels(Kernels(moe=impl), Platform("cpu"))[0]
        got, (y, routing) = grads(MoE(model(), cfg, kernels), params, x)
        chex.assert_shape([y, routing["router_logits"], routing["expert_index"], routing["gate"]],
                          [(2, 7, D), (2, 7, 8), (2, 7, 2), (2, 7, 2)])
        chex.assert_type([routing["expert_index"], routing["router_logits"]], [jnp.int32, jnp.float32])
        np.testing.assert_allclose(y, y_ref, **TOL)
        chex.assert_trees_all_close(got, ref, atol=2e-5, rtol=1e-5)
    assert not np.any(ref[0]["router_correction_bias"])  # selection only: no gradient


# --------------------------------------------------------------------------------------------
# each family against transformers


def _t(a):
    return jnp.asarray(a.detach().numpy())


def _shared_params(mlp, gate=None):
    out = {"shared_gate_up": {"kernel": jnp.concatenate([_t(mlp.gate_proj.weight).T, _t(mlp.up_proj.weight).T], 1)},
           "shared_down": {"kernel": _t(mlp.down_proj.weight).T}}
    if gate is not None:
        out["shared_expert_gate"] = {"kernel": _t(gate.weight).T}
    return out


def _experts_params(experts):  # transformers' [E, 2F, D] (gate rows, then up rows) and [E, D, F]
    return {"experts_gate_up": _t(experts.gate_up_proj).transpose(0, 2, 1),
            "experts_down": _t(experts.down_proj).transpose(0, 2, 1)}


def _deepseek(version):
    from transformers.models.deepseek_v2.configuration_deepseek_v2 import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe
    from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    common = dict(hidden_size=D, moe_intermediate_size=8, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                  topk_group=2, n_shared_experts=2, routed_scaling_factor=2.5, experts_implementation="eager",
                  num_attention_heads=2, num_key_value_heads=2)
    if version == 3:
        block = DeepseekV3MoE(DeepseekV3Config(**common, norm_topk_prob=True))
        cfg = MoEConfig(num_experts=16, experts_per_token=4, expert_hidden=8, scoring="sigmoid", n_group=4,
                        topk_group=2, group_score="top2_sum", correction_bias=True, norm_topk_prob=True,
                        routed_scaling_factor=2.5, num_shared_experts=2, shared_expert_hidden=8)
    else:
        block = DeepseekV2Moe(DeepseekV2Config(**common, topk_method="group_limited_greedy"))
        cfg = MoEConfig(num_experts=16, experts_per_token=4, expert_hidden=8, scoring="softmax", n_group=4,
                        topk_group=2, group_score="max", routed_scaling_factor=2.5, num_shared_experts=2,
                        shared_expert_hidden=8)
    _randomise(block)
    if version == 3:  # a correction bias as large as the sigmoid scores' spread: it changes choices
        block.gate.e_score_correction_bias.copy_(0.3 * __import__("torch").randn(16))
    params = {"router_kernel": _t(block.gate.weight).T, **_experts_params(block.experts),
              **_shared_params(block.shared_experts)}
    if version == 3:
        params["router_correction_bias"] = _t(block.gate.e_score_correction_bias)
    return block, block.gate, cfg, params, lambda out: out


def _qwen(version):
    from transformers.models.qwen2_moe.configuration_qwen2_moe import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    common = dict(hidden_size=D, moe_intermediate_size=8, num_experts=8, num_experts_per_tok=2,
                  experts_implementation="eager")
    if version == 2:  # Qwen1.5-MoE does not renormalise; its gated shared expert
        block = Qwen2MoeSparseMoeBlock(Qwen2MoeConfig(**common, shared_expert_intermediate_size=12,
                                                      norm_topk_prob=False))
        cfg = MoEConfig(num_experts=8, experts_per_token=2, expert_hidden=8, num_shared_experts=1,
                        shared_expert_hidden=12, shared_gate=True)
    else:
        block = Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(**common, norm_topk_prob=True))
        cfg = MoEConfig(num_experts=8, experts_per_token=2, expert_hidden=8, norm_topk_prob=True)
    _randomise(block)
    params = {"router_kernel": _t(block.gate.weight).T, **_experts_params(block.experts)}
    if version == 2:
        params.update(_shared_params(block.shared_expert, block.shared_expert_gate))
    return block, block.gate, cfg, params, lambda out: out


def _mixtral():
    from transformers.models.mixtral.configuration_mixtral import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    block = MixtralSparseMoeBlock(MixtralConfig(hidden_size=D, intermediate_size=8, num_local_experts=8,
                                                num_experts_per_tok=2, experts_implementation="eager"))
    _randomise(block)
    cfg = MoEConfig(num_experts=8, experts_per_token=2, expert_hidden=8, norm_topk_prob=True)
    return block, block.gate, cfg, {"router_kernel": _t(block.gate.weight).T, **_experts_params(block.experts)}, \
        lambda out: out


def _gpt_oss():
    from transformers.models.gpt_oss.configuration_gpt_oss import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
    block = GptOssMLP(GptOssConfig(hidden_size=D, intermediate_size=8, num_local_experts=8, num_experts_per_tok=2,
                                   experts_implementation="eager"))
    _randomise(block, scale=1.5, down=0.05)  # gate/up past the clamp at 7 for some units; outputs O(1)
    e = block.experts
    params = {"router_kernel": _t(block.router.weight).T, "router_bias": _t(block.router.bias),
              "experts_gate_up": _t(e.gate_up_proj), "experts_gate_up_bias": _t(e.gate_up_proj_bias),
              "experts_down": _t(e.down_proj), "experts_down_bias": _t(e.down_proj_bias)}  # the same layout
    cfg = MoEConfig(num_experts=8, experts_per_token=2, expert_hidden=8, softmax_after_topk=True,
                    router_bias=True, **CLAMPED)
    return block, block.router, cfg, params, lambda out: out[0]


def _randomise(block, scale=0.5, down=None):
    """Every parameter redrawn: the router's at std 1 (decisive choices), `down_proj`'s at `down`."""
    import torch
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in block.named_parameters():
            std = 1.0 if "gate.weight" in name or "router" in name else scale
            p.copy_(torch.randn(p.shape) * (down if down is not None and "down_proj" in name else std))


FAMILIES = {"deepseek_v3": lambda: _deepseek(3), "deepseek_v2": lambda: _deepseek(2),
            "qwen2_moe": lambda: _qwen(2), "qwen3_moe": lambda: _qwen(3), "mixtral": _mixtral, "gpt_oss": _gpt_oss}

# What each negative control switches off; the same weights must then miss by far.
CONTROLS = {
    "deepseek_v3": {"softmax, not sigmoid": dict(scoring="softmax"), "no group limit": dict(n_group=1, topk_group=1),
                    "no correction bias": dict(correction_bias=False), "unnormalised top-k": dict(norm_topk_prob=False),
                    "no shared expert": dict(num_shared_experts=0, shared_expert_hidden=0),
                    "no scaling factor": dict(routed_scaling_factor=1.0)},
    "deepseek_v2": {"sigmoid, not softmax": dict(scoring="sigmoid"), "no group limit": dict(n_group=1, topk_group=1),
                    "no scaling factor": dict(routed_scaling_factor=1.0),
                    "normalised top-k": dict(norm_topk_prob=True)},
    "qwen2_moe": {"no shared-expert gate": dict(shared_gate=False),
                  "no shared expert": dict(num_shared_experts=0, shared_expert_hidden=0, shared_gate=False),
                  "normalised top-k": dict(norm_topk_prob=True)},
    "qwen3_moe": {"unnormalised top-k": dict(norm_topk_prob=False)},
    "mixtral": {"unnormalised top-k": dict(norm_topk_prob=False)},
    "gpt_oss": {"softmax over all E": dict(softmax_after_topk=False),
                "no clamp": dict(swiglu_limit=1e6), "plain swiglu": dict(activation="swiglu"),
                "halves, not interleaved": dict(gate_up_interleaved=False)},
}


def _ours(cfg, params, x):
    module = MoE(model(), cfg, Kernels(moe="dense"))
    wanted = nn.unbox(jax.eval_shape(module.init, jax.random.PRNGKey(0), x))["params"]
    return np.asarray(module.apply({"params": {name: params[name] for name in wanted}}, x))


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_equals_transformers_and_each_feature_matters(family):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    block, router, cfg, params, output = FAMILIES[family]()
    x = torch.randn(2, 24, D, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = output(block(x)).numpy()
        logits, weights, indices = router(x.reshape(-1, D))
    xj = jnp.asarray(x.numpy())
    index, gate, our_logits = route(xj.reshape(-1, D), RouterWeights(
        params["router_kernel"], params.get("router_bias"), params.get("router_correction_bias")), cfg)
    np.testing.assert_allclose(our_logits, logits.numpy(), **TOL)
    theirs = np.sort(indices.numpy(), axis=1)
    np.testing.assert_array_equal(np.sort(np.asarray(index), axis=1), theirs)
    by_index = lambda i, w: np.take_along_axis(np.asarray(w), np.argsort(np.asarray(i), axis=1), 1)  # noqa: E731
    np.testing.assert_allclose(by_index(index, gate), by_index(indices.numpy(), weights.numpy()), **TOL)
    for impl in ("dense", "grouped_cpu"):
        y = MoE(model(), cfg, Kernels(moe=impl)).apply({"params": params}, xj)
        np.testing.assert_allclose(y, expected, **TOL)
    scale = np.abs(expected).max()
    for what, change in CONTROLS[family].items():
        miss = np.abs(_ours(cfg.replace(**change), params, xj) - expected).max()
        assert miss > 1e-2 * scale, f"{family}: {what} changes nothing ({miss:.2e})"


# --------------------------------------------------------------------------------------------
# the losses


def numpy_balance(logits, k, mask):
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    chosen = np.argsort(-probs, axis=-1)[:, :k]
    E, w = logits.shape[-1], mask.astype(np.float64)
    f = np.array([(w[:, None] * (chosen == e)).sum() for e in range(E)]) / w.sum()
    P = (probs * w[:, None]).sum(0) / w.sum()
    return E * np.sum(f * P)


def test_losses_equal_their_formulas_and_transformers():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((2, 3, 5, 8)).astype(np.float32) * 2  # [layers, B, T, E]
    mask = rng.random((3, 5)) < 0.7
    both = np.broadcast_to(mask, (2, 3, 5))
    got = load_balancing_loss(jnp.asarray(logits), 2, jnp.asarray(both))
    np.testing.assert_allclose(got, numpy_balance(logits.reshape(-1, 8), 2, both.reshape(-1)), rtol=1e-5)
    ones = np.ones(30, bool)
    np.testing.assert_allclose(load_balancing_loss(jnp.asarray(logits[0]), 3),
                               numpy_balance(logits[0].reshape(-1, 8), 3, ones[:15]), rtol=1e-5)
    z = np.log(np.exp(logits.astype(np.float64)).sum(-1)) ** 2
    np.testing.assert_allclose(router_z_loss(jnp.asarray(logits)), z.mean(), rtol=1e-5)
    np.testing.assert_allclose(router_z_loss(jnp.asarray(logits), jnp.asarray(both)), z[both].mean(), rtol=1e-5)
    torch = pytest.importorskip("torch")
    mixtral = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
    layers = tuple(torch.from_numpy(layer.reshape(-1, 8)) for layer in logits)  # one [B*T, E] per layer
    theirs = mixtral.load_balancing_loss_func(layers, 8, 2, torch.from_numpy(mask.astype(np.int64)))
    np.testing.assert_allclose(got, theirs.item(), rtol=1e-5)
    balanced = jnp.log(jnp.eye(4) + 1e-9)  # each of 4 rows sends everything to its own expert
    np.testing.assert_allclose(load_balancing_loss(balanced, 1), 1.0, rtol=1e-5)


def test_module_losses_and_their_weighted_sum():
    cfg = MoEConfig(num_experts=4, experts_per_token=2, expert_hidden=8, aux_loss_coef=0.01, z_loss_coef=0.001)
    x = jax.random.normal(jax.random.PRNGKey(2), (2, 5, D))
    module = MoE(model(), cfg)
    params = random_params(module, x)
    mask = jnp.arange(5)[None, :] < jnp.array([[5], [3]])
    _, losses, routing = jax.jit(functools.partial(sown, module))(params, x, padding_mask=mask)
    logits = routing["router_logits"]
    np.testing.assert_allclose(losses["load_balancing_loss"], load_balancing_loss(logits, 2, mask), rtol=1e-6)
    np.testing.assert_allclose(losses["router_z_loss"], router_z_loss(logits, mask), rtol=1e-6)
    np.testing.assert_allclose(losses["aux_loss"], 0.01 * losses["load_balancing_loss"]
                               + 0.001 * losses["router_z_loss"], rtol=1e-6)
    chex.assert_rank([losses["load_balancing_loss"], losses["router_z_loss"], losses["aux_loss"]], 0)
    plain = jax.jit(module.apply)({"params": params}, x, padding_mask=mask)  # nothing mutable: y alone
    np.testing.assert_allclose(plain, sown(module, params, x, padding_mask=mask)[0], rtol=1e-6)


# --------------------------------------------------------------------------------------------
# checks, names, rules


@pytest.mark.parametrize("change, field", [
    (dict(num_experts=0), "num_experts"), (dict(experts_per_token=9), "experts_per_token"),
    (dict(scoring="relu"), "scoring"), (dict(n_group=3), "n_group"), (dict(n_group=4, topk_group=5), "topk_group"),
    (dict(n_group=4, topk_group=1, experts_per_token=3), "experts_per_token"),
    (dict(softmax_after_topk=True, scoring="sigmoid"), "softmax_after_topk"),
    (dict(num_shared_experts=1), "shared_expert_hidden"), (dict(shared_gate=True), "shared_gate"),
    (dict(activation="gelu"), "activation"), (dict(norm_topk_prob=1), "norm_topk_prob"),
    (dict(routed_scaling_factor=0.0), "routed_scaling_factor"), (dict(aux_loss_coef=-1.0), "aux_loss_coef"),
    (dict(n_group=8, topk_group=2, group_score="top2_sum"), "group_score"),
])
def test_config_errors_name_the_field(change, field):
    with pytest.raises(ValueError, match=rf"MoEConfig\.{field} must be"):
        dataclasses.replace(MoEConfig(), **change)


def test_bad_inputs_fail_before_tracing():
    cfg = MoEConfig(num_experts=4, experts_per_token=2, expert_hidden=8, router_bias=True)
    with pytest.raises(ValueError, match=r"x must have rank 2 \[M, D\], got shape \(2, 3, 16\)"):
        route(jnp.zeros((2, 3, D)), RouterWeights(jnp.zeros((D, 4)), jnp.zeros(4)), cfg)
    with pytest.raises(ValueError, match=r"router.bias must be an array of shape \(4,\)"):
        route(jnp.zeros((3, D)), RouterWeights(jnp.zeros((D, 4))), cfg)
    with pytest.raises(ValueError, match=r"router.kernel must be an array of shape \(16, 4\)"):
        route(jnp.zeros((3, D)), RouterWeights(jnp.zeros((D, 5)), jnp.zeros(4)), cfg)
    module = MoE(model(), cfg)
    with pytest.raises(ValueError, match=r"x must be \[B, T, d_model=16\], got shape \(2, 3, 8\)"):
        module.init(jax.random.PRNGKey(0), jnp.zeros((2, 3, 8)))
    with pytest.raises(ValueError, match=r"padding_mask must be \[B, T\] = \(2, 3\)"):
        module.init(jax.random.PRNGKey(0), jnp.zeros((2, 3, D)), padding_mask=jnp.ones((2, 4), bool))
    with pytest.raises(ValueError, match=r"Kernels.moe must be one of \('dense', 'grouped', 'grouped_cpu'"):
        Kernels(moe="megablocks")
    x, index, gate = jnp.zeros((3, D)), jnp.zeros((3, 2), jnp.int32), jnp.ones((3, 2))
    weights = expert_weights(4, 8, False, seed=0)
    with pytest.raises(ValueError, match=r"gate must have shape \(3, 2\) for x \(3, 16\), K=2, E=4, got \(3, 1\)"):
        moe_kernels.experts_grouped_cpu(x, index, gate[:, :1], weights, cfg)
    with pytest.raises(ValueError, match=r"weights.down must have shape \(4, 8, 16\)"):
        moe_kernels.experts_grouped(x, index, gate, weights._replace(down=weights.down[:, :4]), cfg)
    with pytest.raises(TypeError, match="expert_index must be an integer array"):
        moe_kernels.IMPLEMENTATIONS["dense"](x, index.astype(jnp.float32), gate, weights, cfg)
    with pytest.raises(ValueError, match=r"mask must have router_logits' leading shape \(3,\)"):
        load_balancing_loss(jnp.zeros((3, 4)), 2, jnp.ones((4,), bool))


def test_auto_rules():
    assert moe_kernels.rule(Platform("cpu"))[0] == "auto_cpu" == resolve_kernels(Kernels.auto(), Platform("cpu"))[0].moe
    assert moe_kernels.rule(Platform("gpu"))[0] == moe_kernels.rule(Platform("tpu"))[0] == "grouped"
    cases = {(1024, 4, 2): "grouped_cpu", (64, 4, 2): "dense", (1024, 8, 2): "grouped_cpu", (1024, 8, 4): "grouped_cpu",
             (64, 8, 4): "dense", (1024, 64, 8): "grouped_cpu", (1024, 64, 48): "dense", (1, 8, 2): "gathered",
             (4, 64, 8): "gathered", (8, 8, 2): "dense", (8, 64, 8): "dense", (32, 8, 2): "grouped_cpu"}
    picks = {case: moe_kernels.cpu_rule(*case) for case in cases}
    assert {case: pick[0] for case, pick in picks.items()} == cases
    assert all(reason for _, reason in picks.values())


def test_parameters_carry_the_expert_axis_and_shard_by_the_rules():
    from jaxattn import axes
    cfg = MoEConfig(num_experts=4, experts_per_token=2, expert_hidden=8, **CLAMPED, router_bias=True,
                    num_shared_experts=1, shared_expert_hidden=8)
    boxed = jax.eval_shape(MoE(model(), cfg).init, jax.random.PRNGKey(0), jnp.zeros((1, 2, D)))["params"]
    names = {k: tuple(v.names) if isinstance(v, nn.LogicallyPartitioned) else None for k, v in boxed.items()}
    assert names["experts_gate_up"] == ("expert", "embed", "mlp")
    assert names["experts_down"] == ("expert", "mlp", "embed")
    assert names["router_kernel"] == ("embed", "expert") and names["experts_down_bias"] == ("expert", "embed")
    mesh = axes.MeshShape(fsdp=2, tensor=2)
    spec, notes = axes.spec_for(names["experts_gate_up"], (4, D, 16), mesh)
    assert tuple(spec) == ("fsdp", None, "tensor") and not notes  # whole experts per device
    spec, notes = axes.spec_for(names["experts_gate_up"], (3, D, 16), mesh)  # 3 experts: split along embed
    assert tuple(spec) == (None, "fsdp", "tensor") and notes == ["expert (3) is replicated over fsdp (2), which does not divide it"]
    assert gate_matrix(jnp.array([[1, 3]]), jnp.array([[0.25, 0.75]]), 4).tolist() == [[0.0, 0.25, 0.0, 0.75]]
