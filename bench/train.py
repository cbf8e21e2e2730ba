"""Benchmark of the default training run against nanoGPT on this machine.

    PYTHONPATH=$PWD python bench/train.py [--set train.max_iters=500 ...]

Runs configs/shakespeare_char_baby.toml (2000 iters) and writes bench/results/train.json and
train.md: median tokens/s and ms/iter (excluding compile), compile time, final val loss,
wall time, and the ratio to nanoGPT's baby run measured on the same machine
(/work/shared/perf/README.md: 45.6-48.7 ms/iter, ~16k tokens/s, val loss 1.8857).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402

from train.config import DEFAULT_CONFIG, load_config  # noqa: E402
from train.tiny_lm import apply_xla_flags, run_flags, train  # noqa: E402

NANOGPT = {"ms_per_iter": (45.6, 48.7), "tokens_per_s": 16_000, "val_loss": 1.8857,
           "source": "/work/shared/perf/README.md (torch eager, 2 threads, same 2-core CPU)"}
RESULTS = Path(__file__).resolve().parent / "results"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=DEFAULT_CONFIG)
    parser.add_argument("--set", nargs="*", default=[])
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    config = load_config(args.config, ["train.out_dir='runs/bench_train'", *args.set])
    apply_xla_flags(run_flags(config.train))
    result = train(config, quiet=False)
    nanogpt_ms = sum(NANOGPT["ms_per_iter"]) / 2
    tokens_per_step = config.train.batch_size * config.train.block_size
    record = {
        "config": config.name, "overrides": args.set, "iters": result.steps,
        "final_val_loss": result.final_val_loss, "median_tokens_per_s": result.median_tokens_per_s,
        "median_ms_per_iter": result.median_ms_per_iter, "fastest_ms_per_iter": result.fastest_ms_per_iter,
        "compile_s": result.compile_s, "wall_s": result.wall_s,
        "steps_per_dispatch": config.train.steps_per_dispatch,
        "data_parallel": config.train.data_parallel, "params": result.num_params,
        "nanogpt": NANOGPT, "speedup_vs_nanogpt_tokens_per_s": result.median_tokens_per_s / NANOGPT["tokens_per_s"],
        "speedup_vs_nanogpt_ms_per_iter": nanogpt_ms / result.median_ms_per_iter,
        "tokens_per_step": tokens_per_step,
        "env": {"jax": jax.__version__, "python": platform.python_version(), "cpus": os.cpu_count(),
                "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")},
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "train.json").write_text(json.dumps(record, indent=2))
    (out / "train.md").write_text(markdown(record))
    print(markdown(record))
    return record


def markdown(r: dict) -> str:
    n = r["nanogpt"]
    return "\n".join([
        f"# Training benchmark: {r['config']} ({r['iters']} iters{', ' + ' '.join(r['overrides']) if r['overrides'] else ''})",
        "",
        "| | jaxattn (this run) | nanoGPT (same CPU) | ratio |",
        "| --- | ---: | ---: | ---: |",
        f"| tokens/s (median, excl. compile) | {r['median_tokens_per_s']:,.0f} | ~{n['tokens_per_s']:,} | "
        f"{r['speedup_vs_nanogpt_tokens_per_s']:.2f}x |",
        f"| ms/iter (median) | {r['median_ms_per_iter']:.1f} | {n['ms_per_iter'][0]}-{n['ms_per_iter'][1]} | "
        f"{r['speedup_vs_nanogpt_ms_per_iter']:.2f}x (nanoGPT ms / ours) |",
        f"| ms/iter (fastest 50-step dispatch) | {r['fastest_ms_per_iter']:.1f} | | |",
        f"| val loss at the last iter | {r['final_val_loss']:.4f} | {n['val_loss']} | |",
        f"| compile time (s) | {r['compile_s']:.1f} | n/a (eager) | |",
        f"| wall time (s) | {r['wall_s']:.1f} | ~132 | |",
        "",
        f"{r['steps_per_dispatch']} optimizer steps per jitted dispatch (lax.scan), batch split over "
        f"{r['data_parallel']} host devices; {r['params']:,} parameters; "
        f"jax {r['env']['jax']}, {r['env']['cpus']} CPUs. nanoGPT figures: {n['source']}. The machine is shared, "
        "so timings are noisy (up to ~1.8x run to run).",
        "",
    ])


if __name__ == "__main__":
    main()
