"""Nothing lost, nothing silent: run directories, divergence, interrupts and crashes.

Training runs here are tiny (a 2-layer, d 32 model on a slice of the corpus) so that each
takes seconds; the crash tests (marked slow) start real `python -m train.tiny_lm` processes
and stop or kill them, at exact moments where `train.run.crash_points` can name one.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from train import tiny_lm
from train.checkpoints import store as checkpoint_lib
from train.checkpoints.store import CheckpointError
from train.config import load_config
from train.models.runs import load_for_sampling
from train.run import crash_points
from train.run.experiment import run_experiment
from train.run.loop import TrainingDiverged
from train.run.rundir import RunDirectoryError, RunLock, claim, repair_metrics

ROOT = Path(__file__).resolve().parents[3]
TINY = ["model.d_model=32", "model.num_layers=2", "model.num_heads=2", "model.max_seq_len=16",
        "train.batch_size=4", "train.block_size=16", "train.eval_iters=4", "train.eval_interval=10",
        "train.log_interval=5", "train.warmup_iters=5", "train.lr=3e-3", "train.lr_decay_iters=40",
        "train.sample_tokens=0", "train.plot=false", "runtime.mesh=data:1"]


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    from train.data.corpus import ENV_PATH
    path = tmp_path_factory.mktemp("data") / "slice.txt"
    source = os.environ.get(ENV_PATH)
    text = Path(source).read_text(encoding="utf-8")[:20_000] if source and Path(source).is_file() else \
        "To be, or not to be, that is the question.\n" * 500
    path.write_text(text, encoding="utf-8")
    return path


def config(text_file, out_dir, *extra):
    return load_config(overrides=[*TINY, f"train.data_path='{text_file}'", f"train.out_dir='{out_dir}'", *extra])


def metrics(out_dir):
    return [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]


def cli(capsys, *argv):
    """`python -m train.tiny_lm` in this process: (exit code, stderr)."""
    with pytest.raises(SystemExit) as exit_info:
        tiny_lm.main(list(argv))
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return exit_info.value.code, err


# --------------------------------------------------------------------------------------------
# A run's directory is never replaced silently, never shared, never written before it is checked


def test_a_new_run_refuses_a_directory_that_holds_a_run(text_file, tmp_path, capsys):
    run_experiment(config(text_file, tmp_path, "train.max_iters=10"), quiet=True)
    before = (tmp_path / "metrics.jsonl").read_text()
    with pytest.raises(RunDirectoryError, match="already holds a run .*--resume continues it, --overwrite "
                                                "replaces it, or choose another --out-dir"):
        run_experiment(config(text_file, tmp_path, "train.max_iters=10", "model.positions='learned'"), quiet=True)
    assert (tmp_path / "metrics.jsonl").read_text() == before and (tmp_path / "checkpoints" / "latest").is_dir()
    code, err = cli(capsys, "--set", *TINY, "train.max_iters=10", "--data", str(text_file), "--out-dir", str(tmp_path),
                    "--quiet")
    assert code == 1 and err.startswith("error: ") and "already holds a run" in err
    run_experiment(config(text_file, tmp_path, "train.max_iters=5", "train.eval_interval=5"), quiet=True,
                   overwrite=True)
    assert [r["step"] for r in metrics(tmp_path) if "val_loss" in r] == [0, 5]  # replaced, as asked


def test_a_second_run_into_a_locked_directory_fails_at_once(tmp_path):
    lock = RunLock(tmp_path)
    with pytest.raises(RunDirectoryError, match=f"in use by another run \\(pid {os.getpid()}\\)"):
        claim(tmp_path, resume=False, overwrite=False)
    lock.release()
    claim(tmp_path, resume=False, overwrite=False).release()  # free again


@pytest.mark.slow
def test_a_process_that_dies_holding_the_lock_releases_it(tmp_path):
    """The OS closes its file."""
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; sys.path.insert(0, sys.argv[1]);"
                               "from train.run.rundir import RunLock; RunLock(__import__('pathlib').Path(sys.argv[2]));"
                               "print('locked', flush=True); time.sleep(600)", str(ROOT), str(tmp_path)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunDirectoryError, match="in use by another run"):
            claim(tmp_path, resume=False, overwrite=False)
    finally:
        holder.kill()
        holder.wait()
    claim(tmp_path, resume=False, overwrite=False).release()


def test_a_failed_resume_writes_nothing(text_file, tmp_path, capsys):
    run = tmp_path / "run"
    run_experiment(config(text_file, run, "train.max_iters=10"), quiet=True)
    saved_config = (run / "config.json").read_text()
    with pytest.raises(CheckpointError, match="d_model"):
        run_experiment(config(text_file, run, "train.max_iters=20", "model.d_model=64"), quiet=True, resume=True)
    assert (run / "config.json").read_text() == saved_config  # not replaced by the rejected config
    fresh = tmp_path / "fresh"
    code, err = cli(capsys, "--set", *TINY, "--data", str(text_file), "--out-dir", str(fresh), "--resume", "--quiet")
    assert code == 1 and "no checkpoint" in err
    assert not (fresh / "checkpoints").exists() and not (fresh / "config.json").exists()


@pytest.mark.slow
def test_resume_without_a_checkpoint_in_a_real_process_is_one_line(text_file, tmp_path):
    """No orbax thread left behind to print a traceback at exit."""
    (tmp_path / "config.json").write_text("{}")  # a run stopped after compiling, before its first save
    done = subprocess.run([sys.executable, "-m", "train.tiny_lm", "--set", *TINY, "--data", str(text_file),
                           "--out-dir", str(tmp_path), "--resume", "--quiet"], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert done.returncode == 1 and last_line(done.stderr).startswith("error: --resume: no checkpoint")
    assert len(done.stderr.strip().splitlines()) == 1 and "--overwrite starts it again" in done.stderr


def opened_managers(monkeypatch) -> list:
    """Every orbax manager the checkpoints open from here on, each with `closed` set once closed."""
    opened, open_manager = [], checkpoint_lib.open_manager

    def recording(*args, **kwargs):
        manager = open_manager(*args, **kwargs)
        close = manager.close
        manager.closed = False

        def closing():
            close()
            manager.closed = True
        manager.close = closing
        opened.append(manager)
        return manager
    monkeypatch.setattr(checkpoint_lib, "open_manager", recording)
    return opened


def test_a_resume_that_cannot_start_closes_the_checkpoints_it_opened(text_file, tmp_path, monkeypatch):
    """The run stopped during its first save: only orbax's unfinished folder is there. The resume is
    refused, and the manager it opened to look is closed (its threads finished), so nothing of it
    can print after the program's `error:` line."""
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "checkpoints" / "latest" / "10.orbax-checkpoint-tmp-1").mkdir(parents=True)
    opened = opened_managers(monkeypatch)
    with pytest.raises(CheckpointError, match="--resume: no checkpoint"):
        run_experiment(config(text_file, tmp_path, "train.max_iters=20"), quiet=True, resume=True)
    assert opened and all(manager.closed for manager in opened)


