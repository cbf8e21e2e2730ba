"""bench/speedrun.py: the turns, the ablation's variants, the recipe carried onto the GPU config, the
medians and ratios, the tables; one tiny race end to end against a stand-in nanoGPT port."""

import json
import sys
from pathlib import Path

import pytest

from bench import speedrun
from train.config import DEFAULT_CONFIG, load_config

ROOT = Path(__file__).resolve().parents[2]


def test_each_side_takes_each_turn_once_over_as_many_rounds():
    sides = ["a", "b", "c"]
    orders = [speedrun.turn_order(sides, r) for r in range(3)]
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    for position in range(3):
        assert sorted(o[position] for o in orders) == sides


@pytest.fixture(scope="module")
def recipe():
    return load_config(speedrun.SPEEDRUN)


@pytest.fixture(scope="module")
def default():
    return load_config(DEFAULT_CONFIG)


def test_every_ablation_variant_flips_its_switch_and_nothing_else(recipe, default):
    variants = speedrun.ablation_variants(recipe, default)
    assert variants[0]["switch"] is None and variants[0]["overrides"] == []
    assert [v["switch"] for v in variants[1:]] == [s.name for s in speedrun.SWITCHES]
    for switch, variant in zip(speedrun.SWITCHES, variants[1:]):
        changed = load_config(speedrun.SPEEDRUN, variant["overrides"])
        assert switch.in_recipe(changed) != switch.in_recipe(recipe), switch.name
        assert variant["in_recipe"] == switch.in_recipe(recipe)
        for other in speedrun.SWITCHES:
            if other is not switch:
                assert other.in_recipe(changed) == other.in_recipe(recipe), (switch.name, other.name)


def test_muon_off_goes_back_to_the_default_adamw_lr_only_where_the_recipe_changed_it(recipe, default):
    assert speedrun.adamw_lr(default.train, default.train) == ()
    muon_lr = default.train.replace(lr=2e-3, min_lr=2e-4)
    assert speedrun.adamw_lr(muon_lr, default.train) == (f"train.lr={default.train.lr!r}",
                                                        f"train.min_lr={2e-4 * default.train.lr / 2e-3!r}")


def test_the_recipe_carried_onto_the_gpu_config_changes_its_maths_not_its_shape(recipe, default):
    gpu = load_config(speedrun.GPU_CONFIG)
    delta = speedrun.recipe_delta(recipe, default, gpu)
    assert delta, "the speedrun config changes nothing relative to the default"
    carried = load_config(speedrun.GPU_CONFIG, delta)
    for table in ("model", "train"):
        for name in {o.split("=")[0].split(".")[1] for o in delta if o.startswith(table)}:
            assert getattr(getattr(carried, table), name) == getattr(getattr(recipe, table), name)
    for name in speedrun.NOT_RECIPE_MODEL:
        assert getattr(carried.model, name) == getattr(gpu.model, name), name
    for name in ("batch_size", "block_size", "max_iters", "lr_decay_iters", "eval_interval"):
        assert getattr(carried.train, name) == getattr(gpu.train, name), name
    assert carried.model.mlp == recipe.model.mlp and carried.model.qk_norm == recipe.model.qk_norm


def _run(side, rnd, seconds, final=1.8, ms=20.0):
    return {"side": side, "round": rnd, "turn": 1, "seconds_to_target": seconds, "target_step": 100,
            "final_val_loss": final, "median_ms_per_iter": ms, "median_tokens_per_s": 1000.0, "compile_s": 2.0,
            "wall_s": 30.0, "evals": []}


def test_ratios_per_round_and_of_the_medians():
    runs = [_run("nanoGPT", 1, 60.0), _run("speedrun", 1, 15.0), _run("nanoGPT", 2, 66.0),
            _run("speedrun", 2, 22.0), _run("nanoGPT", 3, 63.0), _run("speedrun", 3, None),
            {"side": "speedrun", "round": 4, "turn": 1, "error": "diverged"}]
    speedrun.add_round_ratios(runs)
    assert [r.get("ratio") for r in runs if r["side"] == "speedrun"] == [4.0, 3.0, None, None]
    summary = speedrun.race_summary(runs)
    s = summary["speedrun"]
    assert (s["runs"], s["reached"]) == (4, 2)
    assert s["median_seconds_to_target"] == pytest.approx(18.5)
    assert s["ratio_of_medians"] == pytest.approx(63.0 / 18.5)
    assert s["median_round_ratio"] == pytest.approx(3.5)
    assert summary["nanoGPT"]["median_ms_per_iter"] == 20.0 and "ratio_of_medians" not in summary["nanoGPT"]


