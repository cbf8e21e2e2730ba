"""The optimizers of train.run.optim: Muon against a NumPy reference, its parameter groups, the
learning-rate and momentum schedules, and Muon on a device mesh (tests/train/run/optim_mesh_script.py)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxattn import sharding
from jaxattn.config import LayerKind, MLAConfig, ModelConfig
from train.config import TrainConfig, load_config
from train.run import optim

ROOT = Path(__file__).resolve().parents[3]
NS_COEFFS = (3.4445, -4.7750, 2.0315)  # Jordan's quintic Newton-Schulz (optax.contrib.scale_by_muon's default)
NS_STEPS = 5
EPS = 1e-8  # optax's Muon (Frobenius normalisation) and AdamW eps


# ------------------------------------------------------------------------- NumPy references

def newton_schulz(m: np.ndarray) -> np.ndarray:
    """Muon's orthogonalisation in float64: Frobenius-normalise, 5 quintic steps on the wide side."""
    x = m / (np.linalg.norm(m) + EPS)
    transposed = x.shape[0] > x.shape[1]
    if transposed:
        x = x.T
    a, b, c = NS_COEFFS
    for _ in range(NS_STEPS):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if transposed else x


def warmup_lr(peak: float, step: int, warmup: int) -> float:
    return peak * (step + 1) / (warmup + 1)


def momentum(tc: TrainConfig, step: int) -> float:
    ratio = min(step / tc.muon_momentum_warmup, 1.0)
    return tc.muon_momentum_start + ratio * (tc.muon_momentum - tc.muon_momentum_start)


class MuonReference:
    """Two steps of optax's scale_by_muon (Nesterov), shape scale, decoupled decay and lr, for one matrix."""

    def __init__(self, tc: TrainConfig):
        self.tc, self.mu, self.step = tc, 0.0, 0

    def update(self, g: np.ndarray, p: np.ndarray) -> np.ndarray:
        tc, k = self.tc, self.step
        beta = momentum(tc, k)
        self.mu = beta * self.mu + (1 - beta) * g
        # Bias corrections at counts k + 2 (the momentum) and k + 1 (the gradient), as optax's Nesterov.
        mu_hat = beta * self.mu / (1 - beta ** (k + 2)) + (1 - beta) * g / (1 - beta ** (k + 1))
        fan_in, fan_out = g.shape[0], math.prod(g.shape[1:])
        ortho = newton_schulz(mu_hat.reshape(fan_in, fan_out)).reshape(g.shape)
        scaled = ortho * math.sqrt(max(1.0, fan_out / fan_in)) + tc.weight_decay * p
        self.step += 1
        return -warmup_lr(tc.muon_lr, k, tc.warmup_iters) * scaled


class AdamWReference:
    """nanoGPT's AdamW (optax.adamw, eps 1e-8) for one leaf, `decay` where the mask says so."""

    def __init__(self, tc: TrainConfig, decay: bool):
        self.tc, self.decay, self.mu, self.nu, self.step = tc, decay, 0.0, 0.0, 0

    def update(self, g: np.ndarray, p: np.ndarray) -> np.ndarray:
        tc, k = self.tc, self.step
        self.mu = tc.beta1 * self.mu + (1 - tc.beta1) * g
        self.nu = tc.beta2 * self.nu + (1 - tc.beta2) * g * g
        mu_hat, nu_hat = self.mu / (1 - tc.beta1 ** (k + 1)), self.nu / (1 - tc.beta2 ** (k + 1))
        self.step += 1
        return -warmup_lr(tc.lr, k, tc.warmup_iters) * (
            mu_hat / (np.sqrt(nu_hat) + EPS) + (tc.weight_decay * p if self.decay else 0.0))


