"""Speculative decoding in the serving engine at batch 1 on a real model: an engine drafting by prompt lookup
(and, with --draft, one drafting with a draft model) beside a plain engine, on bench/speculative.py's prompts.

    PYTHONPATH=$PWD .venv/bin/python bench/speculative_engine.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf
        [--weights served|float32] [--new-tokens 128] [--rounds 3] [--k 4] [--draft DIR]
        [--out bench/results/speculative_engine]

--weights "served" (the default) runs the model as `python -m train.serve --gguf` serves it: the file's
weights kept quantized, laid out for the kernels `train.serve` picks (`train.models.load.load_model`,
`serving_kernels`, `prepare_weights`). "float32" dequantizes them to float32, q, k and v fused, with the
kernels `train.serve` picks for a float32 model (bench/speculative.py's model, which transformers runs
too). Each engine holds one row (`max_seqs` 1) and serves one request at a time, greedy, exactly
--new-tokens tokens (no stop token). Two rates per engine: tokens/s from the request's arrival to its last
token, prompt included, and the decode rate after the first token (the tokens after it over the time
between the first and the last: what speculative decoding changes; the prompt's prefill is the same). The
engines are timed in turns (`bench.timing.in_turns`, medians of --rounds), in one process; the
speculative engine's tokens are checked against the plain one's, and its spec-decode counters are reported
per prompt.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.machine import describe_machine, load_average, machine_line, portable_command, write_results  # noqa: E402
from bench.speculative import PROMPTS, leading_agreement, load, load_draft  # noqa: E402


def served_model(gguf: Path):
    """(config, params, kernels) as `python -m train.serve --gguf` runs the file: kept quantized."""
    from jaxattn.kernels import prepare_weights
    from train.models.load import load_model
    from train.models.source import ModelSource
    from train.serve import serving_kernels
    loaded = load_model(ModelSource(gguf=str(gguf)))
    kernels, _ = serving_kernels(loaded.config.dtype)
    return loaded.config, prepare_weights(loaded.params, kernels), kernels


def engines(model, args) -> dict:
    """The engines compared: "plain", "ngram" and, with --draft, "draft"."""
    from jaxattn.serving import Engine, EngineConfig
    from jaxattn.speculative import DraftProposer, NgramSettings
    config, params, kernels = model
    base = EngineConfig(max_seqs=1, page_size=16, max_model_len=1024, prefill_rows=1, chunk=256)
    made = {"plain": Engine(params, config, base, kernels=kernels),
            "ngram": Engine(params, config, dataclasses.replace(base, speculative=NgramSettings(1, 3, args.k)),
                            kernels=kernels)}
    if args.draft is not None:
        draft_config, draft_params, _ = load_draft(args.draft)
        draft_kernels = kernels if args.weights == "float32" else serving_kernels_float32()
        made["draft"] = Engine(params, config, base, kernels=kernels,
                               draft=DraftProposer(draft_params, draft_config, k=args.k, kernels=draft_kernels))
    return made


def model_kernels(kernels) -> str:
    """The kernels that run the products: the float matmul's and, for a quantized model, the quantized one's."""
    return f"matmul {kernels.matmul!r}, quantized {kernels.quantized!r}, paged {kernels.paged!r}"


def serving_kernels_float32():
    from train.serve import serving_kernels
    return serving_kernels("float32")[0]


def measure(kind: str, made: dict, tokenizer, chat, args) -> dict:
    from bench.timing import in_turns
    from jaxattn.serving import SamplingParams
    prompt_ids = tokenizer.encode(chat.render([{"role": "user", "content": PROMPTS[kind]}]))
    sampling = SamplingParams(temperature=0.0, max_tokens=args.new_tokens)
    outputs, before = {}, {name: dict(engine.speculator.metrics()) if engine.speculator else None
                           for name, engine in made.items()}

    decode = {name: [] for name in made}  # each call's decode rate after its first token

    def call(name):
        def run():
            request = made[name].add_request(prompt_ids, sampling)
            made[name].run()
            outputs[name], times = request.output_ids, request.token_times
            decode[name].append((len(times) - 1) / (times[-1] - times[0]))
        return run

    timings = in_turns({name: call(name) for name in made}, args.rounds)
    tps = {name: args.new_tokens / t.median_s for name, t in timings.items()}
    decode_tps = {name: statistics.median(rates[1:]) for name, rates in decode.items()}  # the warm-up left out
    row = {"prompt_tokens": len(prompt_ids), "tokens_per_s": tps, "decode_tokens_per_s": decode_tps,
           "times_s": {n: t.times_s for n, t in timings.items()}}
    for name in made:
        if name == "plain":
            continue
        now, then = made[name].speculator.metrics(), before[name]
        drafted = now["draft_tokens"] - then["draft_tokens"]
        accepted = now["accepted_tokens"] - then["accepted_tokens"]
        row[name] = {"speedup": tps[name] / tps["plain"], "decode_speedup": decode_tps[name] / decode_tps["plain"],
                     "acceptance_rate": accepted / drafted if drafted else 0.0,
                     "verify_steps": now["steps"] - then["steps"], "draft_tokens": drafted,
                     "accepted_tokens": accepted, "equals_plain": outputs[name] == outputs["plain"],
                     "step_ms_by_width": step_ms(made[name].speculator.costs),
                     "agrees_for": leading_agreement(outputs[name], outputs["plain"])}
    return row


def step_ms(costs) -> dict[str, float]:
    """The engine's own timings at one row: milliseconds a decode-only step, by tokens a row (1: plain)."""
    return {str(width): 1e3 * costs.seconds(rows, width) for rows, width in sorted(costs.timings) if rows == 1}


