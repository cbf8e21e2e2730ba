"""Short training runs of a tiny model on a slice of the corpus (or a synthetic text)."""

import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from train import tiny_lm
from train.config import load_config
from train.models.runs import load_for_sampling
from train.run import optim
from train.run.experiment import run_experiment

from tiny_runs import TINY_MODEL, TINY_TRAIN, run_metrics, tiny_run_config


@pytest.fixture(scope="module")
def full_run(text_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("full")
    config = tiny_run_config(text_file, out, "train.max_iters=30", "train.steps_per_dispatch=5")
    hooked = []
    result = run_experiment(config, quiet=True, after_eval=hooked.append)
    return out, result, hooked


def test_loss_decreases_and_artifacts_are_written(full_run):
    out, result, hooked = full_run
    evals = [r for r in run_metrics(out) if "val_loss" in r]
    assert [r["step"] for r in evals] == [0, 10, 20, 30]
    assert hooked == [0, 10, 20, 30]  # after_eval runs once per evaluation (bench/train.py's turns)
    assert evals[0]["train_loss"] == pytest.approx(math.log(result_vocab(out)), abs=0.3)  # uniform start
    assert evals[-1]["train_loss"] < evals[0]["train_loss"] - 0.6
    assert evals[-1]["val_loss"] < evals[0]["val_loss"] - 0.3
    assert result.final_val_loss == evals[-1]["val_loss"]
    assert (out / "loss.png").stat().st_size > 1000
    assert json.loads((out / "config.json").read_text())["train"]["max_iters"] == 30
    assert len(result.sample) > 20 and result.median_tokens_per_s > 0 and result.compile_s > 0
    saved = json.loads((out / "result.json").read_text())  # the peak memory is reported and kept
    assert 0.05 < saved["peak_rss_gib"] < 24 and saved["device_peak_gib"] is None  # a CPU: arrays in RSS


def result_vocab(out):
    return json.loads((Path(out) / "config.json").read_text())["model"]["vocab_size"]


def test_the_runtime_is_resolved_in_the_saved_config(full_run):
    from jaxattn.kernels import resolve_kernels
    out, result, _ = full_run
    assert load_config().runtime.matmul == "auto"  # the default config asks for "auto"
    kernels, _ = resolve_kernels()  # what "auto" means on this machine
    assert result.config.runtime.requested_kernels() == kernels
    saved = json.loads((Path(out) / "config.json").read_text())
    assert saved["runtime"] == {**kernels.to_dict(), "mesh": "data:1,fsdp:1,tensor:1", "cpu_devices": "auto",
                                "xla_flags": ""}


def test_resume_equals_uninterrupted(full_run, text_file, tmp_path):
    full_out, _, _ = full_run
    first = run_experiment(tiny_run_config(text_file, tmp_path, "train.max_iters=20", "train.steps_per_dispatch=5"),
                           quiet=True, sample=False)
    assert first.steps == 20
    run_experiment(tiny_run_config(text_file, tmp_path, "train.max_iters=30", "train.steps_per_dispatch=5"),
                   resume=True, quiet=True, sample=False)
    full, resumed = run_metrics(full_out), run_metrics(tmp_path)
    full_losses = {r["step"]: r["loss"] for r in full if "loss" in r}
    resumed_losses = {r["step"]: r["loss"] for r in resumed if "loss" in r}
    assert sorted(resumed_losses) == sorted(full_losses) and max(full_losses) == 30
    np.testing.assert_allclose([resumed_losses[s] for s in sorted(full_losses)],
                               [full_losses[s] for s in sorted(full_losses)], rtol=1e-6)
    full_params, _, _ = load_for_sampling(full_out / "checkpoints" / "latest")
    resumed_params, _, _ = load_for_sampling(tmp_path / "checkpoints" / "latest")
    for a, b in zip(jax.tree.leaves(full_params), jax.tree.leaves(resumed_params)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_steps_per_dispatch_does_not_change_the_maths(full_run, text_file, tmp_path):
    full_out, _, _ = full_run
    run_experiment(tiny_run_config(text_file, tmp_path, "train.max_iters=10", "train.steps_per_dispatch=1",
                           "train.checkpoint=false", "train.plot=false"), quiet=True, sample=False)
    one = [r["loss"] for r in run_metrics(tmp_path) if "loss" in r]
    five = [r["loss"] for r in run_metrics(full_out) if "loss" in r][:len(one)]
    np.testing.assert_allclose(one, five, rtol=1e-5)


def test_lr_schedule_is_nanogpts():
    tc = load_config().train
    schedule = optim.lr_schedule(tc)

    def get_lr(it):  # nanoGPT train.py
        if it < tc.warmup_iters:
            return tc.lr * (it + 1) / (tc.warmup_iters + 1)
        if it > tc.lr_decay_iters:
            return tc.min_lr
        ratio = (it - tc.warmup_iters) / (tc.lr_decay_iters - tc.warmup_iters)
        return tc.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (tc.lr - tc.min_lr)

    for it in (0, 1, 50, 99, 100, 101, 1000, 1999, 2000, 2500):
        assert float(schedule(it)) == pytest.approx(get_lr(it), rel=1e-5)


def test_weight_decay_mask():
    params = {"token_embed": {"embedding": jnp.zeros((5, 4))}, "pos_embed": jnp.zeros((8, 4)),
              "block_0": {"attn": {"kernel": jnp.zeros((4, 12)), "bias": jnp.zeros(12)},
                          "norm": {"scale": jnp.zeros(4)}}}
    with_embed = optim.decay_mask(params, decay_embeddings=True)
    without = optim.decay_mask(params, decay_embeddings=False)
    assert with_embed["token_embed"]["embedding"] and with_embed["pos_embed"]
    assert not without["token_embed"]["embedding"] and not without["pos_embed"]
    for mask in (with_embed, without):
        assert mask["block_0"]["attn"]["kernel"]
        assert not mask["block_0"]["attn"]["bias"] and not mask["block_0"]["norm"]["scale"]


def _cli_error(capsys, argv) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_info:
        tiny_lm.main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return exit_info.value.code, err


def test_cli_errors_are_one_line_with_usage_and_runtime_exit_codes(tmp_path, capsys):
    jax.devices()  # JAX started: the mesh cases below cannot change this process's host device count
    text = tmp_path / "text.txt"
    text.write_text("abcdefgh\n" * 100)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    run = ["--set", *TINY_MODEL, *TINY_TRAIN, "--quiet"]
    for argv, code, message in [
        (["--set", "train.max_itres=3"], 2, "unknown train keys ['max_itres']"),
        (["--mesh", "data:5", "--cpu-devices", "5"], 2, "data x fsdp = 5 does not divide the batch size = 12"),
        (["--num-processes", "2"], 2, "--num-processes and --process-id need --coordinator HOST:PORT"),
        (["--coordinator", "localhost", "--num-processes", "2"], 2, "--coordinator must be HOST:PORT"),
        (["--set", "train.block_size=128"], 2, "model.max_seq_len=64 is shorter than train.block_size=128"),
        ([*run, "--data", str(tmp_path / "missing.txt"), "--out-dir", str(tmp_path)], 1, "does not exist"),
        ([*run, "--data", str(empty), "--out-dir", str(tmp_path)], 1, "is empty"),
        ([*run, "--data", str(text), "--out-dir", str(tmp_path / "fresh"), "--resume"], 1, "no checkpoint"),
    ]:
        got_code, err = _cli_error(capsys, argv)
        assert got_code == code and message in err, (argv, got_code, err)
        assert len(err.splitlines()) == 1 and err.startswith("error: "), err  # no usage block before it
        assert err.endswith("(see python -m train.tiny_lm --help)\n") == (code == 2), err


def test_repeated_set_flags_all_apply():
    args = tiny_lm.build_parser().parse_args(["--set", "train.max_iters=3", "--set", "train.lr=0.5", "model.d_model=64"])
    config = load_config(overrides=tiny_lm.overrides(args))
    assert (config.train.max_iters, config.train.lr, config.model.d_model) == (3, 0.5, 64)


def test_attention_maps_from_a_checkpoint(text_file, full_run, tmp_path):
    from train import attention_maps

    out, result, _ = full_run
    params, model_config, tokenizer = load_for_sampling(out)
    text = text_file.read_text()[:13]  # characters the tokenizer knows, with or without the corpus
    ids = tokenizer.encode(text)
    weights = attention_maps.attention_weights(params, model_config, ids)
    assert weights.shape == (2, 2, len(ids), len(ids))  # [L, N, T, T]
    np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-5)
    assert np.all(np.triu(weights, k=1) == 0)  # causal
    png = attention_maps.main(["--checkpoint", str(out), "--text", text, "--out",
                               str(tmp_path / "maps.png")])
    assert png.stat().st_size > 1000


def test_the_final_line_names_the_peak_memory():
    from train.run.metrics import describe_memory, peak_memory
    assert describe_memory({"peak_rss_gib": 0.5, "device_peak_gib": None}) == "peak memory 0.50 GiB RSS"
    assert describe_memory({"peak_rss_gib": 1.25, "device_peak_gib": 3.0}).endswith("RSS, device 3.00 GiB")
    assert peak_memory()["peak_rss_gib"] > 0.05
