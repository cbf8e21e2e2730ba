"""Benchmark of the default training run against nanoGPT on the machine it runs on, side by side.

    PYTHONPATH=$PWD python bench/train.py [--set train.max_iters=500 ...] \
        [--nanogpt-python /path/to/python-with-torch [--nanogpt-max-iters N]] [--float32-too]
    PYTHONPATH=$PWD python bench/train.py --mesh [--iters 10 ...]   # bench/mesh.py: meshes, memory per device
    PYTHONPATH=$PWD python bench/train.py --race [--rounds 3] [--nanogpt-python PY]   # bench/speedrun.py
    PYTHONPATH=$PWD python bench/train.py --ablation [--budget 15]                    # bench/speedrun.py
    PYTHONPATH=$PWD python3 bench/train.py --gpu-race [--rounds 1] [--max-iters N]    # bench/speedrun.py

Runs configs/shakespeare_char_baby.toml (2000 iters) and writes bench/results/train.json and
train.md: median tokens/s and ms/iter (excluding compile), compile time, final val loss, wall time,
the kernels the runtime chose, the CPU, and the ratio to nanoGPT. With --nanogpt-python (an
interpreter that has torch), nanoGPT's baby run (bench/nanogpt_baseline.py, a port of its model.py
and train.py) trains on the same data file and iters in turns with ours (one eval interval each,
alternating), with as many torch threads as the cores JAX uses (--nanogpt-threads), and the table
shows both as measured in this run. Without it, nanoGPT's figures are quoted from measurements of
the same 2-core CPU type made outside this repository, and the column says so. --float32-too also
trains the same config with the reference kernels (`runtime.matmul=xla runtime.attention=xla`), to
show what the chosen kernels give.

--race, --ablation and --gpu-race (bench/speedrun.py, its own flags): the speedrun config's time to
nanoGPT's val loss against nanoGPT in rounds of turns (bench/results/speedrun.md), the recipe with
each switch off (ablation.md), and the same race with nanoGPT's GPU config (speedrun_gpu.md).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import fresh  # noqa: E402
from bench.machine import cpu_cores, describe_machine, machine_line, portable_command, write_results  # noqa: E402
from train.config import DEFAULT_CONFIG, load_config  # noqa: E402
from train.data.corpus import resolve_data_path  # noqa: E402
from train.run import runtime as runtime_lib  # noqa: E402
from train.run.experiment import run_experiment  # noqa: E402

NANOGPT_QUOTED = {"measured": False, "iters": 2000, "ms_per_iter_range": [45.6, 48.7],
                  "median_ms_per_iter": (45.6 + 48.7) / 2, "median_tokens_per_s": 16_000,
                  "final_val_loss": 1.8857, "wall_s": 132.0,
                  "source": "quoted, not measured in this run: the peers' figures for the same 2-core CPU type, "
                            "torch eager, 2 threads (measured outside this repository)"}
NANOGPT_SCRIPT = Path(__file__).resolve().parent / "nanogpt_baseline.py"
RESULTS = Path(__file__).resolve().parent / "results"
FLOAT32_OVERRIDES = ["runtime.matmul=xla", "runtime.attention=xla"]


LOCKSTEP_PREFIX = "LOCKSTEP at iter"  # what nanogpt_baseline.py --lockstep prints at each eval point


class NanoGPTInTurns:
    """nanoGPT's baby run in a subprocess, trained in turns with ours.

    The port (`--lockstep`) stops at each of its eval points until told to go on; `turn`, called
    after each of our evals, lets it run its next eval interval. So the two runs alternate every
    250 iters (a few seconds) and are timed in the same minutes: a shared machine's speed can
    drift by up to 2x over minutes, enough to make back-to-back runs disagree about the ratio.
    It runs with `threads` torch threads (and the OMP/MKL variables set to match).
    """

    def __init__(self, python: str, data: Path, iters: int, lr_decay_iters: int, threads: int):
        self.json_path = Path(tempfile.mkdtemp()) / "nanogpt.json"
        self.threads = threads
        self.seconds = 0.0  # spent in the port's turns (not part of our wall time)
        self.proc = subprocess.Popen(
            [python, str(NANOGPT_SCRIPT), "--data", str(data), "--max-iters", str(iters), "--lockstep",
             "--lr-decay-iters", str(lr_decay_iters), "--threads", str(threads), "--json", str(self.json_path)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1, env=fresh.environment(threads))
        self._run_to_pause()  # torch import and model set-up happen before our run starts

    def _run_to_pause(self) -> bool:
        """Echoes the port's output until it pauses (True) or exits (False)."""
        for line in self.proc.stdout:
            if line.startswith(LOCKSTEP_PREFIX):
                return True
            print(f"[nanoGPT] {line}", end="", flush=True)
        return False

    def turn(self, step: int | None = None) -> bool:
        """Lets the port run to its next eval point; False once it has finished."""
        start = time.perf_counter()
        try:
            return self._go()
        finally:
            self.seconds += time.perf_counter() - start

    def _go(self) -> bool:
        try:
            self.proc.stdin.write("go\n")
            self.proc.stdin.flush()
        except BrokenPipeError:  # it has exited
            return False
        return self._run_to_pause()

    def finish(self) -> dict:
        """Runs the port to its end; its JSON record, marked as measured."""
        while self.turn():
            pass
        if self.proc.wait() != 0:
            raise RuntimeError(f"nanoGPT port exited with status {self.proc.returncode}")
        record = json.loads(self.json_path.read_text())
        shutil.rmtree(self.json_path.parent, ignore_errors=True)
        return {**record, "measured": True, "interleaved": True,
                "source": f"measured in this run, in turns of one eval interval with ours: "
                          f"{NANOGPT_SCRIPT.name} (torch eager, {self.threads} threads)"}


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--mesh" in argv:  # the mesh benchmark: its own processes and flags (bench/mesh.py)
        from bench import mesh
        return mesh.main([a for a in argv if a != "--mesh"])
    if {"--race", "--ablation", "--gpu-race"} & set(argv):  # the speedrun benchmarks (bench/speedrun.py)
        from bench import speedrun
        return speedrun.main(argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mesh", action="store_true",
                        help="instead: speed and memory per device on device meshes (bench/mesh.py's flags)")
    parser.add_argument("--config", default=DEFAULT_CONFIG)
    parser.add_argument("--set", nargs="+", action="extend", default=[])
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--nanogpt-python", help="a Python with torch: also run nanoGPT's baby run side by side")
    parser.add_argument("--nanogpt-max-iters", type=int, help="nanoGPT's iters (default: the same as ours)")
    parser.add_argument("--nanogpt-threads", type=int, default=cpu_cores(),
                        help="torch threads (default: the cores JAX uses, %(default)s)")
    parser.add_argument("--float32-too", action="store_true",
                        help="also train with float32 matmuls and autodiff attention")
    args = parser.parse_args(argv)
    command = "PYTHONPATH=$PWD python bench/train.py " + portable_command(
        sys.argv[1:] if argv is None else argv, ("--nanogpt-python", "--out"))
    config = load_config(args.config, ["train.out_dir='runs/bench_train'", *args.set])
    runtime = runtime_lib.start(config.runtime, config.train.batch_size, model=config.model)  # before JAX starts
    tc = config.train
    nanogpt_run = None
    if args.nanogpt_python:
        nanogpt_run = NanoGPTInTurns(args.nanogpt_python, resolve_data_path(tc.data_path, download_if_missing=False),
                                     args.nanogpt_max_iters or tc.max_iters, tc.lr_decay_iters, args.nanogpt_threads)
    # runs/bench_train*: this benchmark's own scratch runs, replaced each time
    result = run_experiment(config, runtime=runtime, overwrite=True, quiet=False,
                            after_eval=nanogpt_run.turn if nanogpt_run else None)
    nanogpt = nanogpt_run.finish() if nanogpt_run else NANOGPT_QUOTED
    float32 = None
    if args.float32_too:
        plain = load_config(args.config, ["train.out_dir='runs/bench_train_float32'", *args.set,
                                          *FLOAT32_OVERRIDES])
        r32 = run_experiment(plain, runtime=runtime_lib.resolve(plain.runtime, tc.batch_size), overwrite=True,
                             quiet=False)
        float32 = {"overrides": FLOAT32_OVERRIDES, "final_val_loss": r32.final_val_loss,
                   "median_tokens_per_s": r32.median_tokens_per_s, "median_ms_per_iter": r32.median_ms_per_iter,
                   "fastest_ms_per_iter": r32.fastest_ms_per_iter, "compile_s": r32.compile_s, "wall_s": r32.wall_s}
    record = {
        "command": command, "config": config.name, "overrides": args.set, "iters": result.steps,
        "final_val_loss": result.final_val_loss, "median_tokens_per_s": result.median_tokens_per_s,
        "median_ms_per_iter": result.median_ms_per_iter, "fastest_ms_per_iter": result.fastest_ms_per_iter,
        "compile_s": result.compile_s,
        "wall_s": result.wall_s - (nanogpt_run.seconds if nanogpt_run else 0.0),  # without the port's turns
        "steps_per_dispatch": tc.steps_per_dispatch, "mesh": str(runtime.mesh_shape),
        "params": result.num_params, "nanogpt": nanogpt, "float32": float32,
        "speedup_vs_nanogpt_tokens_per_s": result.median_tokens_per_s / nanogpt["median_tokens_per_s"],
        "speedup_vs_nanogpt_ms_per_iter": nanogpt["median_ms_per_iter"] / result.median_ms_per_iter,
        "tokens_per_step": tc.batch_size * tc.block_size,
        "kernels": runtime.kernels.to_dict(), "kernel_reasons": runtime.reasons,  # what "auto" resolved to here
        "env": describe_machine(),
        "threads": {"ours": cpu_cores(), "nanogpt": args.nanogpt_threads if nanogpt_run else None},
    }
    write_results(args.out, "train", record, markdown(record))
    return record


