"""A GGUF file as llama.cpp users run it: jaxattn with the file's weights kept quantized, beside llama.cpp.

    PYTHONPATH=$PWD python bench/gguf_kept.py --gguf FILE [--threads 2] [--rounds 3] [--new-tokens 128]
        [--prompt-len 512] [--out bench/results/gguf_kept_<file stem>]

Cells, each in a fresh process (`bench.fresh`) pinned to --threads cores, once per round, in turns:

* `jaxattn kept`: `train.models.load.load_model` of the file as `train.sample --gguf FILE` loads it (the
  file's blocks kept quantized, `jaxattn.gguf.kept`), the kernels "auto" resolves to on this machine and
  the weights laid out for them (`prepare_weights`);
* `jaxattn kept, native_cpu`: the same with the activations left float32 (`Kernels.quantized`
  "native_cpu"), the formulation "auto" chose before integer-dot paths beyond AVX512-VNNI;
* `jaxattn float32`: the same with `--dtype float32` (every weight dequantized);
* `llama.cpp`: `llama-cpp-python` on the same file (bench/quant.py's `run_llamacpp`), n_threads =
  n_threads_batch = --threads. Unavailable, with the reason, where `llama_cpp` does not import.

Each cell measures: decode tokens/s at batch 1 (a 16-token prompt, --new-tokens greedy tokens, the
median of --calls calls after a warm-up); prompt processing tokens/s (llama.cpp's `pp512`: one
evaluation of a --prompt-len-token prompt, the median of --calls); the process's resident size before
the model (the runtime alone), once it is loaded, and once it is ready (compiled and run, the C heap's
freed pages given back as `train.serve` gives them), and its peak, beside the file's size. Reported:
each cell's median over rounds.
Writes --out.json and --out.md with the CPU named and the command.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import fresh  # noqa: E402
from bench.machine import cpu_cores, describe_machine, pin_to_cores, machine_line, portable_command, write_results  # noqa: E402

CELLS = ("jaxattn kept", "jaxattn kept, native_cpu", "jaxattn float32", "llama.cpp")
DECODE_PROMPT = 16


def resident_bytes() -> int:
    import psutil
    return psutil.Process().memory_info().rss


def run_jaxattn(spec: dict) -> dict:
    """One jaxattn cell: the model loaded as `train.sample` loads it, then decode and prompt processing timed."""
    import jax
    import numpy as np

    from bench.quant import prompts
    from bench.timing import time_call
    from jaxattn import DecoderLM
    from jaxattn.decoding import generate
    from jaxattn.kernels import prepare_weights, resolve_kernels
    from jaxattn.quantization import weight_bytes
    from train.models.load import load_model
    from train.models.source import ModelSource
    from train.run.host_memory import release_freed_memory
    jax.devices()  # the runtime started: what any JAX program holds before a model
    runtime_rss = resident_bytes()
    loaded = load_model(ModelSource(gguf=spec["gguf"], dtype=spec["dtype"]))
    loaded_rss = resident_bytes()
    kernels = resolve_kernels()[0]
    if spec["cell"].endswith("native_cpu"):
        kernels = kernels.replace(quantized="native_cpu")
    params, config = prepare_weights(loaded.params, kernels), loaded.config
    prompt = np.asarray(prompts(1, DECODE_PROMPT, config.vocab_size), np.int32)

    def decode():
        return generate(params, config, prompt, np.array([DECODE_PROMPT], np.int32), max_new_tokens=spec["new_tokens"],
                        rng=jax.random.PRNGKey(0), temperature=0.0, kernels=kernels).tokens

    long_prompt = np.asarray(prompts(1, spec["prompt_len"], config.vocab_size), np.int32)
    forward = jax.jit(lambda p, ids: DecoderLM(config, kernels).apply({"params": p}, ids)[:, -1])
    decode_time = time_call(decode, spec["calls"])
    prompt_time = time_call(lambda: forward(params, long_prompt), spec["calls"])
    release_freed_memory()  # as train.serve does once its programs are compiled
    return {"available": True, "decode_tokens_per_s": spec["new_tokens"] / decode_time.median_s,
            "prompt_tokens_per_s": spec["prompt_len"] / prompt_time.median_s, "rss_bytes": resident_bytes(),
            "runtime_rss_bytes": runtime_rss, "loaded_rss_bytes": loaded_rss,
            "weight_bytes": weight_bytes(params), "quant": loaded.quant, "head_quant": loaded.head_quant,
            "kernels": kernels.to_dict(), "notes": list(loaded.notes)}


def run_llamacpp(spec: dict) -> dict:
    """llama.cpp on the file: decode as bench/quant.py's `run_llamacpp`, then a --prompt-len prompt in one batch."""
    from bench import quant
    from bench.timing import time_call
    runtime_rss = resident_bytes()
    decode = quant.run_llamacpp({**spec, "prompt_len": DECODE_PROMPT, "n_batch": 1})
    if not decode.get("available"):
        return decode
    import llama_cpp
    n = spec["prompt_len"]
    llm = llama_cpp.Llama(spec["gguf"], n_ctx=n + 1, n_batch=n, n_ubatch=n, n_threads=spec["threads"],
                          n_threads_batch=spec["threads"], verbose=False)
    prompt = quant.prompts(1, n, llm.n_vocab())[0]

    def evaluate():
        llm.reset()
        llm.eval(prompt)
    prompt_time = time_call(evaluate, spec["calls"])
    return {"available": True, "decode_tokens_per_s": decode["tokens_per_s"], "prompt_tokens_per_s": n / prompt_time.median_s,
            "rss_bytes": resident_bytes(), "runtime_rss_bytes": runtime_rss, "system_info": decode["system_info"],
            "llama_cpp_python": decode["llama_cpp_python"]}


