"""bench/fresh.py: a function or a script in a fresh interpreter, its JSON, its environment, its failures."""

import json
import sys

import pytest

from bench import fresh


def test_a_peer_with_threads_gets_them_in_every_pool_and_keeps_the_users_wait_policy(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    env = fresh.environment(4)
    assert [env[name] for name in fresh.THREAD_VARIABLES] == ["4"] * len(fresh.THREAD_VARIABLES)
    assert "OMP_WAIT_POLICY" not in env and env["PYTHONPATH"] == str(fresh.ROOT)  # torch's default
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert fresh.environment(4)["OMP_WAIT_POLICY"] == "PASSIVE"


def test_without_threads_the_thread_pools_are_left_alone(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    env = fresh.environment(xla_flags="--xla_cpu_multi_thread_eigen=false", EXTRA="x")
    assert "OMP_NUM_THREADS" not in env
    assert env["XLA_FLAGS"] == "--xla_cpu_multi_thread_eigen=false" and env["EXTRA"] == "x"


def environment_of(spec: dict) -> dict:
    """Run in the fresh process by `fresh.call`: the variables named in `spec["names"]`."""
    import os
    return {name: os.environ.get(name) for name in spec["names"]}


@pytest.mark.slow
def test_a_function_runs_in_a_fresh_process_with_the_threads_and_flags_asked_for():
    names = ["OMP_NUM_THREADS", "MKL_NUM_THREADS", "XLA_FLAGS", "EXTRA"]
    seen = fresh.call("tests.bench.test_bench_fresh:environment_of", {"names": names}, threads=3,
                      xla_flags="--xla_cpu_multi_thread_eigen=false", EXTRA="x")
    assert seen == {"OMP_NUM_THREADS": "3", "MKL_NUM_THREADS": "3",
                    "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false", "EXTRA": "x"}


@pytest.mark.slow
def test_a_script_gives_its_last_json_line_its_time_and_its_own_peak_memory(tmp_path):
    script = tmp_path / "script.py"
    script.write_text("import json\nblock = bytearray(64 * 2**20)\nprint('working')\n"
                      "print(json.dumps({'held': len(block)}))\n")
    done = fresh.run([sys.executable, script])
    assert done.json() == {"held": 64 * 2**20}
    assert done.wall_s > 0 and done.peak_rss_bytes > 64 * 2**20


@pytest.mark.slow
def test_a_failure_names_what_failed_and_its_last_error_line(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text("import sys\nprint('partial')\nsys.exit('error: the data file is missing')\n")
    with pytest.raises(fresh.FreshProcessError, match="the port exited with status 1: error: the data file"):
        fresh.run([sys.executable, script], what="the port")


@pytest.mark.slow
def test_a_process_past_its_timeout_is_stopped_and_reported(tmp_path):
    script = tmp_path / "sleeps.py"
    script.write_text("import time\ntime.sleep(60)\n")
    with pytest.raises(fresh.FreshProcessError, match="ran past its timeout of 0.5 s"):
        fresh.run([sys.executable, script], what="the sleeper", timeout=0.5)


@pytest.mark.slow
def test_the_module_entry_point_prints_one_json_line_and_rejects_bad_usage():
    done = fresh.run(fresh.function_argv("tests.bench.test_bench_fresh:environment_of", {"names": ["PYTHONPATH"]}))
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"PYTHONPATH": str(fresh.ROOT)}
    with pytest.raises(fresh.FreshProcessError, match="status 2: error: usage"):
        fresh.run([sys.executable, "-m", "bench.fresh", "no-colon"])
