"""Where an engine decode step's time goes: the head, the other products, attention, the rest, sampling, host.

    PYTHONPATH=$PWD .venv/bin/python bench/step_parts.py (--gguf SmolLM2-135M-Instruct.Q4_1.gguf | --hf DIR)
        [--rows 32] [--context 300] [--steps 20] [--out bench/results/step_parts]

The engine is built as `train.serve` builds it (`serving_kernels`, the weights laid out for them), with one
decode bucket of --rows rows. Two measures, one after the other:

* the engine: --rows requests of --context prompt tokens decode --steps steps; `Engine.clock` splits each
  step into the host's phases and the wait for the device (milliseconds a step, wall time);
* the step's programs under JAX's profiler (`jax.profiler.trace`, read back with `jax.profiler.ProfileData`):
  the decode step's forward, then its draw, each run --steps times alone with --rows rows at --context
  tokens. Every operation XLA ran is one event named by its HLO instruction; the forward's are put in a
  part by the program's HLO text: a custom call to a native matmul (quantized or float) is a product, the one whose
  output is as wide as the vocabulary the head; one to the native paged loop attention; an XLA dot a
  product; anything else (norms, RoPE, activations, the cache's writes, gathers) the rest. The draw's
  operations are sampling. Events on XLA's threads overlap, so a part is CPU time (milliseconds of all
  threads a step), reported with its share of the forward and draw's CPU time.

Writes PATH.json and PATH.md (--out), with the CPU, the native loops' instruction-set paths and the command,
led by the variables that limited the instruction set where some were set (`bench.machine.isa_limits`: an
AVX2 CPU emulated on a larger one, docs/performance.md §28).
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.machine import describe_machine, limits_prefix, machine_line, portable_command, write_results  # noqa: E402
from bench.step_buckets import step_inputs  # noqa: E402
from jaxattn.kernels import Kernels, float_matmul, native_paged, prepare_weights, quant_matmul  # noqa: E402
from jaxattn.serving import Engine, EngineConfig, SamplingParams  # noqa: E402
from jaxattn.serving.step import StepShape  # noqa: E402
from train.models.load import load_model  # noqa: E402
from train.models.source import ModelSource  # noqa: E402
from train.serve import serving_kernels  # noqa: E402

PAGE = 16
PARTS = ("head", "products", "attention", "rest", "sampling")
CUSTOM_CALL = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\S+) custom-call\(.*custom_call_target=\"([^\"]+)\"")
DOT = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = \S+ (?:dot|convolution)\(")


def forward_parts(hlo: str, vocab_size: int) -> dict[str, str]:
    """The forward's instruction names that are not "rest": name -> "head", "products" or "attention"."""
    parts = {}
    for line in hlo.splitlines():
        if match := CUSTOM_CALL.match(line):
            name, shape, target = match.groups()
            if "matmul" in target:
                parts[name] = "head" if re.search(rf"[\[,]{vocab_size}\]", shape) else "products"
            elif "paged" in target:
                parts[name] = "attention"
        elif match := DOT.match(line):
            parts[match.group(1)] = "products"
    return parts


def is_dot(name: str) -> bool:
    """An XLA fusion or op whose name says it holds a dot (XLA names dot fusions after their root)."""
    return name.startswith(("dot", "convolution")) or "_dot" in name or "dot_" in name


def operation_ms(run, steps: int) -> dict[str, float]:
    """`run()` called `steps` times under the profiler -> milliseconds a call per HLO instruction name."""
    with tempfile.TemporaryDirectory() as folder:
        jax.profiler.start_trace(folder)
        for _ in range(steps):
            run()
        jax.profiler.stop_trace()
        (path,) = Path(folder).rglob("*.xplane.pb")
        data = jax.profiler.ProfileData.from_file(str(path))
    totals = collections.Counter()
    for plane in data.planes:
        if plane.name != "/host:CPU":
            continue
        for line in plane.lines:
            if line.name == "python":
                continue
            for event in line.events:
                if not event.name.startswith(("ThunkExecutor", "$")):
                    totals[event.name] += event.duration_ns / 1e6 / steps
    return dict(totals)


def native_paths(kernels: Kernels) -> dict[str, str]:
    """The instruction-set path each native loop the kernels run was compiled with (e.g. "avx2")."""
    paths = {"quantized": quant_matmul.native_path} if kernels.quantized.startswith("native") else {}
    paths |= {"matmul": float_matmul.native_path} if kernels.matmul == "native_cpu" else {}
    paths |= {"paged": native_paged.native_path} if kernels.paged == "ragged_cpu" else {}
    return {field: path() for field, path in paths.items()}


