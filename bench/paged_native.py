"""The native paged attention loop ("ragged_cpu") of this tree beside an earlier revision's, in turns.

    PYTHONPATH=$PWD python bench/paged_native.py [--baseline REV] [--rounds 5] [--context 600] [--threads 2]

One call of `native_paged_attention` at the serving engine's decode shape of SmolLM2-135M (32 rows, one
query each, 9 query heads and 3 kv heads of 64, pages of 16 slots, every row at --context tokens), each
build in a fresh process (`bench.fresh`) per round, in turns: this tree's
`jaxattn/kernels/native/paged_attention.cc` (with `float_vec.h`'s path for this CPU) and --baseline's
(`git show REV:...`, built the same way into its own cache). Per process: the median of 30 calls after a
warm-up; reported: each build's median over rounds, the keys and values one call reads, and the GB/s
that makes. Writes bench/results/paged_native.json and .md with the CPU named.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import fresh  # noqa: E402
from bench.machine import cpu_cores, describe_machine, machine_line, pin_to_cores, write_results  # noqa: E402

SOURCE = "jaxattn/kernels/native/paged_attention.cc"
ROWS, HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 9, 3, 64, 16


def run_cell(spec: dict) -> dict:
    """One build's call timed (what each fresh process runs): {"median_s", "bytes"}."""
    pin_to_cores(spec["threads"])
    import jax
    import jax.numpy as jnp
    import numpy as np

    from bench.timing import time_call
    from jaxattn.kernels import native_paged
    if spec.get("source"):
        native_paged.SOURCE = Path(spec["source"])
    context = spec["context"]
    per_row = -(-context // PAGE)
    rng = np.random.default_rng(0)
    pages = 1 + ROWS * per_row  # page 0 unused, as the engine's pool keeps it
    keys, values = (jnp.asarray(rng.standard_normal((pages, PAGE, KV_HEADS, HEAD_DIM), np.float32)) for _ in range(2))
    queries = jnp.asarray(rng.standard_normal((ROWS, 1, HEADS, HEAD_DIM), np.float32))
    table = jnp.asarray(1 + np.arange(ROWS * per_row, dtype=np.int32).reshape(ROWS, per_row))
    positions = jnp.full((ROWS, 1), context - 1, jnp.int32)
    call = jax.jit(lambda q, k, v: native_paged.native_paged_attention((q,), (k,), v, table, positions, scale=0.125))
    timing = time_call(lambda: call(queries, keys, values), spec["calls"])
    return {"median_s": timing.median_s, "bytes": 2 * ROWS * context * KV_HEADS * HEAD_DIM * 4}


def baseline_source(revision: str, directory: Path) -> Path:
    """The baseline revision's loop (and the headers it includes) written into `directory`."""
    native = Path(SOURCE).parent
    listed = subprocess.run(["git", "ls-tree", "--name-only", f"{revision}:{native}"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout.split()
    for name in listed:
        if name.endswith((".cc", ".h")):
            text = subprocess.run(["git", "show", f"{revision}:{native}/{name}"], cwd=ROOT, check=True,
                                  capture_output=True, text=True).stdout
            (directory / name).write_text(text)
    return directory / Path(SOURCE).name


def markdown(record: dict) -> str:
    lines = [f"# The native paged attention loop, this tree beside {record['baseline']}", "",
             f"{machine_line(record['machine'])}; {record['threads']} threads", "",
             f"One call: {ROWS} rows of one query, {HEADS} query heads and {KV_HEADS} kv heads of {HEAD_DIM}, pages "
             f"of {PAGE}, {record['context']} tokens of context a row ({record['bytes'] / 1e6:.1f} MB of keys and "
             f"values). Medians of 30 calls a process, then over {record['rounds']} rounds of fresh processes in "
             "turns.", "", "| build | ms a call | GB/s | rounds (ms) |", "| --- | ---: | ---: | --- |"]
    for name, times in record["times"].items():
        median = statistics.median(times)
        lines.append(f"| {name} | {1e3 * median:.2f} | {record['bytes'] / median / 1e9:.1f} | "
                     f"{', '.join(f'{1e3 * t:.2f}' for t in times)} |")
    this, base = (statistics.median(t) for t in record["times"].values())
    lines += ["", f"This tree over the baseline: {base / this:.2f}x.", "", f"Command: `{record['command']}`", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", default="HEAD", help="a git revision whose loop to compare (default HEAD)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--context", type=int, default=600)
    parser.add_argument("--threads", type=int, default=min(2, cpu_cores()))
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "paged_native")
    args = parser.parse_args(argv)
    base = {"context": args.context, "threads": args.threads, "calls": args.calls}
    times: dict[str, list[float]] = {"this tree": [], f"baseline ({args.baseline})": []}
    facts = {}
    with tempfile.TemporaryDirectory() as scratch:
        specs = {"this tree": base, f"baseline ({args.baseline})": {
            **base, "source": str(baseline_source(args.baseline, Path(scratch)))}}
        for round_ in range(args.rounds):
            for name in (list(specs) if round_ % 2 == 0 else list(specs)[::-1]):
                facts = fresh.call("bench.paged_native:run_cell", specs[name], threads=args.threads, timeout=600)
                times[name].append(facts["median_s"])
                print(f"round {round_ + 1} {name}: {1e3 * facts['median_s']:.2f} ms", file=sys.stderr)
    record = {"baseline": args.baseline, "context": args.context, "threads": args.threads, "rounds": args.rounds,
              "bytes": facts["bytes"], "times": times, "machine": describe_machine(),
              "command": "PYTHONPATH=$PWD python bench/paged_native.py " + " ".join(argv or sys.argv[1:])}
    write_results(args.out.parent, args.out.name, record, markdown(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