def test_a_second_signal_during_a_save_stops_the_run_once_the_save_is_written(text_file, tmp_path, monkeypatch,
                                                                           capsys):
    """Two SIGINTs while a checkpoint is being written: the checkpoint is written whole and its manager
    closed, then the run stops at once, its one `stopped:` line last."""
    opened, saves, save = opened_managers(monkeypatch), [], checkpoint_lib.Checkpointer.save

    def interrupted_save(self, kind, step, *args, **kwargs):
        if not saves:
            signal.raise_signal(signal.SIGINT)  # the first asks the run to stop at its next safe point
            signal.raise_signal(signal.SIGINT)  # the second, before the save begins
        saves.append((kind, step))
        return save(self, kind, step, *args, **kwargs)
    monkeypatch.setattr(checkpoint_lib.Checkpointer, "save", interrupted_save)
    code, err = cli(capsys, "--set", *TINY, "train.max_iters=10", "--data", str(text_file), "--out-dir",
                    str(tmp_path), "--quiet")
    assert code == 130 and last_line(err) == "stopped: interrupted before python -m train.tiny_lm had finished"
    (kind, step), = saves
    assert finished_steps(tmp_path / "checkpoints" / kind) == [step]
    assert not [p for p in (tmp_path / "checkpoints" / kind).iterdir() if "tmp" in p.name]
    assert opened and all(manager.closed for manager in opened)


