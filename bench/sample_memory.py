"""`python -m train.sample`'s memory estimate against the peak resident memory it really reaches.

    PYTHONPATH=$PWD python bench/sample_memory.py [--cases baby:100:20,baby:1000:20,...] [--out-dir DIR]

Each case (CONFIG:NUM_SAMPLES:MAX_NEW_TOKENS, a config of configs/ with fresh parameters) samples
in a fresh process, so that its peak resident memory (`os.wait4`, from the kernel) is its own.
The process runs `train.sample.main` with the stdout thrown away and records the `MemoryEstimate`
(`train.decode.memory`) it printed on its "memory:" line, with each part; the vocabulary is Tiny
Shakespeare's 65 characters (written to a temp file, nothing is downloaded). Writes
bench/results/sample_memory.{json,md}.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import fresh  # noqa: E402
from bench.machine import describe_machine, machine_line, write_results  # noqa: E402

CHARS = "\n !$&',-.3:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"  # Tiny Shakespeare's 65
# The default config at 100 to 100,000 samples (all of them were once one batch: 100,000 x 20 was killed at
# 14 GB), a long sample, 3,125 calls kept between two windows, and the long-context config, whose calls
# hold more than the process.
CASES = ("shakespeare_char_baby:100:20,shakespeare_char_baby:1000:20,shakespeare_char_baby:4000:20,"
         "shakespeare_char_baby:100000:20,shakespeare_char_baby:16:2000,shakespeare_char_baby:50000:64,"
         "shakespeare_char_long:64:1100")
PARTS = ("process", "cache", "logits", "activations", "compile", "ids", "streams")


def worker(spec: dict) -> dict:
    """In a fresh process: `python -m train.sample` on `spec["argv"]`; its estimate, exit code and peak RSS."""
    from train import sample
    plans, original = [], sample.plan_sampling

    def capture(*args, **kwargs):
        plans.append(original(*args, **kwargs))
        return plans[-1]

    sample.plan_sampling = capture
    err, start = io.StringIO(), time.perf_counter()
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null), contextlib.redirect_stderr(err):
        try:
            code = sample.main(spec["argv"])
        except SystemExit as stop:
            code = stop.code
    lines = err.getvalue().splitlines()
    if code != 0 or not plans:
        raise RuntimeError(f"train.sample exited {code}: {lines[-1] if lines else '(nothing on stderr)'}")
    plan = plans[0]
    return {"estimate": {**dataclasses.asdict(plan), "per_call": plan.per_call, "total": plan.total},
            "wall_s": time.perf_counter() - start, "peak_rss_bytes_self": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "stderr": [line for line in lines if line.startswith(("memory:", "compile:", "decode:", "warning:"))]}


def measure(case: str, corpus: Path) -> dict:
    config, samples, new = case.split(":")
    argv = ["--random-init", config, "--data", str(corpus), "--prompt", "ROMEO:", "--num-samples", samples,
            "--max-new-tokens", new]
    done = fresh.run(fresh.function_argv("bench.sample_memory:worker", {"argv": argv}), what=f"train.sample {case}",
                     timeout=3600)
    result = done.json()
    return {"case": case, "config": config, "num_samples": int(samples), "max_new_tokens": int(new),
            "peak_rss_bytes": done.peak_rss_bytes, "process_wall_s": done.wall_s,
            "ratio": result["estimate"]["total"] / done.peak_rss_bytes, **result}


def markdown(record: dict) -> str:
    gib = lambda size: f"{size / 2 ** 30:.3f}"  # noqa: E731
    rows = []
    for r in record["runs"]:
        e = r["estimate"]
        rows.append(f"| {r['config']} | {r['num_samples']:,} x {r['max_new_tokens']:,} | {e['rows']} x {e['calls']:,} | "
                    + " | ".join(gib(e[p]) for p in PARTS) + f" | **{gib(e['total'])}** | **{gib(r['peak_rss_bytes'])}** | "
                    f"{r['ratio']:.2f} | {r['process_wall_s']:.0f} |")
    return "\n".join([
        "# train.sample: estimated against measured peak memory", "",
        f"Machine: {machine_line(record['machine'])}. Command: `{record['command']}`", "",
        "Each case in a fresh process; the estimate is the one `python -m train.sample` prints on its `memory:` "
        "line before compiling (`train.decode.memory.MemoryEstimate`), the peak RSS the kernel's for the whole process "
        "(`os.wait4`). Sizes in GiB; rows x calls: samples per call, calls per window.", "",
        "| config | samples x new tokens | rows x calls | process | KV cache | logits | activations | compiling | "
        "token ids | between windows | estimate | peak RSS | estimate / peak | wall s |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |", *rows, ""])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=CASES, help="CONFIG:NUM_SAMPLES:MAX_NEW_TOKENS,... (default: %(default)s)")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args(argv)
    runs = []
    with tempfile.TemporaryDirectory(prefix="sample-memory-") as scratch:
        corpus = Path(scratch) / "chars.txt"
        corpus.write_text(CHARS * 3, encoding="utf-8")
        for case in args.cases.split(","):
            print(f"sampling {case}...", file=sys.stderr, flush=True)
            runs.append(measure(case, corpus))
            print(f"  estimate {runs[-1]['estimate']['total'] / 2**30:.3f} GiB, peak RSS "
                  f"{runs[-1]['peak_rss_bytes'] / 2**30:.3f} GiB", file=sys.stderr, flush=True)
    command = "PYTHONPATH=$PWD python bench/sample_memory.py" + ("" if args.cases == CASES else f" --cases {args.cases}")
    record = {"machine": describe_machine(), "command": command, "runs": runs}
    write_results(args.out_dir, "sample_memory", record, markdown(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
