"""Training a mixture-of-experts model: the loss adds the layers' aux_loss, the metrics log them.

Tiny models (2 layers, d_model 32, 4 experts) on a few steps; the mesh cases are in
tests/test_mesh.py (tests/mesh_script.py's "moe" kind)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn import layer_losses
from jaxattn.config import ModelConfig
from jaxattn.config.moe import MoEConfig
from jaxattn.layers.moe import LOSS_NAMES
from jaxattn.model import DecoderLM, active_params
from train.config import ExperimentConfig, RuntimeConfig, TrainConfig, load_config
from train.run import runtime as runtime_lib
from train.run.metrics import MetricsLog, describe_params
from train.run.steps import build_programs, cross_entropy

EXPERTS = MoEConfig(num_experts=4, experts_per_token=2, expert_hidden=16, aux_loss_coef=0.5, z_loss_coef=0.25)


def experiment(**model) -> ExperimentConfig:
    base = dict(vocab_size=20, d_model=32, num_layers=2, num_heads=2, max_seq_len=16, mlp_hidden=64, moe=EXPERTS)
    train = TrainConfig(batch_size=4, block_size=16, warmup_iters=1, lr=3e-3, lr_decay_iters=10, eval_iters=1)
    return ExperimentConfig(name="moe", model=ModelConfig(**{**base, **model}), train=train,
                            runtime=RuntimeConfig(mesh="data:1"))


def programs_for(config: ExperimentConfig):
    runtime = runtime_lib.resolve(config.runtime, config.train.batch_size, devices=1, model=config.model)
    return build_programs(config, runtime), runtime


def windows(n: int, config: ExperimentConfig) -> np.ndarray:
    rng = np.random.default_rng(0)
    tc = config.train
    return rng.integers(0, config.model.vocab_size, (n, tc.batch_size, tc.block_size + 1)).astype(np.int32)


def test_a_step_trains_on_cross_entropy_plus_the_layers_mean_aux_loss():
    config = experiment()
    programs, runtime = programs_for(config)
    assert runtime.kernels.moe == "auto_cpu" and bool(config.model.moe_layers)
    state = programs.init(0)
    params = jax.tree.map(np.asarray, state["params"])
    data = windows(3, config)
    _, (losses, lrs, layers) = programs.train_steps(state, jnp.asarray(data), programs.frozen)
    assert losses.shape == lrs.shape == (3,) and sorted(layers) == sorted(LOSS_NAMES)

    x, y = data[0, :, :-1], data[0, :, 1:]
    logits, sown = DecoderLM(config.model, runtime.kernels).apply({"params": params}, x,
                                                                   mutable=[layer_losses.COLLECTION])
    per_layer = {name: [float(sown[layer_losses.COLLECTION][f"blocks_{i}"]["mlp"][name][0]) for i in (0, 1)]
                 for name in ("load_balancing_loss", "router_z_loss")}
    balance, z = np.mean(per_layer["load_balancing_loss"]), np.mean(per_layer["router_z_loss"])
    ce = float(cross_entropy(logits, y))
    assert balance > 1.0 and z > 0  # 2 of 4 experts: 2 at perfect balance (k), more otherwise
    np.testing.assert_allclose(losses[0], ce + 0.5 * balance + 0.25 * z, rtol=1e-5)
    np.testing.assert_allclose([layers["load_balancing_loss"][0], layers["router_z_loss"][0]], [balance, z],
                               rtol=1e-5)
    np.testing.assert_allclose(layers["aux_loss"][0], layer_losses.mean_over_layers(sown)["aux_loss"], rtol=1e-6)
    active = active_params(config.model)  # 2 of the 2 layers' 4 experts [32, 16] idle per token
    assert describe_params(config.model, params) == (f"parameters: {active + 2 * 2 * 3 * 32 * 16:,} "
                                                     f"({active:,} active: those one token touches)")


def test_evaluation_is_the_plain_cross_entropy_and_dense_models_sow_no_layer_losses():
    config = experiment()
    programs, runtime = programs_for(config)
    params = programs.init(0)["params"]
    data = windows(1, config)
    got = programs.evaluate(params, jnp.asarray(data), jnp.ones(data[:, :, 1:].shape, jnp.float32), programs.frozen)
    logits = DecoderLM(config.model, runtime.kernels).apply({"params": params}, data[0, :, :-1])
    np.testing.assert_allclose(got[0] / data[0, :, 1:].size, cross_entropy(logits, data[0, :, 1:]), rtol=1e-5)

    dense = experiment(moe=None)
    programs, _ = programs_for(dense)
    _, outputs = programs.train_steps(programs.init(0), jnp.asarray(windows(2, dense)), programs.frozen)
    assert not dense.model.moe_layers and len(outputs) == 3 and outputs[2] == {}
    params = programs.init(0)["params"]
    assert describe_params(dense.model, params) == f"parameters: {active_params(dense.model):,}"
    assert not experiment(num_layers=1, dense_layers=(0,)).model.moe_layers  # moe set, every layer dense


def test_the_log_averages_the_layer_losses_per_interval_and_a_checkpoint_keeps_the_interval(tmp_path):
    log = MetricsLog(tmp_path / "metrics.jsonl", log_interval=2)
    sown = {"load_balancing_loss": np.array([1.0, 3.0, 5.0]), "router_z_loss": np.array([2.0, 4.0, 6.0])}
    log.add_steps(0, np.array([4.0, 6.0, 8.0]), np.array([0.1, 0.2, 0.3]), last_step=4, layer_losses=sown)
    assert log.records() == [{"step": 2, "loss": 5.0, "lr": 0.2, "load_balancing_loss": 2.0, "router_z_loss": 3.0}]
    meta = json.loads(json.dumps(log.pending_meta()))  # as a checkpoint's meta stores it
    pending = {"load_balancing_loss": [5.0], "router_z_loss": [6.0]}
    assert meta == {"interval_losses": [8.0], "interval_layer_losses": pending}
    older = {"interval_losses": [8.0], "interval_moe": pending}  # a checkpoint saved before the generic name
    for saved in (meta, older):
        resumed = MetricsLog.resumed(tmp_path / "metrics.jsonl", 2, saved)
        resumed.add_steps(3, np.array([10.0]), np.array([0.4]), last_step=4,
                          layer_losses={"load_balancing_loss": np.array([7.0]), "router_z_loss": np.array([8.0])})
        assert resumed.records()[-1] == {"step": 4, "loss": 9.0, "lr": 0.4, "load_balancing_loss": 6.0,
                                         "router_z_loss": 7.0}
    assert MetricsLog(tmp_path / "dense.jsonl", 2).pending_meta() == {"interval_losses": []}  # dense: as before


def test_the_baby_moe_config_has_about_the_babys_active_parameters():
    baby = load_config("shakespeare_char_baby", ["model.vocab_size=65"]).model
    moe = load_config("shakespeare_char_baby_moe", ["model.vocab_size=65"]).model
    assert moe.dense_layers == (0,) and moe.moe.aux_loss_coef > 0 and moe.moe.z_loss_coef > 0
    assert abs(active_params(moe) / active_params(baby) - 1) < 0.01
    from train import compare  # compare's MoE kind is this config's model
    assert load_config("shakespeare_char_baby", ["model.vocab_size=65", *compare.KINDS["MoE"]]).model == moe


def test_a_tiny_moe_run_logs_the_layer_losses(tmp_path):
    from train.run.experiment import run_experiment
    text = tmp_path / "text.txt"
    text.write_text("To be, or not to be, that is the question.\n" * 200)
    overrides = ["model.d_model=32", "model.num_layers=2", "model.num_heads=2", "model.max_seq_len=16",
                 "model.moe={num_experts = 4, experts_per_token = 2, expert_hidden = 16, aux_loss_coef = 0.01}",
                 "model.dense_layers=[0]", "train.batch_size=4", "train.block_size=16", "train.max_iters=6",
                 "train.eval_interval=6", "train.eval_iters=2", "train.log_interval=3", "train.warmup_iters=1",
                 "train.lr_decay_iters=6", "train.sample_tokens=0", "train.plot=false", "train.checkpoint=false",
                 "runtime.mesh=data:1", f"train.data_path='{text}'", f"train.out_dir='{tmp_path / 'run'}'"]
    result = run_experiment(load_config(overrides=overrides), quiet=True)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in records if "loss" in r]
    assert [r["step"] for r in logged] == [3, 6] and all(set(LOSS_NAMES) <= set(r) for r in logged)
    assert all(r["aux_loss"] == pytest.approx(0.01 * r["load_balancing_loss"], rel=1e-5) for r in logged)
    assert np.isfinite(result.final_val_loss)