def test_repeated_set_flags_all_apply_in_compare():
    from train import compare
    args = compare.build_parser().parse_args(["--set", "train.max_iters=3", "--set", "model.d_model=64"])
    assert args.set == ["train.max_iters=3", "model.d_model=64"]


def test_compare_writes_under_runs_and_checks_its_arguments_first(text_file, tmp_path, monkeypatch, capsys):
    from train import compare
    monkeypatch.chdir(tmp_path)
    for argv, message in ((["--positions", "bogus"], "unknown --positions ['bogus']"),
                          (["--iters", "0"], "--iters must be >= 1")):
        with pytest.raises(SystemExit) as exit_info:
            compare.main(argv)
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
    rows = compare.main(["--kinds", "MHA,moe", "--positions", "rope", "--iters", "2", "--set", *TINY,
                         f"train.data_path='{text_file}'"])
    table = (tmp_path / "runs" / "compare" / "compare.md").read_text()
    assert not (tmp_path / "docs").exists() and "`python -m train.compare --iters 2 --kinds MHA,moe " in table
    assert "| kind | positions | val loss |" in table and "| total params | active params |" in table
    mha, moe = rows  # the dense kind: every parameter active; the MoE kind: 6 of its 8 experts idle per token
    assert [mha["kind"], moe["kind"]] == ["MHA", "MoE"] and mha["active_params"] == mha["params"]
    assert moe["active_params"] == moe["params"] - 6 * 3 * 32 * 168  # one MoE layer (layer 0 dense), d_model 32


# --------------------------------------------------------------------------------------------
# Divergence and a resume with nothing to do stop with one clear line


def test_a_diverging_run_stops_before_logging_or_saving_a_non_finite_loss(text_file, tmp_path, capsys):
    with pytest.raises(TrainingDiverged, match=r"the training loss is (nan|inf) at step \d+: training stopped"):
        run_experiment(config(text_file, tmp_path / "a", "train.max_iters=40", "train.lr=1e6", "train.min_lr=0",
                              "train.steps_per_dispatch=5"), quiet=True)
    assert all(np.isfinite(v) for r in metrics(tmp_path / "a") for k, v in r.items() if k != "step")
    code, err = cli(capsys, "--set", *TINY, "train.max_iters=40", "train.lr=1e6", "train.min_lr=0",
                    "--data", str(text_file), "--out-dir", str(tmp_path / "b"), "--quiet")
    assert code == 1 and err.startswith("error: the training loss is") and len(err.strip().splitlines()) == 1


def test_resume_past_max_iters_says_there_is_nothing_to_train(text_file, tmp_path, capsys):
    run_experiment(config(text_file, tmp_path, "train.max_iters=20"), quiet=True)
    code, err = cli(capsys, "--set", *TINY, "train.max_iters=10", "--data", str(text_file), "--out-dir",
                    str(tmp_path), "--resume", "--quiet")
    assert code == 1 and "checkpoint is at step 20 and train.max_iters=10: nothing to train" in err


# --------------------------------------------------------------------------------------------
# One clear line instead of a traceback


