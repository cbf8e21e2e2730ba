"""bench/train.py's turn-taking with the nanoGPT port, driven against a stand-in port (no torch here)."""

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Stands in for `python bench/nanogpt_baseline.py ... --lockstep`: same arguments, same pause protocol
# (and the same eval points: every 250 iters and the last one); logs each segment to a file.
FAKE_PORT = '''
import argparse, json, os, sys
p = argparse.ArgumentParser()
p.add_argument("script"); p.add_argument("--data"); p.add_argument("--max-iters", type=int)
p.add_argument("--lr-decay-iters"); p.add_argument("--threads"); p.add_argument("--json")
p.add_argument("--lockstep", action="store_true")
a = p.parse_args()
trace = open(os.environ["FAKE_PORT_TRACE"], "w")
for it in range(a.max_iters + 1):
    if it % 250 == 0 or it == a.max_iters:
        print("LOCKSTEP at iter", it, flush=True)
        if sys.stdin.readline().strip() != "go":
            sys.exit(3)
        print(f"step {it}: val loss 2.0", flush=True)
        trace.write(f"eval {it}\\n"); trace.flush()
    if it == a.max_iters:
        break
json.dump({"median_ms_per_iter": 30.0, "median_tokens_per_s": 25600.0, "final_val_loss": 1.9}, open(a.json, "w"))
'''


@pytest.fixture(scope="module")
def bench_train():
    spec = importlib.util.spec_from_file_location("bench_train", ROOT / "bench" / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def fake_python(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_PORT_TRACE", str(tmp_path / "trace.txt"))
    script = tmp_path / "fake_port.py"
    script.write_text(FAKE_PORT)
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nexec {sys.executable} {script} \"$@\"\n")
    python.chmod(0o755)
    return python


def _trace():
    return Path(os.environ["FAKE_PORT_TRACE"]).read_text().split("\n")[:-1]


@pytest.mark.slow
def test_port_runs_one_eval_interval_per_turn(bench_train, fake_python, tmp_path):
    run = bench_train.NanoGPTInTurns(str(fake_python), tmp_path / "data.txt", iters=600, lr_decay_iters=600,
                                     threads=2)
    assert _trace() == []  # started, paused at its first eval point
    assert run.turn(0)
    assert _trace() == ["eval 0"]  # eval 0, then iters 0-249, paused before eval 250
    assert run.turn(250)
    assert _trace() == ["eval 0", "eval 250"]
    record = run.finish()  # the remaining turns: eval 500, iters to 600, eval 600
    assert _trace() == ["eval 0", "eval 250", "eval 500", "eval 600"]
    assert not run.json_path.parent.exists()  # its temporary directory is removed
    assert record["measured"] and record["interleaved"] and record["final_val_loss"] == 1.9
    assert "in turns" in record["source"]


@pytest.mark.slow
def test_a_port_that_fails_is_reported(bench_train, tmp_path):
    broken = tmp_path / "python"
    broken.write_text("#!/bin/sh\necho 'Traceback: no torch'\nexit 1\n")
    broken.chmod(0o755)
    run = bench_train.NanoGPTInTurns(str(broken), tmp_path / "data.txt", iters=10, lr_decay_iters=10, threads=1)
    with pytest.raises(RuntimeError, match="exited with status 1"):
        run.finish()


def _record():
    """The last results file, in the form bench/train.py writes now."""
    record = json.loads((ROOT / "bench" / "results" / "train.json").read_text())
    record.update(kernels={"attention": "custom_vjp", "decode": "xla_cpu", "matmul": "xla", "mla": "naive"},
                  kernel_reasons={"matmul": "this CPU has no AMX-BF16: bfloat16 matmuls are slower than float32 here"})
    record["env"] = {"cpu": "AMD EPYC", "platform": "cpu backend (avx2)", "cpus": 2, "jax": "0.10.2"}
    return record


def test_markdown_says_the_runs_took_turns(bench_train):
    record = _record()
    record["nanogpt"].update(measured=True, interleaved=True, fastest_ms_per_iter=25.0,
                             source="measured in this run, in turns")
    text = bench_train.markdown(record)
    assert "nanoGPT (measured, this run)" in text and "take turns" in text


def test_markdown_names_the_kernels_why_and_the_cpu(bench_train):
    text = bench_train.markdown(_record())
    assert ("kernels: attention 'custom_vjp', dense matmuls 'xla' (this CPU has no AMX-BF16: bfloat16 matmuls "
            "are slower than float32 here)") in text
    assert "AMD EPYC (cpu backend (avx2), 2 CPUs)" in text


def test_markdown_names_the_threads_of_both_sides(bench_train):
    record = _record()
    record["threads"] = {"ours": 4, "nanogpt": 4}
    assert "ours on 4 cores, nanoGPT with 4 torch threads" in bench_train.markdown(record)


def test_nanogpt_gets_as_many_threads_as_the_cores_jax_uses_by_default(bench_train, capsys):
    from bench.machine import cpu_cores
    with pytest.raises(SystemExit):
        bench_train.main(["--help"])
    assert f"default: the cores JAX uses, {cpu_cores()})" in " ".join(capsys.readouterr().out.split())


def test_the_recorded_command_names_no_interpreter_of_this_machine(bench_train):
    command = bench_train.portable_command(["--nanogpt-python", "/usr/x/bin/python", "--float32-too"],
                                           ("--nanogpt-python",))
    assert command == "--nanogpt-python /path/to/nanogpt_python --float32-too"