def threads_note(r: dict) -> str:
    """", ours on N cores, nanoGPT with M torch threads" where the record has them."""
    threads = r.get("threads") or {}
    ours = f", ours on {threads['ours']} cores" if threads.get("ours") else ""
    return ours + (f", nanoGPT with {threads['nanogpt']} torch threads" if threads.get("nanogpt") else "")


def disturbed_warning(r: dict) -> list[str]:
    """A warning line when a median is far above its fastest: other processes took the cores."""
    n = r["nanogpt"]
    sides = [("jaxattn", r["median_ms_per_iter"] / r["fastest_ms_per_iter"])]
    if n["measured"]:
        sides.append(("nanoGPT", n["median_ms_per_iter"] / n["fastest_ms_per_iter"]))
    slow = [f"{name} median {ratio:.1f}x its fastest" for name, ratio in sides if ratio > 1.5]
    return [f"**Disturbed run** ({', '.join(slow)}): re-run on a quiet machine before quoting the ratio.", ""] \
        if slow else []


def markdown(r: dict) -> str:
    n, measured, f = r["nanogpt"], r["nanogpt"]["measured"], r.get("float32")
    approx = "" if measured else "~"
    ms = f"{n['median_ms_per_iter']:.1f}" if measured else "{}-{}".format(*n["ms_per_iter_range"])
    fastest = f"{n['fastest_ms_per_iter']:.1f} (one iter)" if measured else ""
    column = "nanoGPT (measured, this run)" if measured else "nanoGPT (quoted, not this run)"
    iters = "" if n["iters"] == r["iters"] else f" (nanoGPT: {n['iters']} iters)"
    f_head, f_rule = (" jaxattn, float32 matmuls + autodiff attention |", " ---: |") if f else ("", "")

    def f_cell(key, fmt):
        return f" {format(f[key], fmt)} |" if f else ""
    return "\n".join([
        f"# Training benchmark: {r['config']} ({r['iters']} iters{', ' + ' '.join(r['overrides']) if r['overrides'] else ''})",
        "",
        f"| | jaxattn, default config |{f_head} {column} | ratio |",
        f"| --- | ---: |{f_rule} ---: | ---: |",
        f"| tokens/s (median, excl. compile) | {r['median_tokens_per_s']:,.0f} |{f_cell('median_tokens_per_s', ',.0f')} "
        f"{approx}{n['median_tokens_per_s']:,.0f} | {r['speedup_vs_nanogpt_tokens_per_s']:.2f}x |",
        f"| ms/iter (median) | {r['median_ms_per_iter']:.1f} |{f_cell('median_ms_per_iter', '.1f')} {ms} | "
        f"{r['speedup_vs_nanogpt_ms_per_iter']:.2f}x (nanoGPT ms / ours) |",
        f"| ms/iter (fastest {r['steps_per_dispatch']}-step dispatch) | {r['fastest_ms_per_iter']:.1f} |"
        f"{f_cell('fastest_ms_per_iter', '.1f')} {fastest} | |",
        f"| val loss at the last iter{iters} | {r['final_val_loss']:.4f} |{f_cell('final_val_loss', '.4f')} "
        f"{n['final_val_loss']:.4f} | |",
        f"| compile time (s) | {r['compile_s']:.1f} |{f_cell('compile_s', '.1f')} n/a (eager) | |",
        f"| wall time (s) | {r['wall_s']:.1f} |{f_cell('wall_s', '.1f')} {approx}{n['wall_s']:.0f} | |",
        "",
        f"{r['steps_per_dispatch']} optimizer steps per jitted dispatch (lax.scan), mesh "
        f"{r.get('mesh', 'data:' + str(r.get('data_parallel')))}; kernels: attention {r['kernels']['attention']!r}, dense matmuls "
        f"{r['kernels']['matmul']!r} ({r['kernel_reasons']['matmul']}); {r['params']:,} parameters; "
        f"{machine_line(r['env'])}{threads_note(r)}. "
        f"nanoGPT figures: {n['source']}. The machine is shared, "
        "so timings drift (up to ~2x over minutes); only a measured column gives a same-run ratio"
        + (", and the two runs take turns every eval interval so that both see the same minutes."
           if n.get("interleaved") else "."),
        "",
        *disturbed_warning(r),
        f"Made by: `{r['command']}`",
        "",
    ])


if __name__ == "__main__":
    main()
