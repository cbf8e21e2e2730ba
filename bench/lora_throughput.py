"""The engine's output tokens/s with LoRA adapters in slots against the same requests with none.

    PYTHONPATH=$PWD .venv/bin/python bench/lora_throughput.py [--adapters 0 1 2 8 32] [--rounds 2]
        [--requests 32] [--prompt 64] [--output 64] [--out bench/results/lora_throughput_amx]
    PYTHONPATH=$PWD .venv/bin/python bench/lora_throughput.py --quick --out DIR     # a smoke run

SmolLM2-135M's shape in float32 (bench/serve.py's `--model smollm2` checkpoint, random init), q, k and v
fused and the kernels as `train.serve` serves it (`serving_kernels`). One engine per adapter count N, all
built first (each compiles its programs once): N = 0 is the plain engine (`max_loras` 0, no slot input at
all); otherwise `max_loras` = N slots of rank 16 on every projection, N distinct rank-16 adapters
(`add_lora`, a and b drawn N(0, 0.02)) added, and the requests' `lora` names them in turn (evenly mixed).
The engines run one after another (all at once exhaust a 24 GiB machine), `--rounds` runs each: `--requests` requests
of `--prompt` random tokens, all added at once, each decoding exactly `--output` tokens greedily; output
tokens/s = their tokens over the wall time from the first add to the last token. Warm-ups before (two
tokens of every adapter, then the load's prompts for two tokens) put each adapter in its slot.
Medians of the rounds, and each count's ratio to N = 0; not in turns, so the load average before and after
is recorded.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.machine import describe_machine, load_average, machine_line, portable_command, write_results  # noqa: E402

RANK = 16


def targets(config) -> tuple[str, ...]:
    """Every projection: q, k, v, o, the MLP's up and down, and its gate where it has one."""
    return ("q", "k", "v", "o", "up", "down") + (("gate",) if config.mlp in ("swiglu", "geglu") else ())


def adapters(config, params, count: int) -> list:
    """`count` distinct rank-16 adapters on every projection (params trees with `LoraWeight`s)."""
    import jax

    from jaxattn.lora import LoraConfig, add_lora, combine_lora, split_lora
    lora = LoraConfig(rank=RANK, alpha=32.0, targets=targets(config))
    made = []
    for i in range(count):
        ab, frozen = split_lora(add_lora(params, config, lora, jax.random.PRNGKey(i)))
        leaves, tree = jax.tree.flatten(ab)
        keys = jax.random.split(jax.random.PRNGKey(1000 + i), len(leaves))
        made.append(combine_lora(frozen, jax.tree.unflatten(
            tree, [0.02 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)])))
    return made


def build(config, params, kernels, count: int, args):
    from jaxattn.serving import Engine, EngineConfig
    pages = args.requests * -(-(args.prompt + args.output + 8) // 16)
    ec = EngineConfig(max_seqs=args.requests, page_size=16, num_pages=pages, token_budget=256, max_loras=count,
                      max_lora_rank=RANK, lora_targets=targets(config))
    engine = Engine(params, config, ec, kernels=kernels)
    for i, adapter in enumerate(adapters(config, params, count)):
        engine.add_lora(f"a{i}", adapter)
    run(engine, count, [[1, 2, 3]] * max(count, 1), 2)  # warm-up: every adapter into its slot
    return engine


def run(engine, count: int, prompts: list[list[int]], output: int) -> float:
    """Output tokens/s of `prompts`, request i under adapter i mod `count` (none for 0)."""
    from jaxattn.serving import SamplingParams
    start = time.perf_counter()
    requests = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=output,
                                                     lora=f"a{i % count}" if count else None))
                for i, p in enumerate(prompts)]
    while engine.has_unfinished():
        engine.step()
    tokens = sum(len(r.output_ids) for r in requests)
    assert tokens == output * len(prompts), "every request decodes exactly --output tokens"
    return tokens / (time.perf_counter() - start)


def measure(args) -> dict:
    import jax
    import numpy as np

    from bench.serve import default_cache_dir, ensure_checkpoint, load_model, model_config
    from train.serve import serving_kernels
    name = "tiny" if args.quick else "smollm2"
    config, params = load_model(str(ensure_checkpoint(name, default_cache_dir(), model_config(name))[0]))
    kernels, _ = serving_kernels(config.dtype)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, config.vocab_size, args.prompt).tolist() for _ in range(args.requests)]
    rounds = {}
    for n in args.adapters:  # one engine at a time: five engines' programs at once exhaust a 24 GiB machine
        engine = build(config, params, kernels, n, args)
        run(engine, n, prompts, 2)  # untimed: whatever the first real load still compiles or places
        rounds[n] = [run(engine, n, prompts, args.output) for _ in range(args.rounds)]
        del engine
        gc.collect()
        jax.clear_caches()
    medians = {n: statistics.median(v) for n, v in rounds.items()}
    base = medians.get(0)
    return {"kernels": kernels.to_dict(), "model": name, "tokens_per_s": {str(n): v for n, v in rounds.items()},
            "median_tokens_per_s": {str(n): v for n, v in medians.items()},
            "ratio_to_none": {str(n): v / base for n, v in medians.items()} if base else {}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--adapters", type=int, nargs="+", default=[0, 1, 2, 8, 32])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--output", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="a tiny model, for the smoke test")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "lora_throughput")
    args = parser.parse_args(argv)
    before = load_average()
    record = {"machine": describe_machine(), **measure(args), "load_average": [before, load_average()]}
    words = list(argv if argv is not None else sys.argv[1:])
    record["command"] = "PYTHONPATH=$PWD python bench/lora_throughput.py " + portable_command(words, ())
    lines = [f"# Output tokens/s with LoRA adapters in slots ({record['model']}, float32)", "",
             f"{machine_line(record['machine'])}; kernels matmul {record['kernels']['matmul']!r}; "
             f"{args.requests} requests at once, {args.prompt} prompt tokens and {args.output} output tokens each, "
             f"rank-{RANK} adapters on every projection mixed evenly; medians of {args.rounds} runs, engine after engine; "
             f"1-minute load average {before} before, {record['load_average'][1]} after (2 cores).", "",
             "| adapters | output tok/s (median) | rounds | / no adapter |", "| ---: | ---: | --- | ---: |"]
    for n in args.adapters:
        ratio = record["ratio_to_none"].get(str(n))
        lines.append(f"| {n} | {record['median_tokens_per_s'][str(n)]:.1f} | "
                     f"{', '.join(f'{v:.1f}' for v in record['tokens_per_s'][str(n)])} | "
                     f"{'' if ratio is None else f'{ratio:.2f}x'} |")
    lines += ["", f"Command: `{record['command']}`", ""]
    write_results(args.out.parent, args.out.name, record, "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