def run_cell(spec: dict) -> dict:
    pin_to_cores(spec["threads"])
    return run_llamacpp(spec) if spec["cell"] == "llama.cpp" else run_jaxattn(spec)


def measure(args) -> dict[str, list[dict]]:
    """Every cell once per round in a fresh process, in turns (the order reversed every other round)."""
    results: dict[str, list[dict]] = {cell: [] for cell in CELLS}
    for round_ in range(args.rounds):
        for cell in (CELLS if round_ % 2 == 0 else CELLS[::-1]):
            spec = {"cell": cell, "gguf": str(args.gguf), "dtype": "float32" if cell == "jaxattn float32" else None,
                    "threads": args.threads, "new_tokens": args.new_tokens, "prompt_len": args.prompt_len,
                    "calls": args.calls}
            done = fresh.run(fresh.function_argv("bench.gguf_kept:run_cell", spec), what=cell,
                             env=fresh.environment(args.threads), timeout=args.timeout)
            record = {**done.json(), "peak_rss_bytes": done.peak_rss_bytes}
            print(f"round {round_ + 1} {cell}: {record.get('decode_tokens_per_s', 0):.1f} tok/s decode, "
                  f"{record.get('prompt_tokens_per_s', 0):.1f} tok/s pp{args.prompt_len}", file=sys.stderr)
            results[cell].append(record)
    return results


def summarize(results: dict[str, list[dict]], file_bytes: int) -> list[dict]:
    rows = []
    for cell, records in results.items():
        ok = [r for r in records if r.get("available")]
        if not ok:
            rows.append({"cell": cell, "available": False, "reason": records[0].get("reason") if records else None})
            continue
        median = lambda key: statistics.median(r[key] for r in ok)  # noqa: E731
        rows.append({"cell": cell, "available": True, "decode_tokens_per_s": median("decode_tokens_per_s"),
                     "prompt_tokens_per_s": median("prompt_tokens_per_s"), "rss_bytes": median("rss_bytes"),
                     "peak_rss_bytes": median("peak_rss_bytes"), "weight_bytes": ok[0].get("weight_bytes"),
                     "runtime_rss_bytes": median("runtime_rss_bytes"),
                     "loaded_rss_bytes": statistics.median(r.get("loaded_rss_bytes") or 0 for r in ok) or None,
                     "quant": ok[0].get("quant"), "head_quant": ok[0].get("head_quant"),
                     "file_bytes": file_bytes})
    return rows


def markdown(record: dict) -> str:
    mb = lambda b: "–" if b is None else f"{b / 2**20:,.0f}"  # noqa: E731
    lines = [f"# {Path(record['gguf']).name}: jaxattn keeping the file quantized, beside llama.cpp", "",
             machine_line(record["machine"]), "", f"`{record['command']}`", "",
             f"File: {mb(record['file_bytes'])} MiB. Batch 1, {record['threads']} threads, decode after a "
             f"{DECODE_PROMPT}-token prompt, {record['new_tokens']} new tokens; pp{record['prompt_len']}: one "
             f"{record['prompt_len']}-token prompt. Median over {record['rounds']} rounds (fresh processes, in turns).",
             "RSS: the process's resident size, MiB. Runtime: before the model (Python, JAX's runtime, llama.cpp's "
             "library). Loaded: once the model is read. Ready: after compiling and running both measurements, the C "
             "heap's freed pages given back (as `train.serve` does once its programs are compiled). Peak: the "
             "process's highest.",
             "", f"| runner | weights | decode tok/s | pp{record['prompt_len']} tok/s | weights MiB | RSS runtime "
             "| RSS loaded | RSS ready | ready - runtime | peak RSS |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in record["rows"]:
        if not row["available"]:
            lines.append(f"| {row['cell']} | unavailable: {row['reason']} |" + " |" * 8)
            continue
        weights = row["quant"] or ("the file's" if row["cell"] == "llama.cpp" else "float32")
        if row.get("head_quant"):
            weights += f" (head {row['head_quant']})"
        lines.append(f"| {row['cell']} | {weights} | {row['decode_tokens_per_s']:.1f} | {row['prompt_tokens_per_s']:.1f} "
                     f"| {mb(row['weight_bytes'])} | {mb(row.get('runtime_rss_bytes'))} | {mb(row.get('loaded_rss_bytes'))} "
                     f"| {mb(row['rss_bytes'])} | {mb(row['rss_bytes'] - (row.get('runtime_rss_bytes') or 0))} "
                     f"| {mb(row['peak_rss_bytes'])} |")
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gguf", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=min(2, cpu_cores()))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--timeout", type=float, default=1200.0)
    parser.add_argument("--out", type=Path, default=None)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.gguf.is_file():
        print(f"error: --gguf {args.gguf}: no such file", file=sys.stderr)
        return 2
    file_bytes = os.path.getsize(args.gguf)
    rows = summarize(measure(args), file_bytes)
    record = {"gguf": args.gguf.name, "file_bytes": file_bytes, "threads": args.threads, "rounds": args.rounds,
              "new_tokens": args.new_tokens, "prompt_len": args.prompt_len, "rows": rows,
              "machine": describe_machine(), "command": portable_command(sys.argv, ("--gguf", "--out"))}
    out = args.out or ROOT / "bench" / "results" / f"gguf_kept_{args.gguf.stem.replace('.', '_')}"
    write_results(out.parent, out.name, record, markdown(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