def test_bad_input_gives_one_line(text_file, tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    def run(out, *overrides, flags=()):
        return ["--set", *TINY, *overrides, "--data", str(text_file), "--quiet", "--out-dir", str(out), *flags]
    for argv, code, message in [
        (run(a_file), 1, "is a file, not a directory"),
        (run(a_file / "sub"), 1, "cannot use"),
        (run(tmp_path / "s", "train.seed=18446744073709551616"), 2, "train.seed must be less than 9223372036854775808"),
        (run(tmp_path / "p", "train.sample_prompt='€'", "train.sample_tokens=5"), 1,
         "train.sample_prompt cannot be encoded"),
        (run(tmp_path / "t", "train.sample_temperature=nan"), 2, "sample_temperature"),
        (run(tmp_path / "r", flags=("--resume", "--overwrite")), 2, "pick one"),
    ]:
        got, err = cli(capsys, *argv)
        assert got == code and message in err, (argv, got, err)
    assert not (tmp_path / "p").exists()  # the prompt is checked before anything is written
    bad_toml = tmp_path / "bad.toml"
    bad_toml.write_text("[model\nd_model = 3\n")
    got, err = cli(capsys, "--config", str(bad_toml))
    assert got == 2 and f"config file {bad_toml} is not valid TOML" in err


def test_a_read_only_run_directory_gives_one_line(text_file, tmp_path, capsys, monkeypatch):
    """(Simulated: the tests may run as root, who can write anywhere.)"""
    import errno

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")
    monkeypatch.setattr(Path, "mkdir", read_only)
    code, err = cli(capsys, "--set", *TINY, "--data", str(text_file), "--out-dir", str(tmp_path / "ro"), "--quiet")
    assert code == 1 and err == f"error: cannot use {tmp_path / 'ro'} as the run directory: Read-only file system\n"


def test_attention_maps_and_compare_check_their_outputs_before_any_work(tmp_path, capsys):
    from train import attention_maps, compare
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    for main, argv, code, message in [
        (attention_maps.main, ["--checkpoint", "does-not-matter", "--out", "maps.xyz"], 2,
         "error: --out maps.xyz: not an image type matplotlib writes"),
        (attention_maps.main, ["--checkpoint", "does-not-matter", "--out", str(a_file / "maps.png")], 1,
         f"error: --out {a_file}/maps.png: {a_file} is a file, so no folder can be made there"),
        (compare.main, ["--out", str(a_file)], 1, f"error: --out {a_file} is a file, not a folder"),
        (compare.main, ["--runs", str(a_file / "runs")], 1, f"error: --runs {a_file}/runs: {a_file} is a file"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        err = capsys.readouterr().err
        assert exit_info.value.code == code and err.startswith(message) and len(err.splitlines()) == 1, err


def test_a_full_disk_gives_one_line(text_file, tmp_path, capsys, monkeypatch):
    import errno

    import orbax.checkpoint as ocp

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(ocp.CheckpointManager, "save", no_space)
    code, err = cli(capsys, "--set", *TINY, "train.max_iters=10", "--data", str(text_file), "--out-dir",
                    str(tmp_path), "--quiet")
    assert code == 1 and err.startswith("error: saving ") and "No space left on device" in err
    assert len(err.strip().splitlines()) == 1


# --------------------------------------------------------------------------------------------
# Interrupts and crashes: the resumed run ends exactly where an uninterrupted one does


CRASH_RUN = [*TINY, "train.max_iters=40", "train.eval_interval=5", "train.steps_per_dispatch=5",
             "train.log_interval=3"]  # log intervals straddle dispatches: the interval in progress is saved too


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
    """JAX's persistent compilation cache, shared by this module's processes: each compiles the same
    tiny programs, so all but the first load them (the same executables, the same numbers)."""
    return {"JAX_COMPILATION_CACHE_DIR": str(tmp_path_factory.mktemp("jax_cache")),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


def start(text_file, out_dir, *extra, env):
    """`python -m train.tiny_lm` of CRASH_RUN in a new process, `env` added to its environment."""
    args = [sys.executable, "-m", "train.tiny_lm", "--set", *CRASH_RUN, "--data", str(text_file),
            "--out-dir", str(out_dir), "--quiet", *extra]
    return subprocess.Popen(args, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def uninterrupted(text_file, tmp_path_factory, compile_cache):
    out = tmp_path_factory.mktemp("uninterrupted")
    proc = start(text_file, out, env=compile_cache)
    assert proc.wait(timeout=300) == 0, proc.stderr.read()
    return (out / "metrics.jsonl").read_text(), load_for_sampling(out / "checkpoints" / "latest")[0]


def without_timings(metrics: str) -> list[dict]:
    """metrics.jsonl's records less `train_seconds` (a clock reading), which must still grow."""
    records = [json.loads(line) for line in metrics.splitlines()]
    seconds = [r.pop("train_seconds") for r in records if "val_loss" in r]
    assert seconds == sorted(seconds) and all(s >= 0 for s in seconds), seconds
    return records


def assert_same_run(out, uninterrupted):
    expected_metrics, expected_params = uninterrupted
    # each step once, the same numbers
    assert without_timings((Path(out) / "metrics.jsonl").read_text()) == without_timings(expected_metrics)
    params = load_for_sampling(Path(out) / "checkpoints" / "latest")[0]
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(expected_params)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_sigint_saves_exits_130_and_resume_continues_exactly(text_file, tmp_path, uninterrupted, compile_cache):
    proc = start(text_file, tmp_path, env=compile_cache)
    deadline = time.time() + 240
    latest = tmp_path / "checkpoints" / "latest"
    while not (latest.is_dir() and any(p.name.isdigit() for p in latest.iterdir())):  # after the first save
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read() if proc.poll() else "timeout"
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 130
    line = last_line(proc.stderr.read())
    assert line.startswith("stopped: SIGINT at step") and "--resume continues" in line
    resumed = start(text_file, tmp_path, "--resume", env=compile_cache)
    assert resumed.wait(timeout=300) == 0, resumed.stderr.read()
    assert_same_run(tmp_path, uninterrupted)


def finished_steps(latest: Path) -> list[int]:
    return sorted(int(p.name) for p in latest.iterdir() if p.name.isdigit())


@pytest.mark.slow
@pytest.mark.parametrize("moment, newest_checkpoint", [("step:12", 10), ("eval:15", 10), ("save:20", 15)])
def test_killed_at_a_planned_moment_then_resumed_ends_like_an_uninterrupted_run(
        text_file, tmp_path, moment, newest_checkpoint, uninterrupted, compile_cache):
    """SIGKILL (train.run.crash_points) while the steps 10-15 run, after the checkpoint at step 10; in the
    evaluation at step 15, its losses computed and the steps before it logged; in the save of step
    20, its files written and not committed. The newest valid checkpoint resumes, `metrics.jsonl`
    is repaired (each step once), and the run ends exactly as an uninterrupted one."""
    killed = start(text_file, tmp_path, env={**compile_cache, crash_points.ENV: moment})
    _, err = killed.communicate(timeout=300)
    assert killed.returncode == -signal.SIGKILL, f"not killed at {moment}: {err[-2000:]}"  # not finished first
    latest = tmp_path / "checkpoints" / "latest"
    assert finished_steps(latest)[-1] == newest_checkpoint
    event, step = moment.split(":")
    if event == "save":  # the killed save was really under way
        assert any(p.name.startswith(f"{step}.") and "tmp" in p.name for p in latest.iterdir())
    resumed = start(text_file, tmp_path, "--resume", env=compile_cache)
    assert resumed.wait(timeout=300) == 0, resumed.stderr.read()
    assert_same_run(tmp_path, uninterrupted)


def test_a_crash_point_is_named_exactly_or_refused(monkeypatch):
    signals = []
    monkeypatch.setattr(crash_points.os, "kill", lambda pid, sig: signals.append((pid, sig)))
    monkeypatch.setenv(crash_points.ENV, "save:20")
    assert crash_points.planned() == ("save", 20) and crash_points.save_path_class() is not None
    crash_points.kill_if_planned("save", 15)  # another step
    crash_points.kill_if_planned("eval", 20)  # another event
    assert signals == []
    crash_points.kill_if_planned("save", 19, 20)
    assert signals == [(os.getpid(), signal.SIGKILL)]
    for bad in ("save", "save:-1", "saving:20", "save:twenty"):
        monkeypatch.setenv(crash_points.ENV, bad)
        with pytest.raises(ValueError, match=f"{crash_points.ENV}='{bad}': expected EVENT:STEP"):
            crash_points.planned()
    monkeypatch.delenv(crash_points.ENV)
    assert crash_points.planned() is None and crash_points.save_path_class() is None


def test_repair_metrics_keeps_each_step_once_and_drops_a_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [{"step": 0, "train_loss": 4.0, "val_loss": 4.1}, {"step": 3, "loss": 3.5, "lr": 0.1},
             {"step": 5, "loss": 3.0, "lr": 0.1}, {"step": 5, "train_loss": 3.1, "val_loss": 3.2},
             {"step": 8, "loss": 2.9, "lr": 0.1}]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 10, "lo')
    repair_metrics(path, 5, evaluates_again=True)
    assert [json.loads(line) for line in path.read_text().splitlines()] == lines[:3]


# --------------------------------------------------------------------------------------------
# Every moment of a run ends in one line, with what was done kept


def last_line(err: str) -> str:
    """The program's outcome, its last `error:` or `stopped:` line, which must be the last line: nothing
    (no background thread's report) may follow it."""
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    outcome = max(i for i, line in enumerate(lines) if line.startswith(("error:", "stopped:")))
    assert outcome == len(lines) - 1, f"lines after {lines[outcome]!r}: {lines[outcome + 1:]}"
    return lines[outcome]


def wait_for(predicate, proc, what: str, timeout: float = 240):
    deadline = time.time() + timeout
    while not predicate():
        assert proc.poll() is None, f"exited before {what}: {proc.stderr.read()[-2000:]}"
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


def wait_for_line(proc, prefix: str) -> None:
    for line in proc.stdout:
        if line.startswith(prefix):
            return
    raise AssertionError(f"no line starting {prefix!r}: {proc.stderr.read()[-2000:]}")


@pytest.mark.slow
def test_sigint_while_compiling_stops_with_nothing_written(text_file, tmp_path):
    """No compilation cache here: compiling takes seconds, and the signal comes right after the
    'parameters:' line that precedes it."""
    args = [sys.executable, "-m", "train.tiny_lm", "--set", *CRASH_RUN, "--data", str(text_file),
            "--out-dir", str(tmp_path)]
    proc = subprocess.Popen(args, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    wait_for_line(proc, "parameters:")
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 130
    assert last_line(proc.stderr.read()) == ("stopped: SIGINT before training began: nothing was trained or "
                                             "written; run the same command again")
    assert [p.name for p in tmp_path.iterdir()] == [".lock"]  # the same command runs again without --overwrite


@pytest.mark.slow
def test_sigint_during_a_save_keeps_it_and_resume_continues_exactly(text_file, tmp_path, uninterrupted, compile_cache):
    """The signal is sent the moment orbax starts writing a checkpoint (its temporary folder appears):
    the save completes, the run stops there, and the resumed run equals an uninterrupted one."""
    proc = start(text_file, tmp_path, env=compile_cache)
    latest = tmp_path / "checkpoints" / "latest"
    wait_for(lambda: latest.is_dir() and any("tmp" in p.name for p in latest.iterdir()), proc, "a save")
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 130
    line = last_line(proc.stderr.read())
    assert re.fullmatch(rf"stopped: SIGINT at step (\d+): saved {latest}/\1; --resume continues from there", line)
    resumed = start(text_file, tmp_path, "--resume", env=compile_cache)
    assert resumed.wait(timeout=300) == 0, resumed.stderr.read()
    assert_same_run(tmp_path, uninterrupted)


SAMPLED_RUN = [*TINY, "train.max_iters=10", "train.sample_tokens=20000", "train.plot=true"]


def sampled_run(text_file, out, *extra, env):
    args = [sys.executable, "-m", "train.tiny_lm", "--set", *SAMPLED_RUN, "--data", str(text_file),
            "--out-dir", str(out), *extra]
    return subprocess.Popen(args, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_sigint_during_the_end_of_run_sample_prints_it_and_writes_the_result(text_file, tmp_path, compile_cache):
    proc = sampled_run(text_file, tmp_path, env=compile_cache)
    wait_for_line(proc, "sampling 20000 tokens")
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130
    drawn = re.fullmatch(r"stopped: SIGINT during the end-of-run sample, after (\d+) of 20000 tokens: the run is "
                         r"trained and saved, its sample cut short", last_line(err))
    assert drawn and 0 < int(drawn.group(1)) < 20000
    assert ", stopped early) ---\n" in out and "final: val loss" in out
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["stopped"] == last_line(err)[len("stopped: "):] and len(result["sample"]) == 1 + int(drawn.group(1))
    assert (tmp_path / "loss.png").is_file()


@pytest.mark.slow
def test_a_run_killed_after_its_final_save_is_finished_by_resume(text_file, tmp_path, compile_cache):
    """SIGKILL while it samples (after the final checkpoint): no result.json, no plot; --resume adds them
    without training again, and metrics.jsonl keeps its last evaluation once."""
    proc = sampled_run(text_file, tmp_path, env=compile_cache)
    wait_for_line(proc, "sampling 20000 tokens")
    proc.kill()
    proc.wait()
    assert not (tmp_path / "result.json").exists() and not (tmp_path / "loss.png").exists()
    before = metrics(tmp_path)
    finished = sampled_run(text_file, tmp_path, "--resume", "--set", "train.sample_tokens=20", env=compile_cache)
    out, err = finished.communicate(timeout=300)
    assert finished.returncode == 0, err
    assert "resumed from step 10 (val loss" in out and "(the last: finishing the run" in out
    assert "final: val loss" in out and (tmp_path / "loss.png").is_file()
    assert json.loads((tmp_path / "result.json").read_text())["final_val_loss"] == before[-1]["val_loss"]
    assert metrics(tmp_path) == before  # the evaluation at step 10 again, the same numbers, once


def test_resume_refuses_a_corpus_that_gives_another_tokenizer(text_file, tmp_path, capsys):
    run_experiment(config(text_file, tmp_path / "run", "train.max_iters=10"), quiet=True)
    other = tmp_path / "other.txt"
    other.write_text(text_file.read_text(encoding="utf-8").upper(), encoding="utf-8")  # other characters
    saved = (tmp_path / "run" / "metrics.jsonl").read_text()
    code, err = cli(capsys, "--set", *TINY, "train.max_iters=20", "--data", str(other), "--out-dir",
                    str(tmp_path / "run"), "--resume", "--quiet")
    assert code == 1 and len(err.splitlines()) == 1
    assert re.match(rf"error: --resume: the corpus {other} does not give the run's tokenizer: its characters differ "
                    r"from the run's \(\d+ then, \d+ now; new '[A-Z]*', gone '[a-z]+'\), so every token id would mean "
                    rf"something else. Resume with the run's corpus \({text_file}\)", err), err
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == saved


def test_quiet_still_shows_that_a_resumed_run_will_not_replay_exactly(text_file, tmp_path, capsys):
    run_experiment(config(text_file, tmp_path, "train.max_iters=10"), quiet=True)
    tiny_lm.main(["--set", *TINY, "train.max_iters=20", "train.lr=2e-3", "--data", str(text_file),
                  "--out-dir", str(tmp_path), "--resume", "--quiet"])
    err = capsys.readouterr().err
    assert "warning: resumed run differs from the checkpoint (train.lr was 0.003, now 0.002)" in err


def test_resume_falls_back_when_the_newest_meta_is_missing(text_file, tmp_path, capsys):
    run_experiment(config(text_file, tmp_path, "train.max_iters=20"), quiet=True)  # latest keeps steps 10 and 20
    (tmp_path / "checkpoints" / "latest" / "20" / "meta" / "metadata").unlink()
    tiny_lm.main(["--set", *TINY, "train.max_iters=30", "--data", str(text_file), "--out-dir", str(tmp_path),
                  "--resume", "--quiet"])
    err = capsys.readouterr().err
    assert f"warning: checkpoint {tmp_path}/checkpoints/latest/20: its meta " \
           f"({tmp_path}/checkpoints/latest/20/meta/metadata) cannot be read" in err
    assert "; using step 10 instead" in err
    assert [r["step"] for r in metrics(tmp_path) if "val_loss" in r] == [0, 10, 20, 30]


def test_outputs_and_usage_are_checked_before_anything_runs(text_file, tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    base = ["--set", *TINY, "--data", str(text_file), "--quiet", "--out-dir", str(tmp_path / "run")]
    code, err = cli(capsys, *base, "--loss-plot", str(a_file / "loss.png"))
    assert (code, err) == (1, f"error: --loss-plot {a_file}/loss.png: {a_file} is a file, so no folder can be "
                              "made there\n")
    code, err = cli(capsys, *base, "--loss-plot", str(tmp_path / "loss.svgz2"))
    assert code == 2 and err.startswith("error: --loss-plot") and err.endswith("(see python -m train.tiny_lm --help)\n")
    code, err = cli(capsys, *base, "--set", "model.d_model=-3")
    assert code == 2 and len(err.splitlines()) == 1 and err.endswith("(see python -m train.tiny_lm --help)\n")
    code, err = cli(capsys, *base, "--cpu-devices", "1000")
    assert code == 2 and "runtime.mesh='data:1,fsdp:1,tensor:1' uses 1 device(s) but runtime.cpu_devices=1000 makes 1000" in err
    code, err = cli(capsys, *base, "--cpu-devices", "1000", "--set", "runtime.mesh=auto")
    assert code == 2 and "runtime.cpu_devices=1000 makes 1000 host device(s), but a batch of 4 splits over at " \
                         "most 4 of them: ask for --cpu-devices 4, or give --mesh" in err
    assert not (tmp_path / "run").exists()
