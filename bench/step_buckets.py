"""What a decode bucket's padding costs: one engine step of r live rows run in a bucket of b rows.

    PYTHONPATH=$PWD .venv/bin/python bench/step_buckets.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf
        [--pairs 1:1,2:4,4:4,4:8,8:8,8:16,16:16,16:32,32:32] [--context 300] [--calls 30] [--rounds 3]
        [--out bench/results/step_buckets]

The engine compiles one step program per decode bucket (`EngineConfig.buckets()`: 1, 4, 16, 32 for 32
rows) and runs a step in the smallest bucket that holds its rows; fewer buckets compile sooner (each is
one program per prefill shape too) but pad more rows. Here each bucket's decode step is compiled alone
(`StepPrograms`, the kernels `Kernels.auto()` picks, as `train.serve` runs them) and called with r rows
each holding `--context` tokens of context (padding rows hold none), forward and draw, waiting for the
tokens: milliseconds a step, the median of --calls calls, then the median over --rounds rounds taken in
turns.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import flax.linen as nn
import jax
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.machine import describe_machine, machine_line, write_results  # noqa: E402
from jaxattn.cache.build import init_pools  # noqa: E402
from jaxattn.kernels import Kernels, prepare_weights, resolve_kernels  # noqa: E402
from jaxattn.scan_plan import relayout  # noqa: E402
from jaxattn.serving.step import StepInputs, StepPrograms, StepShape  # noqa: E402
from train.models.load import load_model  # noqa: E402
from train.models.source import ModelSource  # noqa: E402

PAGE = 16


def step_inputs(shape: StepShape, live: int, context: int, pages_per_seq: int, num_slots: int, vocab: int):
    """A decode step of `live` rows (row i on pages i * pages_per_seq ...), each at position `context`."""
    inputs = StepInputs.empty(shape, pages_per_seq, num_slots, vocab)
    (group,) = inputs.batch.groups
    for row in range(live):
        pages = row * pages_per_seq + np.arange(pages_per_seq)
        group.positions[row, 0] = context
        group.block_table[row] = pages
        inputs.batch.positions[row] = context
        inputs.batch.slots[row] = pages[context // PAGE] * PAGE + context % PAGE
        inputs.batch.logit_tokens[row] = row
        inputs.tokens[row] = 1 + row
    return inputs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, required=True)
    parser.add_argument("--pairs", default="1:1,2:4,4:4,4:8,8:8,8:16,16:16,16:32,32:32",
                        help="LIVE:BUCKET pairs (default %(default)s)")
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "step_buckets")
    args = parser.parse_args(argv)
    pairs = [tuple(map(int, pair.split(":"))) for pair in args.pairs.split(",")]
    buckets = sorted({bucket for _, bucket in pairs})

    loaded = load_model(ModelSource(gguf=str(args.gguf)))
    config = loaded.config
    kernels, _ = resolve_kernels(Kernels.auto())
    params, config = relayout(nn.unbox(loaded.params), config, scan_layers=False)  # as the engine runs them
    params = prepare_weights(params, kernels)
    pages_per_seq = -(-(args.context + 1) // PAGE)
    num_pages = max(buckets) * pages_per_seq
    pools = init_pools(config, num_pages, PAGE)
    history = jax.numpy.zeros((num_pages, PAGE), jax.numpy.int32)
    shapes = [StepShape(bucket, 0, 16) for bucket in buckets]
    started = time.perf_counter()
    programs = StepPrograms(config, kernels, params, pools, history, shapes, pages_per_seq=pages_per_seq,
                            num_slots=num_pages * PAGE)
    compile_s = time.perf_counter() - started

    def timed(live: int, bucket: int) -> float:
        nonlocal pools, history
        shape = StepShape(bucket, 0, 16)
        inputs = step_inputs(shape, live, args.context, pages_per_seq, num_pages * PAGE, config.vocab_size)
        times = []
        for _ in range(args.calls + 2):  # two warm-up calls
            start = time.perf_counter()
            pools, history, pending = programs.forward(shape, params, pools, history, inputs)
            jax.block_until_ready(programs.sample(shape, pending, history, inputs))
            times.append(time.perf_counter() - start)
        return statistics.median(times[2:]) * 1e3

    rounds = {pair: [] for pair in pairs}
    for _ in range(args.rounds):
        for pair in pairs:
            rounds[pair].append(timed(*pair))
    rows = [{"live": live, "bucket": bucket, "ms": statistics.median(rounds[(live, bucket)]),
             "rounds_ms": rounds[(live, bucket)]} for live, bucket in pairs]
    full = {row["bucket"]: row["ms"] for row in rows if row["live"] == row["bucket"]}

    machine = describe_machine()
    command = "PYTHONPATH=$PWD python bench/step_buckets.py " + " ".join(
        a if not a.startswith("/") else "/path/to/" + Path(a).name for a in (argv or sys.argv[1:]))
    lines = ["# A decode bucket's padding: r live rows in a step of b rows", "",
             f"{machine_line(machine)}; the model of `{args.gguf.name}` (kept as loaded), kernels "
             f"{kernels.quantized!r} / paged {kernels.paged!r}; each live row at {args.context} tokens of "
             f"context; a decode step (forward and draw) compiled per bucket ({compile_s:.1f} s for "
             f"{len(shapes)}), ms a step: medians of {args.calls} calls, then of {args.rounds} rounds in turns.", "",
             "| live rows | bucket | ms a step | over the bucket full | ms per live row | rounds |",
             "| ---: | ---: | ---: | ---: | ---: | --- |"]
    for row in rows:
        of_full = f"{row['ms'] / full[row['bucket']]:.2f}x" if row["bucket"] in full else "–"
        lines.append(f"| {row['live']} | {row['bucket']} | {row['ms']:.2f} | {of_full} | "
                     f"{row['ms'] / row['live']:.2f} | {', '.join(f'{t:.2f}' for t in row['rounds_ms'])} |")
    lines += ["", f"Command: `{command.strip()}`", ""]
    write_results(args.out.parent, args.out.name, {"machine": machine, "command": command, "compile_s": compile_s,
                                                   "rows": rows}, "\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