def markdown(record: dict) -> str:
    lines = [f"# Speculative decoding in the engine, batch 1 ({record['model']}, {record['weights']} weights)", "",
             f"Machine: {machine_line(record['machine'])}; 1-minute load {record['load_before']:.2f} before, "
             f"{record['load_after']:.2f} after; kernels {record['kernels']}; {record['new_tokens']} greedy tokens "
             f"a request, k up to {record['k']}, medians of {record['rounds']} rounds in turns.", "",
             f"Command: `{record['command']}`", "",
             "| prompt | proposer | plain tok/s | speculative tok/s | speed-up | decode speed-up | acceptance | "
             "verify steps | same tokens |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for kind, row in record["prompts"].items():
        for name in ("ngram", "draft"):
            if name in row:
                r = row[name]
                lines.append(f"| {kind} | {name} | {row['tokens_per_s']['plain']:.1f} | {row['tokens_per_s'][name]:.1f} "
                             f"| {r['speedup']:.2f}x | {r['decode_speedup']:.2f}x | {r['acceptance_rate']:.2f} | "
                             f"{r['verify_steps']} | {'yes' if r['equals_plain'] else 'first ' + str(r['agrees_for'])} |")
    lines += ["", "Tokens/s count the request from its arrival, prompt included; the decode speed-up is the ratio of "
              "the rates after the first token.", "",
              "What a decode step cost the engine (its own timings, `DraftCosts`: the lower median of the last few "
              "steps of each width, in ms, after the last prompt):", ""]
    last = list(record["prompts"].values())[-1]
    widths = sorted({int(w) for name in ("ngram", "draft") if name in last for w in last[name]["step_ms_by_width"]})
    lines += ["| proposer | " + " | ".join(f"{w} token{'s' if w > 1 else ''} a row" for w in widths) + " |",
              "| --- | " + " | ".join("---:" for _ in widths) + " |"]
    for name in ("ngram", "draft"):
        if name in last:
            ms = last[name]["step_ms_by_width"]
            lines.append(f"| {name} | " + " | ".join(f"{ms[str(w)]:.1f}" if str(w) in ms else "-" for w in widths) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, required=True, help="SmolLM2-135M-Instruct's GGUF file")
    parser.add_argument("--weights", choices=("served", "float32"), default="served",
                        help="served: the file kept quantized, as train.serve runs it; float32: dequantized")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--draft", type=Path, help="a draft model's transformers directory (train.distill_draft)")
    parser.add_argument("--prompts", default=",".join(PROMPTS), help="which of: " + ", ".join(PROMPTS))
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"), help="the results' folder")
    parser.add_argument("--name", default="speculative_engine")
    args = parser.parse_args(argv)
    config, params, tokenizer, chat, _ = load(str(args.gguf))
    model = (config, params, serving_kernels_float32()) if args.weights == "float32" else served_model(args.gguf)
    del params
    load_before = load_average()
    made = engines(model, args)
    record = {"model": args.gguf.stem, "weights": args.weights, "kernels": model_kernels(model[2]),
              "machine": describe_machine(),
              "new_tokens": args.new_tokens, "k": args.k, "rounds": args.rounds, "load_before": load_before,
              "command": "PYTHONPATH=$PWD python bench/speculative_engine.py " + portable_command(
                  sys.argv[1:] if argv is None else argv, ("--gguf", "--draft", "--out")),
              "prompts": {kind: measure(kind, made, tokenizer, chat, args) for kind in args.prompts.split(",")}}
    record["load_after"] = load_average()
    write_results(args.out, args.name, record, markdown(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
