"""Layers compiled once: `generate`'s compile time and decode speed, unrolled against scanned.

    PYTHONPATH=$PWD .venv/bin/python bench/scan_layers.py [--layers 30,4] [--repeats 3]

Each cell runs in a fresh process (`bench.fresh`), so nothing is cached between them, on the
SmolLM2-135M-shaped model (bench/serve.py's `smollm2`, random init) cut to each depth: one greedy
`generate` of 64 tokens after a 32-token prompt at batch 1, compiled on the first call and timed on
the next `--repeats`. Compile seconds are what JAX reports to `jax.monitoring` for the generate
program (tracing, lowering, XLA's compile); the first call's wall time is also kept. Cells run in
turns (unrolled and scanned alternate per round); the medians go to bench/results/scan_layers.{json,md}.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import fresh  # noqa: E402
from bench.machine import describe_machine, machine_line, portable_command, write_results  # noqa: E402
from bench.timing import median  # noqa: E402

PROMPT, NEW = 32, 64
# What jax.monitoring reports for one program's compile: tracing to a jaxpr, lowering, XLA's compile.
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")


def worker(spec: dict) -> dict:
    """One cell in this (fresh) process: `{"compile_s", "first_call_s", "decode_s", "tokens"}`."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    from bench.serve import model_config
    from jaxattn.decoding import generate
    from jaxattn.scan_plan import relayout
    from jaxattn.model import DecoderLM

    config = model_config("smollm2").replace(num_layers=spec["layers"])
    params = nn.unbox(jax.jit(DecoderLM(config).init)(jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32))["params"])
    params, config = relayout(params, config, spec["scan"])
    params = jax.block_until_ready(jax.device_put(params))
    prompt = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (1, PROMPT)), jnp.int32)
    compile_s = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, seconds, **_: compile_s.append(seconds) if event in COMPILE_EVENTS else None)

    def call():
        out = generate(params, config, prompt, jnp.array([PROMPT]), max_new_tokens=NEW, rng=jax.random.PRNGKey(0),
                       temperature=0.0)
        return np.asarray(out.tokens)

    start = time.perf_counter()
    tokens = call()
    first = time.perf_counter() - start
    compiled = sum(compile_s)
    times = []
    for _ in range(spec["repeats"]):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return {"compile_s": compiled, "first_call_s": first, "decode_s": float(np.median(times)),
            "tokens": tokens[0].tolist()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="30,4", help="depths to measure, comma-separated")
    parser.add_argument("--repeats", type=int, default=3, help="timed generate calls per cell")
    parser.add_argument("--rounds", type=int, default=2, help="fresh processes per cell, in turns")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = parser.parse_args(argv)
    depths = [int(x) for x in args.layers.split(",")]
    runs: dict[tuple[int, bool], list[dict]] = {}
    for _ in range(args.rounds):
        for layers in depths:
            for scan in (False, True):
                record = fresh.call("bench.scan_layers:worker", {"layers": layers, "scan": scan,
                                                                 "repeats": args.repeats}, threads=args.threads)
                runs.setdefault((layers, scan), []).append(record)
    rows = []
    for (layers, scan), records in runs.items():
        rows.append({"layers": layers, "scan": scan,
                     "compile_s": median(r["compile_s"] for r in records),
                     "first_call_s": median(r["first_call_s"] for r in records),
                     "decode_tok_s": NEW / median(r["decode_s"] for r in records),
                     "tokens": records[0]["tokens"]})
    for layers in depths:
        same = [row["tokens"] for row in rows if row["layers"] == layers]
        if same[0] != same[1]:
            raise SystemExit(f"error: {layers} layers: the scanned model's tokens differ from the unrolled one's")
    machine = describe_machine()
    command = portable_command(["python", "bench/scan_layers.py", *(argv or sys.argv[1:])], ("--out",))
    lines = [f"# Layers compiled once: `generate` on {machine_line(machine)}", "",
             f"SmolLM2-135M's shape cut to each depth, float32, batch 1, {PROMPT}-token prompt, {NEW} new tokens "
             f"(greedy; the same tokens scanned and unrolled); fresh processes in turns, medians of {args.rounds}. "
             f"Command: `{command}`.", "",
             "| layers | layers run as | compile s | first call s | decode tok/s |", "| --- | --- | ---: | ---: | ---: |"]
    for row in sorted(rows, key=lambda r: (-r["layers"], r["scan"])):
        lines.append(f"| {row['layers']} | {'one scan' if row['scan'] else 'unrolled'} | {row['compile_s']:.1f} | "
                     f"{row['first_call_s']:.1f} | {row['decode_tok_s']:.1f} |")
    write_results(args.out, "scan_layers", {"machine": machine, "command": command, "rows": rows},
                  "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
