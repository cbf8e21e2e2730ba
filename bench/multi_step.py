"""Several decode steps per program call: the engine's decode tokens/s and host time with k steps a call.

    PYTHONPATH=$PWD .venv/bin/python bench/multi_step.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf
        [--steps 1,4,8] [--rows 32] [--prompt 64] [--new 64] [--rounds 3] [--out bench/results/multi_step]
    PYTHONPATH=$PWD .venv/bin/python bench/multi_step.py --random-init shakespeare_char_baby ...

One engine per k (`EngineConfig(decode_steps=k)`, every other setting equal, the kernels `Kernels.auto()`
picks, as `train.serve` runs them), compiled once. A round adds --rows requests at once (prompts of
--prompt tokens, --new greedy tokens each, every row of one decode bucket), runs them to the end and
times the decoding: from the step after which every request has its first token to the last token.
Rounds go in turns over the engines. Reported per k: decode tokens/s (the median round), the host's
milliseconds per decode token (`Engine.clock`: every phase but the device's wait), the calls per token,
and whether the tokens equal k = 1's (they must: greedy).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.machine import describe_machine, machine_line, portable_command, write_results  # noqa: E402
from jaxattn.kernels import Kernels, resolve_kernels  # noqa: E402
from jaxattn.serving import Engine, EngineConfig, SamplingParams  # noqa: E402
from train.models.load import load_model  # noqa: E402
from train.models.source import ModelSource  # noqa: E402

PAGE = 16


def one_round(engine: Engine, prompts: list[list[int]], new: int) -> dict:
    """Runs the prompts at once -> decode seconds, decode tokens, host seconds and calls while decoding, tokens."""
    sampling = SamplingParams(temperature=0.0, max_tokens=new)
    requests = [engine.add_request(prompt, sampling) for prompt in prompts]
    while not all(r.output_ids for r in requests):
        engine.step()
    engine.clock.reset()
    first = sum(len(r.output_ids) for r in requests)
    calls, started = 0, time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        calls += 1
    seconds = time.perf_counter() - started
    tokens = sum(len(r.output_ids) for r in requests) - first
    return {"seconds": seconds, "tokens": tokens, "host_s": engine.clock.host_seconds(), "calls": calls,
            "outputs": [r.output_ids for r in requests]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--gguf", type=Path)
    source.add_argument("--random-init", help="a config name in configs/ (random weights, seed 0)")
    parser.add_argument("--steps", default="1,4,8", help="decode steps per call to compare (default %(default)s)")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "multi_step")
    args = parser.parse_args(argv)
    steps = [int(k) for k in args.steps.split(",")]

    loaded = load_model(ModelSource(gguf=str(args.gguf)) if args.gguf else ModelSource(random_init=args.random_init))
    config, name = loaded.config, args.gguf.name if args.gguf else args.random_init
    context, (kernels, _) = args.prompt + args.new, resolve_kernels(Kernels.auto())
    engines, compile_s = {}, {}
    for k in steps:
        ec = EngineConfig(max_seqs=args.rows, page_size=PAGE, decode_steps=k, decode_buckets=(args.rows,),
                          num_pages=args.rows * -(-context // PAGE) + 1,
                          chunk=min(128, args.prompt), prefill_rows=2)
        started = time.perf_counter()
        engines[k] = Engine(loaded.params, config, ec, kernels=kernels)
        compile_s[k] = time.perf_counter() - started
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, config.vocab_size, args.prompt).tolist() for _ in range(args.rows)]

    results = {k: [] for k in steps}
    for turn in range(args.rounds):
        for k in (steps if turn % 2 == 0 else steps[::-1]):
            results[k].append(one_round(engines[k], prompts, args.new))
    rows = []
    for k in steps:
        rounds = results[k]
        rates = [r["tokens"] / r["seconds"] for r in rounds]
        tokens = sum(r["tokens"] for r in rounds)
        rows.append({"decode_steps": k, "tokens_per_s": statistics.median(rates), "rounds_tokens_per_s": rates,
                     "host_ms_per_token": 1e3 * sum(r["host_s"] for r in rounds) / tokens,
                     "calls_per_token": sum(r["calls"] for r in rounds) / tokens, "compile_s": compile_s[k],
                     "tokens_equal_k1": all(r["outputs"] == results[steps[0]][0]["outputs"] for r in rounds)})
    base = rows[0]["tokens_per_s"]

    machine = describe_machine()
    words = list(argv if argv is not None else sys.argv[1:])
    command = "PYTHONPATH=$PWD python bench/multi_step.py " + portable_command(words, ("--gguf",))
    lines = ["# Several decode steps per program call", "",
             f"{machine_line(machine)}; the model of `{name}`, kernels `Kernels.auto()`; {args.rows} requests at "
             f"once, prompts of {args.prompt} tokens, {args.new} greedy tokens each; decode tokens/s from the step "
             f"after which every request has its first token, the median of {args.rounds} rounds in turns.", "",
             "| decode steps per call | decode tok/s | over 1 step a call | host ms per token | calls per token "
             "| tokens equal 1 step's | compile s | rounds (tok/s) |",
             "| ---: | ---: | ---: | ---: | ---: | --- | ---: | --- |"]
    for row in rows:
        lines.append(f"| {row['decode_steps']} | {row['tokens_per_s']:.0f} | {row['tokens_per_s'] / base:.2f}x | "
                     f"{row['host_ms_per_token']:.3f} | {row['calls_per_token']:.3f} | "
                     f"{'yes' if row['tokens_equal_k1'] else 'NO'} | {row['compile_s']:.1f} | "
                     f"{', '.join(f'{r:.0f}' for r in row['rounds_tokens_per_s'])} |")
    lines += ["", f"Command: `{command}`", ""]
    write_results(args.out.parent, args.out.name, {"machine": machine, "command": command, "model": name,
                                                   "rows": rows}, "\n".join(lines))
    print("\n".join(lines))
    return 0 if all(row["tokens_equal_k1"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