# A hand-made params tree: two hidden matrices (one wide, one tall: Newton-Schulz transposes it),
# one 3-D matrix like MLA's wkv_b, an embedding table and a norm scale.
NAMES = {"up": {"kernel": (("embed", "mlp"), (8, 12))},
         "down": {"kernel": (("mlp", "embed"), (12, 8))},
         "wkv_b": (("latent", "heads", "head_dim"), (4, 2, 3)),
         "wte": {"embedding": (("vocab", "embed"), (5, 8))},
         "norm": {"scale": (("embed",), (8,))}}
MUON_LEAVES = {"up/kernel", "down/kernel", "wkv_b"}


def _key(k) -> str:
    return str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))


def _flat(tree) -> dict:
    """{"a/b/c": leaf} of a params-like tree."""
    return {"/".join(_key(k) for k in path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _is_pair(x) -> bool:  # a leaf of the logical-names tree: (names, shape)
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], tuple)


def _arrays(names, draw) -> dict:
    return jax.tree.map(lambda pair: draw(pair[1]), names, is_leaf=_is_pair)


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_two_muon_steps_equal_the_numpy_reference(weight_decay):
    # Warmups short enough that the lr and Muon's momentum differ between the two steps.
    tc = TrainConfig(optimizer="muon", grad_clip=0.0, weight_decay=weight_decay, warmup_iters=3, lr=1e-3,
                     min_lr=1e-4, muon_lr=0.02, muon_momentum_start=0.85, muon_momentum=0.95,
                     muon_momentum_warmup=2)
    assert tc.warmup_iters > 1  # both steps in the lr warmup, where lr = peak * (step + 1) / (warmup + 1)
    rng = np.random.default_rng(0)
    draw = lambda: _arrays(NAMES, lambda shape: jnp.asarray(rng.normal(size=shape), jnp.float32))  # noqa: E731
    params = draw()
    optimizer = optim.make_optimizer(tc, NAMES)
    state, update = optimizer.init(params), jax.jit(optimizer.update)
    references = {name: MuonReference(tc) if name in MUON_LEAVES
                  else AdamWReference(tc, decay=name == "wte/embedding")  # matrices (and embeddings) decay
                  for name in _flat(params)}
    assert set(references) == MUON_LEAVES | {"wte/embedding", "norm/scale"}
    for step in range(2):
        grads = draw()
        updates, state = update(grads, state, params)
        got, g, p = (_flat(jax.tree.map(lambda x: np.asarray(x, np.float64), t)) for t in (updates, grads, params))
        for name, reference in references.items():
            expected = reference.update(g[name], p[name])
            # float32 against float64 through 5 Newton-Schulz steps: errors ~1e-6 of the update's size.
            np.testing.assert_allclose(got[name], expected, rtol=1e-5, atol=1e-7, err_msg=f"{name} step {step}")
        params = optax.apply_updates(params, updates)


def test_adam_leaves_get_exactly_optax_adamw():
    """The "adam" group is nanoGPT's AdamW itself (optax.adamw with train.run.optim's schedule and mask)."""
    tc = TrainConfig(optimizer="muon", grad_clip=0.0, warmup_iters=3)
    rng = np.random.default_rng(1)
    params = {"wte": {"embedding": jnp.asarray(rng.normal(size=(5, 8)), jnp.float32)},
              "norm": {"scale": jnp.asarray(rng.normal(size=(8,)), jnp.float32)}}
    names = {"wte": {"embedding": NAMES["wte"]["embedding"]}, "norm": {"scale": NAMES["norm"]["scale"]}}
    ours, theirs = optim.make_optimizer(tc, names), optax.adamw(
        optim.lr_schedule(tc), b1=tc.beta1, b2=tc.beta2, weight_decay=tc.weight_decay,
        mask={"wte": {"embedding": True}, "norm": {"scale": False}})
    s_ours, s_theirs, p_ours, p_theirs = ours.init(params), theirs.init(params), params, params
    for _ in range(3):
        grads = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.float32), params)
        u_ours, s_ours = ours.update(grads, s_ours, p_ours)
        u_theirs, s_theirs = theirs.update(grads, s_theirs, p_theirs)
        for a, b in zip(jax.tree.leaves(u_ours), jax.tree.leaves(u_theirs)):
            np.testing.assert_array_equal(a, b)
        p_ours, p_theirs = optax.apply_updates(p_ours, u_ours), optax.apply_updates(p_theirs, u_theirs)