def test_loss_at_a_budget_is_the_last_evaluation_within_it():
    evals = [{"step": s, "val_loss": 3.0 - s / 100, "train_seconds": s / 10} for s in (0, 50, 100, 150)]
    assert speedrun.loss_at_budget(evals, 12.0)["step"] == 100
    assert speedrun.loss_at_budget(evals, 15.0)["step"] == 150
    assert speedrun.loss_at_budget([{"step": 0, "val_loss": 4.0}], 10.0) is None


def test_the_gpu_target_is_nanogpts_final_loss_of_the_same_round():
    evals = [{"step": s, "val_loss": v, "train_seconds": t} for s, v, t in ((0, 4.0, 0.0), (250, 1.6, 5.0),
                                                                         (500, 1.45, 10.0))]
    runs = [{**_run("nanoGPT", 1, 50.0), "final_val_loss": 1.47}, {**_run("ours", 1, None), "evals": evals},
            {**_run("nanoGPT", 2, 50.0), "final_val_loss": 1.40}, {**_run("ours", 2, None), "evals": evals}]
    speedrun.add_target_from_nanogpt(runs)
    assert (runs[1]["target_loss"], runs[1]["seconds_to_target"], runs[1]["target_step"]) == (1.47, 10.0, 500)
    assert runs[3]["target_loss"] == 1.40 and runs[3]["seconds_to_target"] is None


def test_the_ablation_table_reports_each_variant_against_the_recipe(monkeypatch, tmp_path, recipe):
    losses = {"recipe": 1.80}

    def fake_run(side, data, scratch):
        assert "train.eval_whole_val=true" in side.overrides
        loss = losses.get(side.name, 1.85)
        evals = [{"step": 0, "val_loss": 4.2, "train_seconds": 0.0},
                 {"step": 500, "val_loss": loss, "train_seconds": 10.0},
                 {"step": 1000, "val_loss": loss - 0.1, "train_seconds": 20.0}]
        return {"seconds_to_target": 10.0 if loss <= speedrun.TARGET else None, "target_step": 500,
                "final_val_loss": loss - 0.1, "median_ms_per_iter": 20.0, "evals": evals}
    monkeypatch.setattr(speedrun, "run_ours", fake_run)
    args = type("Args", (), {"max_iters": None, "set": [], "speedrun_config": speedrun.SPEEDRUN, "rounds": 1,
                             "budget": 15.0})()
    record = speedrun.ablation(args, tmp_path / "data.txt", tmp_path)
    rows = {r["name"]: r for r in record["rows"]}
    assert rows["recipe"]["val_loss_at_budget"] == 1.80
    assert len(rows) == 1 + len(speedrun.SWITCHES)
    record.update(command="PYTHONPATH=$PWD python bench/train.py --ablation", env=None)
    text = speedrun.ablation_markdown(record)
    assert "| recipe | the speedrun config as it is | - | 1.8000 | +0.0000 | 10.0 |" in text
    assert "+0.0500" in text  # every other variant: 1.85 at the budget, 0.05 worse than the recipe


FAKE_PORT = '''
import argparse, json
p = argparse.ArgumentParser()
p.add_argument("--data"); p.add_argument("--json"); p.add_argument("--threads")
p.add_argument("--max-iters", type=int); p.add_argument("--lr-decay-iters")
a = p.parse_args()
record = {"iters": a.max_iters, "median_ms_per_iter": 30.0, "median_tokens_per_s": 25600.0,
          "fastest_ms_per_iter": 28.0, "final_val_loss": 3.1, "wall_s": 1.0, "evals": [],
          "env": {"torch": "stand-in"}, "impl": "stand-in port"}
json.dump(record, open(a.json, "w"))
print(json.dumps(record))
'''


@pytest.mark.slow
def test_a_tiny_race_end_to_end(tmp_path, monkeypatch):
    """Both our configs train for real (10 iters, whole-val evaluations), nanoGPT is a stand-in."""
    data = tmp_path / "data.txt"
    data.write_text((ROOT / "README.md").read_text() * 3)
    port = tmp_path / "port.py"
    port.write_text(FAKE_PORT)
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nshift\nexec {sys.executable} {port} \"$@\"\n")  # drops the port's path
    python.chmod(0o755)
    out = tmp_path / "out"
    record = speedrun.main(["--race", "--rounds", "1", "--max-iters", "10", "--data", str(data),
                            "--nanogpt-python", str(python), "--out", str(out),
                            "--set", "train.eval_interval=5", "train.target_loss=99.0"])
    runs = {r["side"]: r for r in record["runs"]}
    assert set(runs) == {"nanoGPT", "speedrun", "default"}
    assert not any("error" in r for r in runs.values()), [r.get("error") for r in runs.values()]
    assert runs["nanoGPT"]["seconds_to_target"] == pytest.approx(10 * 30.0 / 1e3)
    for side in ("speedrun", "default"):
        steps = [e["step"] for e in runs[side]["evals"]]
        assert steps == [0, 5, 10]
        assert all(e["train_seconds"] >= 0 for e in runs[side]["evals"])
        assert runs[side]["target_step"] == 0  # the first evaluation is at or below the (huge) target
        assert runs[side]["seconds_to_target"] == 0.0 and runs[side]["ratio"] is None  # no ratio to 0 s
    written = json.loads((out / "speedrun.json").read_text())
    assert written["summary"]["speedrun"]["reached"] == 1
    assert written["threads"]["nanogpt"] == written["threads"]["ours"] >= 1  # a fair race by default
    text = (out / "speedrun.md").read_text()
    assert "Made by: `PYTHONPATH=$PWD python bench/train.py --race" in text and str(tmp_path) not in text


