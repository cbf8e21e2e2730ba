"""Quantized decoding on an accelerator: jaxattn's weight and KV-cache formats beside transformers, one process.

    PYTHONPATH=$PWD python bench/quant_gpu.py [--rounds 3] [--calls 2] [--new-tokens 128] [--engine-batch 32]
        [--runners jax,engine,hf] [--weights float32,bfloat16,int8,int4] [--out bench/results/quant_gpu]
    PYTHONPATH=$PWD python bench/quant_gpu.py --quick     # a smoke run on any backend: a tiny Llama, a few tokens

bench/quant.py measures a CPU: each cell in a fresh process pinned to cores, beside llama.cpp. An
accelerator has no cores to pin, and starting CUDA afresh for each cell would cost more than the cell,
so here every cell is prepared (loaded, quantized, compiled, warmed up) in this one process on JAX's
default device, and then all are timed in turns (`bench.timing.in_turns`: one call of each per round,
the order reversed every other round; --rounds x --calls timed calls; medians). The model is
bench/quant.py's: random weights of SmolLM2-135M's shape (bench/serve.py's `smollm2` checkpoint).

* `jax`: `jaxattn.generate` at batch 1, greedy, --new-tokens after a prompt of --prompt-len, for each
  of --weights with the KV cache in the compute dtype ("float"), and float32 and int8 weights with the
  int8 cache; the kernels "auto" resolves to on this device (printed in the table).
* `engine`: `jaxattn.serving.Engine`, --engine-batch sequences added at once, each of --weights, the
  float cache and (float32 weights) the int8 cache: output tokens/s over the whole call.
* `hf`: transformers' `generate` (sdpa, KV cache) on torch's CUDA device, float32 and bfloat16
  weights, at batch 1 and --engine-batch; unavailable, with the reason, where torch has no CUDA.

Beside each batch-1 cell: the bytes of weights one token reads (`bench.quant.weight_bytes_per_token`)
and the GB/s that makes against the device's read bandwidth (a jitted sum over a float32 buffer of
--stream-mb, timed in the same turns). Writes --out.json and --out.md with the device, JAX's and
torch's versions and the command.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.machine import portable_command, write_results  # noqa: E402
from bench.quant import cell_name, engine_decoder, fmt, jax_decoder, model_line, prompts, quick_config  # noqa: E402
from bench.serve import default_cache_dir, ensure_checkpoint  # noqa: E402
from bench.timing import in_turns, ratio, seconds  # noqa: E402

RESULTS = ROOT / "bench" / "results"
RUNNERS = ("jax", "engine", "hf")
WEIGHTS = ("float32", "bfloat16", "int8", "int4")
INT8_CACHE_WEIGHTS = ("float32", "int8")  # the weights also run with the int8 KV cache
HF_DTYPES = ("float32", "bfloat16")


def hf_decoder(spec: dict) -> tuple:
    """(a call of transformers' greedy `generate` on torch's CUDA device, facts) or (None, why not)."""
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError as err:
        return None, {"available": False, "reason": f"torch or transformers does not import: {err}"}
    if not torch.cuda.is_available():
        return None, {"available": False, "reason": f"torch {torch.__version__} sees no CUDA device"}
    model = AutoModelForCausalLM.from_pretrained(spec["checkpoint"], dtype=getattr(torch, spec["weights"]),
                                                 attn_implementation="sdpa").to("cuda").eval()
    prompt = torch.tensor(prompts(spec["batch"], spec["prompt_len"], model.config.vocab_size), device="cuda")

    def call():
        with torch.inference_mode():
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=spec["new_tokens"],
                                 min_new_tokens=spec["new_tokens"], do_sample=False, use_cache=True, pad_token_id=0)
        torch.cuda.synchronize()
        return out
    return call, {"available": True, "torch": torch.__version__, "device": torch.cuda.get_device_name()}


def read_bandwidth(megabytes: int) -> tuple:
    """(a call summing a float32 buffer of `megabytes` on JAX's default device, the bytes it reads)."""
    buffer = jnp.ones((megabytes * 2**20 // 4,), jnp.float32)
    total = jax.jit(jnp.sum)
    return (lambda: total(buffer)), buffer.nbytes


def cases(args, checkpoint: Path) -> list[dict]:
    """Every cell: a spec for `jax_decoder`, `engine_decoder` or `hf_decoder`."""
    base = {"checkpoint": str(checkpoint), "prompt_len": args.prompt_len, "new_tokens": args.new_tokens}
    out = []
    if "jax" in args.runners:
        out += [{**base, "runner": "jax", "weights": w, "cache": "float", "batch": 1} for w in args.weights]
        out += [{**base, "runner": "jax", "weights": w, "cache": "int8", "batch": 1}
                for w in INT8_CACHE_WEIGHTS if w in args.weights]
    if "engine" in args.runners:
        out += [{**base, "runner": "engine", "weights": w, "cache": "float", "batch": args.engine_batch}
                for w in args.weights]
        out += [{**base, "runner": "engine", "weights": "float32", "cache": "int8", "batch": args.engine_batch}]
    if "hf" in args.runners:
        out += [{**base, "runner": "hf", "weights": d, "cache": "float", "batch": b}
                for d in HF_DTYPES for b in (1, args.engine_batch)]
    return out


DECODERS = {"jax": jax_decoder, "engine": engine_decoder, "hf": hf_decoder}


def measure(specs: list[dict], rounds: int, calls: int, stream_mb: int) -> tuple[list[dict], float]:
    """(one row per cell, the device's read GB/s): every cell prepared and called once (compiling),
    then all timed in turns. A cell that raises is reported failed, with the error, and not timed."""
    prepared, facts, first = {}, {}, {}
    for spec in specs:
        name = cell_name(spec)
        print(f"preparing {name}", file=sys.stderr, flush=True)
        try:
            call, facts[name] = DECODERS[spec["runner"]](spec)
            if call is not None:
                first[name] = seconds(call)[1]
                prepared[name] = call
        except Exception as err:  # one cell's failure is reported beside the others' figures
            facts[name] = {"available": False, "reason": f"failed: {type(err).__name__}: {err}"}
    prepared["read"], read_bytes = read_bandwidth(stream_mb)
    first["read"] = seconds(prepared["read"])[1]
    print(f"timing {len(prepared)} calls in turns, {rounds * calls} rounds", file=sys.stderr, flush=True)
    timings = in_turns(prepared, rounds * calls, warmup=False)
    read_gbs = read_bytes / timings["read"].median_s / 1e9
    rows = []
    for spec in specs:
        name = cell_name(spec)
        row = {k: spec[k] for k in ("runner", "weights", "cache", "batch")} | facts[name]
        if name in timings:
            timing = timings[name]
            row.update(median_s=timing.median_s, times_s=timing.times_s, first_s=timing.first_s,
                       tokens_per_s=spec["batch"] * spec["new_tokens"] / timing.median_s,
                       ms_per_step=timing.median_s / spec["new_tokens"] * 1e3)
            row.setdefault("compile_s", max(first[name] - timing.median_s, 0.0))
            if "weight_bytes_per_token" in row and spec["batch"] == 1:
                row["gb_per_s"] = row["weight_bytes_per_token"] * spec["new_tokens"] / timing.median_s / 1e9
                row["of_read"] = row["gb_per_s"] / read_gbs
        rows.append(row)
    for row in rows:
        base = next((r for r in rows if r["runner"] == row["runner"] and r["batch"] == row["batch"]
                     and r["weights"] == "float32" and r["cache"] == "float"), None)
        row["vs_float32"] = ratio(row.get("tokens_per_s"), base and base.get("tokens_per_s"))
    return rows, read_gbs


def markdown(record: dict) -> str:
    meta = record["meta"]
    lines = [f"# Quantized decoding on {meta['device']}", "",
             f"{meta['model']}; prompt {meta['prompt_len']}, {meta['new_tokens']} new tokens, greedy; "
             f"JAX {meta['jax']} ({meta['backend']}); every cell prepared in one process, then timed in turns, "
             f"{meta['timed_calls']} timed calls each (medians). Device read bandwidth (a jitted sum): "
             f"{meta['read_gb_per_s']:,.0f} GB/s.", "",
             "| runner | weights | cache | batch | tokens/s | ms/step | vs float32 | weight MB/token | GB/s "
             "| of read | compile s | kernels |", "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: "
             "| ---: | ---: | --- |"]
    for row in record["rows"]:
        if not row.get("available"):
            lines.append(f"| {row['runner']} | {row['weights']} | {row['cache']} | {row['batch']} | "
                         f"unavailable: {row.get('reason')} | | | | | | | |")
            continue
        kernels = row.get("kernels") or {}
        chosen = ", ".join(f"{k}={kernels[k]}" for k in ("matmul", "quantized", "decode", "paged") if k in kernels)
        lines.append(
            f"| {row['runner']} | {row['weights']} | {row['cache']} | {row['batch']} | {fmt(row['tokens_per_s'])} | "
            f"{fmt(row['ms_per_step'], '.2f')} | {fmt(row['vs_float32'], '.2f')}x | "
            f"{fmt(row.get('weight_bytes_per_token') and row['weight_bytes_per_token'] / 1e6, ',.0f')} | "
            f"{fmt(row.get('gb_per_s'))} | {fmt(row.get('of_read'), '.0%')} | {fmt(row.get('compile_s'), '.1f')} | "
            f"{chosen or row.get('device', '')} |")
    lines += ["", f"Command: `{meta['command']}`", ""]
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runners", default=",".join(RUNNERS), help="comma-separated subset of %(default)s")
    parser.add_argument("--weights", default=",".join(WEIGHTS), help="comma-separated subset of %(default)s")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=2, help="timed calls per cell per round")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--engine-batch", type=int, default=32)
    parser.add_argument("--stream-mb", type=int, default=2048, help="the read-bandwidth buffer's size")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="where the checkpoint is written once (default: bench/serve.py's cache)")
    parser.add_argument("--out", type=Path, default=None, help="writes OUT.json and OUT.md (default "
                        "bench/results/quant_gpu; --quick: a temporary directory)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: a tiny Llama, 4 new tokens, one round")
    args = parser.parse_args(argv)
    args.runners = [r for r in args.runners.split(",") if r]
    args.weights = [w for w in args.weights.split(",") if w]
    for name, given, allowed in (("runners", args.runners, RUNNERS), ("weights", args.weights, WEIGHTS)):
        if not given or set(given) - set(allowed):
            parser.error(f"--{name} takes a comma-separated subset of {','.join(allowed)}, got {','.join(given)!r}")
    if args.quick:
        args.rounds, args.calls, args.new_tokens, args.prompt_len = 1, 1, 4, 8
        args.engine_batch, args.stream_mb = 2, 16
    for name in ("rounds", "calls", "new_tokens", "prompt_len", "engine_batch", "stream_mb"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    name = "quick" if args.quick else "smollm2"
    checkpoint, facts = ensure_checkpoint(name, args.cache_dir or default_cache_dir(),
                                          quick_config() if args.quick else None)
    rows, read_gbs = measure(cases(args, checkpoint), args.rounds, args.calls, args.stream_mb)
    device = jax.devices()[0]
    model = model_line(facts, args.quick)
    meta = {"device": f"{device.device_kind} ({device.platform})", "backend": jax.default_backend(),
            "jax": jax.__version__, "model": model, "checkpoint": facts, "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens, "engine_batch": args.engine_batch, "timed_calls": args.rounds * args.calls,
            "read_gb_per_s": read_gbs, "numpy": np.__version__,
            "command": "PYTHONPATH=$PWD python bench/quant_gpu.py " + portable_command(
                ["", *map(shlex.quote, argv)], ("--cache-dir", "--out")).strip()}
    record = {"meta": meta, "rows": rows}
    out = args.out or (Path(tempfile.gettempdir()) / "jaxattn-quant-gpu-quick" / "quant_gpu" if args.quick
                       else RESULTS / "quant_gpu")
    write_results(out.parent, out.name, record, markdown(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