def test_newton_schulz_output_is_near_orthogonal():
    """Jordan's coefficients trade exact orthogonality for speed: the singular values of the result
    lie in about (0.7, 1.15), well inside (0.5, 1.5), whatever the spread of the input's."""
    g = np.random.default_rng(2).normal(size=(32, 64))
    spread = np.linalg.svd(g, compute_uv=False)
    assert spread.max() / spread.min() > 3  # not already near-orthogonal
    reference = newton_schulz(g)
    singular = np.linalg.svd(reference, compute_uv=False)
    assert 0.5 < singular.min() and singular.max() < 1.5, singular
    # The optimizer's first update: Newton-Schulz is scale-free, so it is -lr * sqrt(64/32) * NS(g).
    tc = TrainConfig(optimizer="muon", grad_clip=0.0, weight_decay=0.0, warmup_iters=0)
    names = {"w": (("embed", "mlp"), (32, 64))}
    optimizer = optim.make_optimizer(tc, names)
    params = {"w": jnp.zeros((32, 64), jnp.float32)}
    updates, _ = optimizer.update({"w": jnp.asarray(g, jnp.float32)}, optimizer.init(params), params)
    np.testing.assert_allclose(np.asarray(updates["w"]), -tc.muon_lr * math.sqrt(2.0) * reference,
                               rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------------- parameter groups

def _layers(n: int, *suffixes: str) -> set:
    return {f"blocks_{i}/{s}" for i in range(n) for s in suffixes}


TINY = dict(vocab_size=65, d_model=32, num_layers=2, num_heads=4, max_seq_len=16)
MLA = MLAConfig(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, q_lora_rank=16)
# model -> (config, muon paths, adam paths)
GROUPS = {
    "baby_mha": (load_config("shakespeare_char_baby").model,  # rope, layernorm without biases, tied head
                 _layers(4, "attn/qkv/kernel", "attn/out/kernel", "mlp/c_fc/kernel", "mlp/c_proj/kernel"),
                 _layers(4, "attn_norm/scale", "mlp_norm/scale") | {"final_norm/scale", "wte/embedding"}),
    "gqa": (ModelConfig(**TINY, num_kv_heads=2, fused_qkv=False),
            _layers(2, "attn/query/kernel", "attn/key/kernel", "attn/value/kernel", "attn/out/kernel",
                    "mlp/c_fc/kernel", "mlp/c_proj/kernel"),
            _layers(2, "attn_norm/scale", "mlp_norm/scale") | {"final_norm/scale", "wte/embedding",
                                                               "wpe/embedding"}),
    "mla": (ModelConfig(**TINY, mla=MLA, positions="rope"),  # wkv_b [latent, heads, head_dim] is a matrix
            _layers(2, "attn/wq_a/kernel", "attn/wq_b/kernel", "attn/wkv_a/kernel", "attn/wkv_b",
                    "attn/wo/kernel", "mlp/c_fc/kernel", "mlp/c_proj/kernel"),
            _layers(2, "attn/q_norm/scale", "attn/kv_norm/scale", "attn_norm/scale", "mlp_norm/scale")
            | {"final_norm/scale", "wte/embedding"}),
    "layer_kinds_head_norm": (
        ModelConfig(**TINY, num_kv_heads=2, positions="learned", norm="rmsnorm", sliding_window=4,
                    layer_pattern=(LayerKind(local=True), LayerKind()), attn_sinks=True, qk_norm="head",
                    use_bias=True, tie_embeddings=False),
        _layers(2, "attn/qkv/kernel", "attn/out/kernel", "mlp/c_fc/kernel", "mlp/c_proj/kernel"),
        _layers(2, "attn/qkv/bias", "attn/out/bias", "mlp/c_fc/bias", "mlp/c_proj/bias", "attn/sinks",
                "attn/q_norm/scale", "attn/k_norm/scale", "attn_norm/scale", "mlp_norm/scale")
        | {"final_norm/scale", "wte/embedding", "wpe/embedding", "lm_head/kernel"}),
    "layer_kinds_full_norm": (
        ModelConfig(**TINY, num_kv_heads=2, positions="rope", norm="rmsnorm", qk_norm="full", mlp="swiglu",
                    attn_sinks=True, norm_placement="sandwich", tie_embeddings=False),
        _layers(2, "attn/qkv/kernel", "attn/out/kernel", "mlp/gate_up/kernel", "mlp/down/kernel"),
        _layers(2, "attn/sinks", "attn/q_norm/scale", "attn/k_norm/scale", "attn_norm/scale", "mlp_norm/scale",
                "post_attn_norm/scale", "post_mlp_norm/scale") | {"final_norm/scale", "wte/embedding",
                                                                  "lm_head/kernel"}),
}


@pytest.mark.parametrize("model", list(GROUPS))
def test_parameter_groups(model):
    config, muon, adam = GROUPS[model]
    names = sharding.logical_names(config)
    groups = _flat(optim.param_groups(names))
    assert {p for p, g in groups.items() if g == optim.MUON} == muon
    assert {p for p, g in groups.items() if g == optim.ADAM} == adam
    # optax.partition follows the labels: Muon's momentum holds exactly the Muon group.
    shapes = _arrays(names, lambda shape: jax.ShapeDtypeStruct(shape, jnp.float32))
    state = jax.eval_shape(optim.make_optimizer(TrainConfig(optimizer="muon"), names).init, shapes)
    momenta = {"/".join(_key(k) for k in path[path.index("mu") + 1:])
               for path in (tuple(_key(k) for k in p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0])
               if optim.MUON in path and "mu" in path}
    assert momenta == muon


def test_param_group_is_decided_by_the_axis_names():
    assert optim.param_group(("embed", "mlp")) == optim.MUON
    assert optim.param_group(("latent", "heads", "head_dim")) == optim.MUON
    assert optim.param_group((None, None)) == optim.MUON  # a matrix with unnamed axes is still hidden
    for names in [("vocab", "embed"), ("embed", "vocab"), ("position", "embed"), ("length", "embed"),
                  ("embed",), ("heads",), ()]:
        assert optim.param_group(names) == optim.ADAM, names


def test_muon_needs_the_models_logical_names():
    with pytest.raises(ValueError, match="optimizer 'muon' needs the model's logical_names"):
        optim.make_optimizer(TrainConfig(optimizer="muon"))
    optim.make_optimizer(TrainConfig(optimizer="adamw"))  # AdamW does not


def test_shape_scale_is_optax_muons_width_scale():
    assert optim.shape_scale((8, 12)) == pytest.approx(math.sqrt(12 / 8))
    assert optim.shape_scale((12, 8)) == 1.0
    assert optim.shape_scale((16, 4, 16)) == pytest.approx(2.0)  # fan_out = 4 * 16
    dims = optim.muon_dimensions(jnp.zeros((16, 4, 16)))
    assert tuple(np.atleast_1d(dims.reduction_axis)) == (0,) and tuple(dims.output_axis) == (1, 2)


# ------------------------------------------------------------------------- schedules

def nanogpt_lr(it: int, peak: float, low: float, warmup: int, decay_iters: int) -> float:
    """nanoGPT train.py's get_lr."""
    if it < warmup:
        return peak * (it + 1) / (warmup + 1)
    if it > decay_iters:
        return low
    ratio = (it - warmup) / (decay_iters - warmup)
    return low + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (peak - low)


@pytest.mark.parametrize("peak", [None, 1e-3, 0.02])
def test_cosine_schedule_is_nanogpts_with_min_lr_scaled_like_the_peak(peak):
    tc = TrainConfig(lr=1e-3, min_lr=1e-4, warmup_iters=100, lr_decay_iters=2000)
    top = tc.lr if peak is None else peak
    low = tc.min_lr * top / tc.lr  # 0.002 for Muon's 0.02
    schedule = optim.lr_schedule(tc, peak)
    for it in (0, 1, 50, 99, 100, 101, 700, 1000, 1999, 2000, 2001, 5000):
        assert float(schedule(it)) == pytest.approx(nanogpt_lr(it, top, low, 100, 2000), rel=1e-6), it


def wsd_lr(it: int, peak: float, low: float, warmup: int, decay_iters: int, fraction: float) -> float:
    if it < warmup:
        return peak * (it + 1) / (warmup + 1)
    start = decay_iters * (1 - fraction)
    if it <= start:
        return peak
    if it >= decay_iters:
        return low
    return peak + (it - start) / (decay_iters - start) * (low - peak)


@pytest.mark.parametrize("peak", [None, 0.02])
def test_wsd_schedule_warms_up_stays_flat_then_decays_linearly(peak):
    tc = TrainConfig(schedule="wsd", lr=1e-3, min_lr=1e-4, warmup_iters=10, lr_decay_iters=100,
                     decay_fraction=0.2)
    top = tc.lr if peak is None else peak
    low = tc.min_lr * top / tc.lr
    schedule = optim.lr_schedule(tc, peak)
    values = {it: float(schedule(it)) for it in range(0, 121)}
    for it, value in values.items():
        assert value == pytest.approx(wsd_lr(it, top, low, 10, 100, 0.2), rel=1e-6), it
    assert values[9] == pytest.approx(top * 10 / 11, rel=1e-6)  # warmup
    assert all(values[it] == pytest.approx(top, rel=1e-7) for it in range(10, 81))  # flat until step 80
    assert values[90] == pytest.approx((top + low) / 2, rel=1e-6)  # halfway down at 90
    assert all(values[it] == pytest.approx(low, rel=1e-6) for it in range(100, 121))
    assert all(values[a] > values[a + 1] for a in range(80, 100))  # strictly decreasing in the decay


def test_wsd_edges_no_decay_and_all_decay():
    flat = optim.lr_schedule(TrainConfig(schedule="wsd", warmup_iters=5, lr_decay_iters=50, decay_fraction=0.0))
    assert [float(flat(it)) for it in (5, 20, 49)] == pytest.approx([1e-3] * 3, rel=1e-6)
    assert [float(flat(it)) for it in (51, 100)] == pytest.approx([1e-4] * 2, rel=1e-6)
    tc = TrainConfig(schedule="wsd", warmup_iters=5, lr_decay_iters=50, decay_fraction=1.0)
    linear = optim.lr_schedule(tc)
    for it in (0, 4, 5, 6, 25, 49, 50, 51, 80):  # the decay spans the whole run; the warmup overrides it
        assert float(linear(it)) == pytest.approx(wsd_lr(it, 1e-3, 1e-4, 5, 50, 1.0), rel=1e-6), it
    assert float(linear(25)) == pytest.approx(1e-3 - 0.5 * 9e-4, rel=1e-6)


def test_wsd_without_decay_is_at_min_lr_at_lr_decay_iters():
    flat = optim.lr_schedule(TrainConfig(schedule="wsd", warmup_iters=5, lr_decay_iters=50, decay_fraction=0.0))
    assert float(flat(50)) == pytest.approx(1e-4, rel=1e-6)


def test_momentum_schedule_warms_up_linearly():
    tc = TrainConfig(muon_momentum_start=0.85, muon_momentum=0.95, muon_momentum_warmup=300)
    schedule = optim.momentum_schedule(tc)
    for step, expected in [(0, 0.85), (75, 0.875), (150, 0.90), (299, 0.85 + 0.1 * 299 / 300), (300, 0.95),
                           (301, 0.95), (10_000, 0.95)]:
        assert float(schedule(step)) == pytest.approx(expected, rel=1e-6), step
    with pytest.raises(ValueError, match="muon_momentum_start=0.95 is above muon_momentum=0.9: the warm-up"):
        tc.replace(muon_momentum_start=0.95, muon_momentum=0.9)  # a warm-up that would lower it is refused


def test_momentum_without_warmup_is_muon_momentum_from_the_start():
    tc = TrainConfig(muon_momentum_start=0.85, muon_momentum=0.95, muon_momentum_warmup=0)
    assert float(optim.momentum_schedule(tc)(0)) == pytest.approx(0.95, rel=1e-6)


@pytest.mark.parametrize("field,value", [("schedule", "linear"), ("optimizer", "sgd"), ("decay_fraction", -0.1),
                                         ("decay_fraction", 1.5), ("muon_lr", 0.0), ("muon_lr", -0.02),
                                         ("muon_momentum", 1.0), ("muon_momentum", 0.0),
                                         ("muon_momentum_start", 1.2), ("muon_momentum_start", 0.0),
                                         ("muon_momentum_warmup", -1)])
def test_train_config_rejects_bad_optimizer_settings(field, value):
    with pytest.raises(ValueError, match=f"TrainConfig.{field} "):
        TrainConfig(**{field: value})


# ------------------------------------------------------------------------- Muon on a mesh

RTOL = 2e-5  # tests/test_mesh.py's: sharding reorders float32 sums
ENV = {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}, "PYTHONPATH": str(ROOT)}


