"""How a loaded model is laid out: `generate`'s speed at batch 1 in each layout, in one process.

    PYTHONPATH=$PWD .venv/bin/python bench/fused_qkv.py [--weights float32,int8,int4] [--rounds 4]
    PYTHONPATH=$PWD .venv/bin/python bench/fused_qkv.py --quick --out DIR    # a tiny Llama, a smoke run

A Llama-family checkpoint stores q, k and v apart; `train.sample`, `train.serve` and bench/quant.py fuse
them on loading (`jaxattn.with_fused_qkv`) and, once the kernels are resolved, lay quantized weights out
as the chosen kernel reads them (`jaxattn.prepare_weights`: "native_cpu_q8act"'s panels). On the
SmolLM2-135M-shaped model (bench/serve.py's `smollm2`, random init), for each weight format: one greedy
`generate` of --new-tokens after a 16-token prompt with the projections "separate", "fused", and (quantized
formats) "fused, prepared", the tokens of each equal to the first's; the kernels "auto" resolves to
here; every call compiled and warmed up first, then the cells timed in turns (`bench.timing.in_turns`).
Writes bench/results/fused_qkv.{json,md}.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.machine import describe_machine, machine_line, portable_command, write_results  # noqa: E402
from bench.timing import in_turns  # noqa: E402

PROMPT = 16


def cells(weights: list[str], new_tokens: int, quick: bool = False, cache_dir: Path | None = None) -> tuple[dict, dict]:
    """({(format, layout): a zero-argument call}, {(format, layout): its tokens}) on the checkpoint."""
    import jax
    import numpy as np

    from bench.quant import quick_config
    from bench.serve import default_cache_dir, ensure_checkpoint
    from jaxattn import hf, prepare_weights, resolve_kernels, with_fused_qkv
    from jaxattn.decoding import generate
    from jaxattn.quantization import quantize
    name, model = ("quick", quick_config()) if quick else ("smollm2", None)
    checkpoint, _ = ensure_checkpoint(name, cache_dir or default_cache_dir(), model)
    config, params = hf.load_pretrained(str(checkpoint), dtype="float32")
    kernels = resolve_kernels()[0]
    prompt, lengths = np.ones((1, PROMPT), np.int32), np.array([PROMPT], np.int32)
    fused = with_fused_qkv(params, config)
    calls, tokens = {}, {}
    for weight in weights:
        held = {"separate": (params, config), "fused": fused}
        if weight != "float32":
            held = {layout: (quantize(p, c, weight), c) for layout, (p, c) in held.items()}
            held["fused, prepared"] = (prepare_weights(held["fused"][0], kernels), fused[1])
        for layout, (p, c) in held.items():
            def call(p=p, c=c):
                return np.asarray(generate(p, c, prompt, lengths, max_new_tokens=new_tokens,
                                           rng=jax.random.PRNGKey(0), temperature=0.0, kernels=kernels).tokens)
            calls[weight, layout], tokens[weight, layout] = call, call()  # compiled here, not in the timing
    return calls, tokens


def markdown(record: dict) -> str:
    lines = [f"# Layouts of a loaded model: `generate` on {machine_line(record['machine'])}", "",
             f"{record['model']} (random init), batch 1, greedy, {PROMPT}-token prompt, {record['new_tokens']} "
             f"new tokens; kernels `{record['kernels']}`; medians of {record['rounds']} rounds in turns, in one "
             f"process. Command: `{record['command']}`.", "",
             "| weights | layout | tok/s | over separate | same tokens |", "| --- | --- | ---: | ---: | --- |"]
    for row in record["rows"]:
        lines.append(f"| {row['weights']} | {row['layout']} | {row['tokens_per_s']:.1f} | {row['speedup']:.2f}x | "
                     f"{'yes' if row['same_tokens'] else 'no'} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", default="float32,int8,int4")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--cache-dir", type=Path, default=None, help="where the checkpoint is written once")
    parser.add_argument("--quick", action="store_true", help="a tiny Llama, 2 rounds of 8 tokens (a smoke run)")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.new_tokens = 2, 8
    from jaxattn import resolve_kernels
    weights = [w.strip() for w in args.weights.split(",") if w.strip()]
    calls, tokens = cells(weights, args.new_tokens, args.quick, args.cache_dir)
    timings = in_turns(calls, args.rounds, warmup=False)
    rows = []
    for weight in weights:
        layouts = [layout for w, layout in calls if w == weight]
        base = args.new_tokens / timings[weight, "separate"].median_s
        for layout in layouts:
            speed = args.new_tokens / timings[weight, layout].median_s
            rows.append({"weights": weight, "layout": layout, "tokens_per_s": speed, "speedup": speed / base,
                         "same_tokens": bool((tokens[weight, layout] == tokens[weight, "separate"]).all())})
    record = {"machine": describe_machine(), "command": portable_command(sys.argv, ("--out", "--cache-dir")),
              "model": "a tiny Llama" if args.quick else "SmolLM2-135M's shape",
              "kernels": str(resolve_kernels()[0]), "new_tokens": args.new_tokens, "rounds": args.rounds, "rows": rows}
    write_results(args.out, "fused_qkv", record, markdown(record))
    return record


if __name__ == "__main__":
    main()