def engine_clock(engine: Engine, rows: int, context: int, steps: int, vocab_size: int) -> dict:
    """Host and device milliseconds a decode step of `rows` requests at about `context` tokens."""
    rng = np.random.default_rng(0)
    requests = [engine.add_request(rng.integers(1, vocab_size, context).tolist(),
                                   SamplingParams(temperature=0.0, max_tokens=steps + 4)) for _ in range(rows)]
    while not all(r.output_ids for r in requests):
        engine.step()
    engine.step()
    engine.clock.reset()
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = (time.perf_counter() - started) / steps * 1e3
    per_step = engine.clock.per_step_ms()
    engine.run()
    return {"step_ms": wall, "host_ms": per_step["host"], "device_ms": per_step["device"],
            "phases_ms": {k: v for k, v in per_step.items() if k not in ("host", "total", "device")}}


def program_parts(engine: Engine, rows: int, context: int, steps: int) -> dict:
    """The decode step's forward and draw profiled alone -> CPU milliseconds a step per part."""
    runner, config = engine.model_runner, engine.config
    shape = StepShape(rows, 0, engine.engine_config.chunk)
    programs = runner.programs
    inputs = programs.place(step_inputs(shape, rows, context, runner.pages_per_seq, runner.num_slots,
                                         config.vocab_size))
    state = {"pools": runner.pools, "history": runner.history}

    def forward():
        state["pools"], state["history"], state["pending"] = programs.forward(
            shape, runner.params, state["pools"], state["history"], inputs)
        jax.block_until_ready(state["pending"])

    def sample():
        jax.block_until_ready(programs.sample(shape, state["pending"], state["history"], inputs))

    for _ in range(3):  # warm
        forward()
        sample()
    named = forward_parts(programs.programs[shape].as_text(), config.vocab_size)
    parts = dict.fromkeys(PARTS, 0.0)
    for name, ms in operation_ms(forward, steps).items():
        parts[named.get(name, "products" if is_dot(name) else "rest")] += ms
    parts["sampling"] = sum(operation_ms(sample, steps).values())
    runner.pools, runner.history = state["pools"], state["history"]
    return parts


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--gguf", type=Path, help="a GGUF file (its quantized weights kept)")
    source.add_argument("--hf", type=Path, help="a transformers directory (float32, as train.serve --hf serves it)")
    parser.add_argument("--matmul", help="the float matmul kernel (default: what train.serve picks here)")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "step_parts")
    args = parser.parse_args(argv)

    path = args.gguf or args.hf
    loaded = load_model(ModelSource(gguf=str(args.gguf)) if args.gguf else ModelSource(hf=str(args.hf)))
    kernels, _ = serving_kernels(loaded.config.dtype)  # as train.serve runs the model
    kernels = kernels.replace(matmul=args.matmul) if args.matmul else kernels
    length = args.context + args.steps + 8
    ec = EngineConfig(max_seqs=args.rows, page_size=PAGE, decode_buckets=(args.rows,), max_model_len=length,
                      num_pages=args.rows * -(-length // PAGE), chunk=min(128, args.context), decode_steps=1)
    engine = Engine(prepare_weights(loaded.params, kernels), loaded.config, ec, kernels=kernels)
    clock = engine_clock(engine, args.rows, args.context, args.steps, loaded.config.vocab_size)
    parts = program_parts(engine, args.rows, args.context, args.steps)
    cpu = sum(parts.values())

    machine = describe_machine()
    words = list(argv if argv is not None else sys.argv[1:])
    command = (limits_prefix(machine["isa_limits"]) + "PYTHONPATH=$PWD python bench/step_parts.py "
               + portable_command(words, ("--gguf", "--hf")))
    paths = native_paths(kernels)
    lines = ["# Where an engine decode step's time goes", "",
             f"{machine_line(machine)}; the model of `{path.name}`, kernels matmul {kernels.matmul!r} / quantized "
             f"{kernels.quantized!r} / paged "
             f"{kernels.paged!r} (native paths: {', '.join(f'{k} {v}' for k, v in paths.items()) or 'none'}); "
             f"{args.rows} rows at about {args.context} tokens of context, {args.steps} steps.", "",
             "The engine, wall time a step:", "",
             "| step ms | device ms | host ms | " + " | ".join(f"host: {name}" for name in clock["phases_ms"]) + " |",
             "| ---: | ---: | ---: | " + " | ".join("---:" for _ in clock["phases_ms"]) + " |",
             f"| {clock['step_ms']:.2f} | {clock['device_ms']:.2f} | {clock['host_ms']:.2f} | "
             + " | ".join(f"{v:.2f}" for v in clock["phases_ms"].values()) + " |", "",
             "The step's programs alone, CPU time of all threads a step (the profiler's events):", "",
             "| part | CPU ms a step | share |", "| --- | ---: | ---: |"]
    lines += [f"| {part} | {ms:.2f} | {ms / cpu:.0%} |" for part, ms in parts.items()]
    lines += ["", f"Command: `{command}`", ""]
    record = {"machine": machine, "command": command, "model": path.name, "native_paths": paths, "engine": clock,
              "cpu_ms": parts}
    write_results(args.out.parent, args.out.name, record, "\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