@pytest.fixture(scope="module")
def meshes():
    done = subprocess.run([sys.executable, str(Path(__file__).parent / "optim_mesh_script.py")], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_muon_on_a_mesh_equals_one_device(meshes, kind):
    one = meshes[kind]["data:1"]
    assert len(one["losses"]) == 5 and one["losses"][-1] < one["losses"][0] - 0.1
    # The WSD schedule of the script: warmup 2, flat, decay from step 3 to min_lr at step 6.
    np.testing.assert_allclose(one["lrs"], [1e-3, 2e-3, 3e-3, 3e-3, 3e-3 - (3e-3 - 3e-4) / 3], rtol=1e-6)
    assert len(meshes[kind]) > 1
    for mesh, run in meshes[kind].items():
        np.testing.assert_allclose(run["losses"], one["losses"], rtol=RTOL, err_msg=f"{kind} on {mesh}")


@pytest.mark.slow
def test_muon_momentum_lies_like_its_matrix(meshes):
    for kind, runs in meshes.items():
        for mesh, run in runs.items():
            for group, watched in run["watched"].items():
                where = f"{kind} {group} on {mesh}"
                assert len(watched["state"]) == (1 if group == optim.MUON else 2), where  # Muon: mu; Adam: mu, nu
                assert watched["state"] == [watched["param"]] * len(watched["state"]), where  # StateLayout
                assert watched["state_arrays"] == watched["state"], where  # what the steps returned
                assert watched["state_shards"] == [watched["shard"]] * len(watched["state"]), where
    # The specs are the rules' (not all replicated): a matrix split over both axes of a 2x2 mesh.
    muon = {(kind, mesh): run["watched"][optim.MUON] for kind, runs in meshes.items() for mesh, run in runs.items()}
    assert muon["mha", "fsdp:2,tensor:2"]["param"] == ["fsdp", "tensor"]  # qkv [32, 96]
    assert muon["mha", "fsdp:2,tensor:2"]["shard"] == [16, 48]
    assert muon["mha", "data:2,fsdp:2"]["param"] == ["fsdp", None]
    assert muon["mla", "fsdp:2,tensor:2"]["param"] == ["fsdp", "tensor", None]  # wkv_b [16, 4, 16]
    assert muon["mla", "fsdp:2,tensor:2"]["shard"] == [8, 2, 16]