def test_the_gpu_race_gives_nanogpts_model_the_recipe_and_times_to_nanogpts_loss(monkeypatch, tmp_path):
    evals = [{"step": 0, "val_loss": 4.2, "train_seconds": 0.0}, {"step": 250, "val_loss": 1.5, "train_seconds": 9.0},
             {"step": 500, "val_loss": 1.42, "train_seconds": 18.0}]
    seen = {}

    def fake_ours(side, data, scratch):
        seen[side.name] = load_config(side.config, side.overrides)
        return {"final_val_loss": 1.42, "median_ms_per_iter": 36.0, "median_tokens_per_s": 4.5e5, "evals": evals}

    def fake_nanogpt(python, data, scratch, args):
        seen["nanogpt_args"] = args
        return {"seconds_to_target": 100.0, "final_val_loss": 1.47, "median_ms_per_iter": 20.0,
                "median_tokens_per_s": 8.2e5, "target_step": 5000, "evals": []}
    monkeypatch.setattr(speedrun, "run_ours", fake_ours)
    monkeypatch.setattr(speedrun, "run_nanogpt", fake_nanogpt)
    args = type("Args", (), {"max_iters": None, "set": [], "speedrun_config": speedrun.SPEEDRUN, "rounds": 1,
                             "nanogpt_python": sys.executable, "nanogpt_threads": 3})()
    record = speedrun.gpu_race(args, tmp_path / "data.txt", tmp_path)
    assert {"--config", "gpu", "--device", "cuda", "--compile"} <= set(seen["nanogpt_args"])
    assert seen["nanogpt_args"][seen["nanogpt_args"].index("--threads") + 1] == "3"
    assert record["threads"]["nanogpt"] == 3
    recipe = load_config(speedrun.SPEEDRUN)
    assert seen["ours + recipe"].model.mlp == recipe.model.mlp != seen["ours"].model.mlp
    assert seen["ours"].model.d_model == seen["ours + recipe"].model.d_model == 384
    ours = next(r for r in record["runs"] if r["side"] == "ours")
    assert (ours["target_loss"], ours["seconds_to_target"], ours["ratio"]) == (1.47, 18.0, 100.0 / 18.0)
    record.update(command="PYTHONPATH=$PWD python3 bench/train.py --gpu-race", env=None)
    text = speedrun.gpu_markdown(record)
    assert "| ours | 450,000 | 18.0 | 1.4200 | 5.56 |" in text


@pytest.mark.slow
def test_the_nanogpt_port_runs_and_reports_its_figures(tmp_path):
    """The real port (torch on the CPU): a few iterations of the baby run on a small text."""
    pytest.importorskip("torch")
    import subprocess
    data = tmp_path / "data.txt"
    data.write_text((ROOT / "README.md").read_text() * 2)
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "nanogpt_baseline.py"), "--data", str(data),
                           "--max-iters", "12", "--lr-decay-iters", "12", "--eval-interval", "6",
                           "--threads", "1"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads(done.stdout.strip().splitlines()[-1])
    assert [e["iter"] for e in record["evals"]] == [0, 6, 12]
    assert record["iters"] == 12 and record["device"] == "cpu, float32" and not record["compiled"]
    assert record["final_val_loss"] < record["evals"][0]["val"]
    assert record["median_ms_per_iter"] > 0 and record["train_s"] > 0


def test_the_port_reads_the_loss_every_log_interval_and_before_each_eval():
    pytest.importorskip("torch")
    from bench import nanogpt_baseline as port
    gpu = port.PRESETS["gpu"]
    assert (gpu.n_layer, gpu.n_head, gpu.n_embd, gpu.block_size, gpu.batch_size, gpu.max_iters) == \
        (6, 6, 384, 256, 64, 5000)
    ends = [i for i in range(600) if port.window_ends(i, gpu)]
    assert ends[:3] == [9, 19, 29] and 249 in ends and 499 in ends
    assert all(port.window_ends(i, port.PRESETS["baby"]) for i in range(20))  # the CPU run: every iteration
