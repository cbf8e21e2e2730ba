"""Prefix caching: how much sooner a request reaches its first token when an earlier request
already computed its prefix.

    PYTHONPATH=$PWD python bench/prefix_cache.py [--model smollm2] [--prefix 512] [--suffix 16]
        [--trials 5] [--out bench/results/prefix_cache]

The model is bench/serve.py's (the same checkpoint, saved once). One engine with prefix caching
on and one with it off (`EngineConfig.prefix_caching`), each in this process, in turns: first a
request of the prefix and a suffix, run to its end (its full pages are now keyed in the cache);
then, for each trial, a request of the same prefix and another suffix, alone in the engine, timed
from `add_request` to its first token (TTFT). Medians of --trials; the ratio is off / on. The
engine's step programs are compiled before anything is timed. Greedy; every trial's tokens equal
between the two engines (checked). Writes bench/results/prefix_cache.{json,md}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.machine import describe_machine, machine_line, write_results  # noqa: E402
from bench.serve import corpus_path, default_cache_dir, ensure_checkpoint, text_ids  # noqa: E402


def first_token_seconds(engine, prompt: list[int], sampling) -> tuple[float, list[int]]:
    request = engine.add_request(prompt, sampling)
    while not request.finished:
        engine.step()
    return request.first_token_time - request.arrival_time, request.output_ids


def measure(args) -> dict:
    from jaxattn import hf
    from jaxattn.kernels import resolve_kernels
    from jaxattn.serving import Engine, EngineConfig, SamplingParams

    checkpoint, facts = ensure_checkpoint(args.model, args.cache_dir or default_cache_dir())
    config, params = hf.load_pretrained(checkpoint, dtype="float32")
    kernels, _ = resolve_kernels()
    ids = text_ids(corpus_path(args.data).read_text(encoding="utf-8"))
    prefix = ids[:args.prefix]
    suffixes = [ids[args.prefix + 100 * (i + 1):args.prefix + 100 * (i + 1) + args.suffix]
                for i in range(args.trials + 1)]
    sampling = SamplingParams(temperature=0.0, max_tokens=2)
    engines, compile_s = {}, {}
    for caching in (True, False):
        start = time.perf_counter()
        engines[caching] = Engine(params, config, EngineConfig(max_seqs=8, page_size=16, chunk=256, prefill_rows=2,
                                                               prefix_caching=caching), kernels=kernels)
        compile_s[caching] = time.perf_counter() - start
        first_token_seconds(engines[caching], prefix + suffixes[0], sampling)  # computes (and keys) the prefix
    times = {True: [], False: []}
    for suffix in suffixes[1:]:
        outputs = {}
        for caching in (True, False):  # in turns
            seconds, outputs[caching] = first_token_seconds(engines[caching], prefix + suffix, sampling)
            times[caching].append(seconds)
        if outputs[True] != outputs[False]:
            raise SystemExit(f"error: the cached and uncached engines drew different tokens: {outputs}")
    hits = engines[True].stats["prefix_hit_tokens"]
    on, off = statistics.median(times[True]), statistics.median(times[False])
    return {"model": args.model, "checkpoint": facts, "prefix_tokens": args.prefix, "suffix_tokens": args.suffix,
            "trials": args.trials, "kernels": kernels.to_dict(), "compile_s": compile_s[True],
            "ttft_on_s": on, "ttft_off_s": off, "speedup": off / on, "ttft_on_all_s": times[True],
            "ttft_off_all_s": times[False], "prefix_hit_tokens": hits}


def markdown(record: dict) -> str:
    r = record["result"]
    return "\n".join([
        "# Prefix caching: time to first token with the prefix computed before",
        "",
        f"Model `{r['model']}` (random init, float32) on {record['machine_line']}; kernels {r['kernels']}.",
        f"A prompt of a {r['prefix_tokens']}-token prefix an earlier request computed and a {r['suffix_tokens']}-token "
        f"suffix, alone in the engine; medians of {r['trials']} trials, the two engines in turns.",
        "",
        "| prefix caching | TTFT median ms | each trial ms |",
        "| --- | --- | --- |",
        f"| on | {r['ttft_on_s'] * 1e3:,.1f} | {', '.join(f'{t * 1e3:,.0f}' for t in r['ttft_on_all_s'])} |",
        f"| off | {r['ttft_off_s'] * 1e3:,.1f} | {', '.join(f'{t * 1e3:,.0f}' for t in r['ttft_off_all_s'])} |",
        "",
        f"First token {r['speedup']:.1f}x sooner with the prefix cached ({r['prefix_hit_tokens']:,} prompt tokens "
        "found in the cache over the run, the warm-up's included).",
        "",
        f"Command: `{record['command']}`",
        "",
    ])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", choices=("baby", "smollm2", "tiny"))
    parser.add_argument("--prefix", type=int, default=512)
    parser.add_argument("--suffix", type=int, default=16)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--data", default=None, help="Tiny Shakespeare (default: as bench/serve.py finds it)")
    parser.add_argument("--cache-dir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "prefix_cache")
    args = parser.parse_args(argv)
    if args.prefix < 16 or args.suffix < 1 or args.trials < 1:
        parser.error("--prefix must be >= 16, --suffix and --trials >= 1")
    machine = describe_machine()
    command = " ".join(["PYTHONPATH=$PWD python bench/prefix_cache.py",
                        *(a if not a.startswith("/") else "/path/to/" + Path(a).name for a in (argv or sys.argv[1:]))])
    record = {"machine": machine, "machine_line": machine_line(machine), "command": command,
              "result": measure(args)}
    write_results(args.out.parent, args.out.name, record, markdown(record))
    print(markdown(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
