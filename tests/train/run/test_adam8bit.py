"""AdamW with 8-bit moments (train.run.adam8bit, `train.adam_states = "int8"`): the dynamic code, block-wise
rounding to its nearest value, optax's Adam where the moments stay float32, a trajectory close to
float32 Adam's, a quarter of the bytes, the moments' layout on a mesh, and a run that resumes exactly;
against bitsandbytes (the format's owner): its code tables bit for bit, and from its `AdamW8bit` state
one step of ours gives its parameters and its codes."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from jaxattn import sharding
from train.config import TrainConfig
from train.run import adam8bit, optim
from train.run.experiment import run_experiment

from tiny_runs import run_metrics, tiny_run_config


def test_the_dynamic_codes_span_seven_decades_finer_the_larger():
    for code, signed in ((adam8bit.SIGNED, True), (adam8bit.UNSIGNED, False)):
        assert code.shape == (256,) and np.all(np.diff(code) > 0) and code[-1] == 1.0 and 0.0 in code
        assert code[0] == (pytest.approx(-0.99296875) if signed else 0.0)
        positive = code[code > 0]
        assert positive[0] == pytest.approx(0.55e-6 if signed else 0.325e-6)
        # the top decade holds half the positive values (64 of 128 signed, 128 of 255 unsigned), the next a half less
        assert np.sum(positive >= 0.1) == (65 if signed else 129)  # with 1.0
        assert np.sum((positive >= 0.01) & (positive < 0.1)) == (32 if signed else 64)


def test_the_codes_are_bitsandbytes_dynamic_maps_bit_for_bit():
    import bitsandbytes.functional as bnb_functional
    np.testing.assert_array_equal(adam8bit.SIGNED, bnb_functional.create_dynamic_map(signed=True).numpy())
    np.testing.assert_array_equal(adam8bit.UNSIGNED, bnb_functional.create_dynamic_map(signed=False).numpy())


@pytest.mark.parametrize("code", ["SIGNED", "UNSIGNED"])
def test_each_value_rounds_to_the_nearest_code_value_times_its_blocks_largest_magnitude(code):
    table = getattr(adam8bit, code)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((37, 29)) * np.exp(2 * rng.standard_normal((37, 29)))  # 1073 values: 4 blocks and a part
    x = np.abs(x) if code == "UNSIGNED" else x
    x[0, :] = 0.0
    x = x.astype(np.float32)
    q = adam8bit.quantize(jnp.asarray(x), table)
    assert q.codes.dtype == jnp.uint8 and q.codes.shape == x.shape and q.scales.shape == (5,)
    flat = np.pad(x.reshape(-1), (0, 5 * 256 - x.size)).reshape(5, 256)
    np.testing.assert_array_equal(q.scales, np.abs(flat).max(axis=1))
    scaled = flat / np.where(q.scales > 0, q.scales, 1)[:, None]
    nearest = np.abs(scaled[..., None] - table).argmin(-1).reshape(-1)[:x.size]
    np.testing.assert_array_equal(np.asarray(q.codes).reshape(-1), nearest)
    back = np.asarray(adam8bit.dequantize(q, table))
    np.testing.assert_allclose(back.reshape(-1), (table[nearest] * np.repeat(q.scales, 256)[:x.size]), rtol=1e-6)
    assert np.all(back[0] == 0.0)
    big = np.abs(x) >= 0.1 * np.repeat(q.scales, 256)[:x.size].reshape(x.shape)
    half_step = 0.9 / (64 if code == "SIGNED" else 128) / 2  # of the top decade, [0.1, 1]
    assert np.max(np.abs(back - x)[big] / np.abs(x)[big]) <= half_step / 0.1 * (1 + 1e-5)


def test_moments_of_small_parameters_stay_float32_and_give_optaxs_adam():
    params = {"norm": jnp.ones((64,)), "w": jnp.full((32, 16), 0.5)}
    assert not any(adam8bit.held_in_8bit(p) for p in jax.tree.leaves(params))
    ours, theirs = adam8bit.adamw_8bit(1e-2, weight_decay=0.1), optax.adamw(1e-2, weight_decay=0.1)
    s1, s2, p1, p2 = ours.init(params), theirs.init(params), params, params
    for step in range(3):
        grads = jax.tree.map(lambda p: jnp.sin(p * (step + 1) + jnp.arange(p.size).reshape(p.shape)), p1)
        u1, s1 = ours.update(grads, s1, p1)
        u2, s2 = theirs.update(grads, s2, p2)
        p1, p2 = optax.apply_updates(p1, u1), optax.apply_updates(p2, u2)
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def least_squares(optimizer, steps: int = 300):
    """Fits W [256, 64] to y = x W* (rows of W* of scales e^N(0, 1)) over fixed batches; (the final loss, W)."""
    rng = np.random.default_rng(0)
    target = jnp.asarray(rng.standard_normal((256, 64)) * np.exp(rng.standard_normal((256, 1))), jnp.float32)
    xs = jnp.asarray(rng.standard_normal((steps, 32, 256)), jnp.float32)
    loss = lambda w, x: jnp.mean((x @ w - x @ target) ** 2)  # noqa: E731
    w = jnp.zeros((256, 64))

    def step(carry, x):
        w, state = carry
        updates, state = optimizer.update(jax.grad(loss)(w, x), state, w)
        return (optax.apply_updates(w, updates), state), None
    (w, _), _ = jax.lax.scan(step, (w, optimizer.init(w)), xs)
    return float(loss(w, xs[-1])), w


def test_an_8bit_trajectory_stays_close_to_float32_adams():
    start, _ = least_squares(optax.adamw(0.3, weight_decay=0.0), steps=1)
    float32, w32 = least_squares(optax.adamw(0.3, weight_decay=0.0))
    int8, w8 = least_squares(adam8bit.adamw_8bit(0.3, weight_decay=0.0))
    assert float32 < 1e-3 * start and int8 < 1e-3 * start  # both fit
    assert float(jnp.linalg.norm(w8 - w32) / jnp.linalg.norm(w32)) < 0.01  # to the same weights, by the same path


def test_a_large_parameters_moments_take_a_quarter_of_the_bytes_and_the_rest_stay_float32():
    params = {"big": jnp.zeros((256, 256)), "norm": jnp.zeros((256,))}
    state = optim.make_optimizer(TrainConfig(adam_states="int8", grad_clip=0.0)).init(params)
    adam = state[0]
    assert isinstance(adam.mu["big"], adam8bit.Quantized) and adam.mu["norm"].dtype == jnp.float32
    zero = adam8bit.quantize(jnp.zeros((256, 256)), adam8bit.SIGNED)  # a fresh moment is zero, as rounded
    assert all(np.array_equal(a, b) for a, b in zip(adam.mu["big"], zero))
    np.testing.assert_array_equal(adam8bit.dequantize(adam.nu["big"], adam8bit.UNSIGNED), 0.0)
    assert sum(x.nbytes for x in jax.tree.leaves((adam.mu["big"], adam.nu["big"]))) == 2 * (65536 + 4 * 256)
    plain = optim.make_optimizer(TrainConfig(grad_clip=0.0)).init(params)
    assert sum(x.nbytes for x in jax.tree.leaves((plain[0].mu["big"], plain[0].nu["big"]))) == 8 * 65536


def test_on_a_mesh_the_codes_are_split_as_their_parameter_and_the_scales_kept_whole():
    params = {"mlp": {"kernel": jnp.zeros((128, 64)), "bias": jnp.zeros((64,))}}
    specs = {"mlp": {"kernel": P("fsdp", "tensor"), "bias": P("tensor")}}
    state = adam8bit.adamw_8bit(1e-3).init(params)
    laid = sharding.mirror_specs(state, specs, params)
    assert laid[0].mu["mlp"]["kernel"] == adam8bit.Quantized(P("fsdp", "tensor"), P())
    assert laid[0].nu["mlp"]["kernel"].codes == P("fsdp", "tensor") and laid[0].mu["mlp"]["bias"] == P("tensor")


def test_a_run_with_8bit_moments_trains_saves_them_and_resumes_exactly(text_file, tmp_path):
    run = ["train.adam_states='int8'", "train.steps_per_dispatch=5", "train.sample_tokens=4", "train.plot=false",
           "train.eval_interval=5", "train.eval_iters=2"]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    run_experiment(tiny_run_config(text_file, whole, *run, "train.max_iters=10"), quiet=True, sample=False)
    run_experiment(tiny_run_config(text_file, cut, *run, "train.max_iters=5"), quiet=True, sample=False)
    run_experiment(tiny_run_config(text_file, cut, *run, "train.max_iters=10"), resume=True, quiet=True, sample=False)
    losses = [{r["step"]: r["loss"] for r in run_metrics(out) if "loss" in r} for out in (whole, cut)]
    assert sorted(losses[0]) == sorted(losses[1]) and max(losses[0]) == 10
    np.testing.assert_allclose([losses[1][s] for s in sorted(losses[0])], [losses[0][s] for s in sorted(losses[0])],
                               rtol=1e-6)
    evals = [r["val_loss"] for r in run_metrics(whole) if "val_loss" in r]
    assert evals[-1] < evals[0]
    meta = json.loads((Path(whole) / "checkpoints" / "latest" / "10" / "meta" / "metadata").read_text())
    assert any(name.startswith("opt_state/") and name.endswith("/codes") for name in meta["checksums"])


def test_one_step_from_bitsandbytes_adamw8bit_state_gives_its_parameters_and_its_codes():
    import bitsandbytes as bnb
    import torch
    rng = np.random.default_rng(3)
    shapes = [(64, 128), (300, 17), (40, 50)]  # 32 whole blocks; 19 and a part; under MIN_SIZE (float32 moments)
    start = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    grads = [[(rng.standard_normal(s) * np.exp(rng.standard_normal(s))).astype(np.float32) for s in shapes]
             for _ in range(4)]
    torch_params = [torch.nn.Parameter(torch.from_numpy(p.copy())) for p in start]
    theirs = bnb.optim.AdamW8bit(torch_params, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1,
                                 min_8bit_size=adam8bit.MIN_SIZE)

    def their_step(step_grads):
        for p, g in zip(torch_params, step_grads):
            p.grad = torch.from_numpy(g)
        theirs.step()

    for step_grads in grads[:3]:  # moments worth rounding: three steps of bitsandbytes
        their_step(step_grads)
    states = [theirs.state[p] for p in torch_params]

    def moment(state, which):  # bitsandbytes' state of one moment as ours: codes and absmax, or float32
        if f"absmax{which}" in state:
            return adam8bit.Quantized(jnp.asarray(state[f"state{which}"].numpy()),
                                      jnp.asarray(state[f"absmax{which}"].numpy()))
        return jnp.asarray(state[f"state{which}"].numpy())

    ours = adam8bit.adamw_8bit(1e-2, weight_decay=0.1)
    params = [jnp.asarray(p.detach().numpy()) for p in torch_params]
    opt_state = ours.init(params)
    assert [adam8bit.held_in_8bit(p) for p in params] == ["absmax1" in s for s in states] == [True, True, False]
    opt_state = (adam8bit.ScaleByAdam8bitState(jnp.int32(states[0]["step"]),
                                               [moment(s, 1) for s in states],
                                               [moment(s, 2) for s in states]), *opt_state[1:])
    before_state = opt_state[0]
    updates, opt_state = ours.update([jnp.asarray(g) for g in grads[3]], opt_state, params)
    params = optax.apply_updates(params, updates)
    their_step(grads[3])
    for mine, their in zip(params, torch_params):  # the same float32 arithmetic, in another order
        np.testing.assert_allclose(np.asarray(mine), their.detach().numpy(), rtol=0, atol=1e-6)
    # The new moments' codes: ours round each float32 moment to the nearest code value; bitsandbytes' CPU
    # search misses the nearest for a few values and takes one farther away. The rest agree.
    betas = {1: (0.9, lambda g: g), 2: (0.999, lambda g: g * g)}
    for which, code, field in ((1, adam8bit.SIGNED, "mu"), (2, adam8bit.UNSIGNED, "nu")):
        beta, of = betas[which]
        for state, before, mine, g in zip(states[:2], getattr(before_state, field)[:2],
                                          getattr(opt_state[0], field)[:2], grads[3][:2]):
            np.testing.assert_allclose(np.asarray(mine.scales), state[f"absmax{which}"].numpy(), rtol=1e-6)
            moment_f32 = (beta * np.asarray(adam8bit.dequantize(before, code)) + (1 - beta) * of(g)).reshape(-1)
            scale = np.repeat(np.asarray(mine.scales), adam8bit.BLOCK)[:moment_f32.size]
            codes = np.asarray(mine.codes, int).reshape(-1)
            their_codes = state[f"state{which}"].numpy().astype(int).reshape(-1)
            differ = codes != their_codes
            assert np.mean(differ) < 0.05  # here 0.3% of the first moment's codes, 2.6-4% of the second's
            ours_off = np.abs(code[codes] * scale - moment_f32)
            theirs_off = np.abs(code[their_codes] * scale - moment_f32)
            assert np.all(ours_off[differ] <= theirs_off[differ] * (1 + 1e-6))
