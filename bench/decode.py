"""Decode tokens/s: KV-cached `generate` vs full recomputation vs Hugging Face, per attention kind.

    PYTHONPATH=$PWD python bench/decode.py [--hf-python /work/scratch/hf/.venv/bin/python] [--models baby,small --kinds MHA,GQA\ kv=2,MQA,MLA --lengths 256,1000]

Random-init models (speed does not depend on the weights), greedy, prompt of
16 tokens, batch 1 and 8, 256 and 1000 new tokens. Medians of --repeats runs;
compile time (first call minus a steady call) reported separately. Models:
"baby" (4 layers, 4 heads, d 128, vocab 65, 0.8M params) and "small" (6 layers,
6 heads, d 384, vocab 65, 10.7M params), both with max_seq_len 1024 so that
1000 new tokens fit (the trained 10.7M model has block 256). With --hf-python,
Hugging Face's `generate` runs each (model, batch, length) case right before
ours, so that both are timed in the same minutes of a machine whose speed
drifts. Writes bench/results/decode.json and bench/results/decode.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn.cache import cache_bytes_per_token
from jaxattn.config import ModelConfig
from jaxattn.decoding import generate, generate_without_cache
from jaxattn.model import DecoderLM, count_params

RESULTS = Path(__file__).resolve().parent / "results"
PROMPT_LEN = 16
MODELS = {"baby": dict(num_layers=4, num_heads=4, d_model=128), "small": dict(num_layers=6, num_heads=6, d_model=384)}
KINDS = {
    "MHA": lambda m: dict(),
    "GQA kv=2": lambda m: dict(num_kv_heads=2),
    "MQA": lambda m: dict(num_kv_heads=1),
    "MLA": lambda m: dict(attention="mla", positions="rope", kv_lora_rank=m["d_model"] // 4,
                          qk_nope_head_dim=m["d_model"] // m["num_heads"] // 2 * 2,
                          qk_rope_head_dim=16, v_head_dim=m["d_model"] // m["num_heads"]),
}
# Figures of /work/shared/perf/README.md (HF generate, KV cache, greedy, prompt 16, 256 new tokens).
HF_QUOTED = {("baby", 1): 499, ("baby", 8): 3021, ("small", 1): 167, ("small", 8): 598}


def make_config(model: str, kind: str) -> ModelConfig:
    shape = MODELS[model]
    return ModelConfig(vocab_size=65, max_seq_len=1024, **shape, **KINDS[kind](shape))


def time_generation(fn, params, config, batch, new_tokens, repeats) -> dict:
    prompt = np.asarray(jax.random.randint(jax.random.PRNGKey(0), (batch, PROMPT_LEN), 1, 65), np.int32)
    lengths = np.full((batch,), PROMPT_LEN, np.int32)
    call = lambda: fn(params, config, prompt, lengths, max_new_tokens=new_tokens,  # noqa: E731
                      rng=jax.random.PRNGKey(0), temperature=0.0).tokens.block_until_ready()
    start = time.perf_counter()
    call()
    first = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    return dict(seconds=seconds, tokens_per_s=batch * new_tokens / seconds, compile_s=max(first - seconds, 0.0),
                runs=times)


def run_hf(hf_python: str, cases: list[tuple[str, int, int]], threads: int, repeats: int) -> dict:
    spec = ",".join(f"{m}:{b}:{n}" for m, b, n in cases)
    out = subprocess.run([hf_python, str(Path(__file__).with_name("hf_decode.py")), "--cases", spec,
                          "--threads", str(threads), "--repeats", str(repeats)],
                         check=True, capture_output=True, text=True).stdout
    data = json.loads(out.strip().splitlines()[-1])
    return {(r["model"], r["batch"], r["new_tokens"]): r["tokens_per_s"] for r in data["results"]}, data["torch"]


def measure_row(model, kind, config, params, batch, new, hf_tokens_per_s, repeats) -> dict:
    """One table row: our cached (and for one case recomputed) decoding, and the ratio to HF."""
    row = dict(model=model, kind=kind, params=count_params(params), batch=batch, new_tokens=new,
               cache_bytes_per_token=cache_bytes_per_token(config)["bytes"],
               cached=time_generation(generate, params, config, batch, new, repeats))
    if kind == "MHA" and batch == 1 and new == 256:  # recompute is O(L) per step: one point
        row["recompute"] = time_generation(generate_without_cache, params, config, batch, new, repeats)
    row["hf_tokens_per_s"] = hf_tokens_per_s or HF_QUOTED.get((model, batch))
    row["vs_hf"] = row["cached"]["tokens_per_s"] / row["hf_tokens_per_s"]
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hf-python", help="interpreter with torch + transformers (else quote README figures)")
    parser.add_argument("--hf-threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", default="baby,small")
    parser.add_argument("--kinds", default=",".join(KINDS), help="comma-separated subset of " + ",".join(KINDS))
    parser.add_argument("--lengths", default="256,1000")
    parser.add_argument("--small-kinds", default=None, help="kinds for the 10.7M model (default: --kinds)")
    args = parser.parse_args()
    models = args.models.split(",")
    lengths = [int(n) for n in args.lengths.split(",")]
    rows = []
    hf_source = "quoted from /work/shared/perf/README.md (256 new tokens, not measured in this run)"
    torch_version = None
    for model in models:
        kinds = ((args.small_kinds or args.kinds) if model == "small" else args.kinds).split(",")
        configs = {kind: make_config(model, kind) for kind in kinds}
        params = {kind: jax.jit(DecoderLM(c).init)(jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32))["params"]
                  for kind, c in configs.items()}
        for batch in (1, 8):
            for new in lengths:
                # HF right next to ours for the same case: the VM's speed drifts over minutes.
                hf = None
                if args.hf_python:
                    measured, torch_version = run_hf(args.hf_python, [(model, batch, new)], args.hf_threads,
                                                     args.repeats)
                    hf = measured[(model, batch, new)]
                for kind in kinds:
                    rows.append(measure_row(model, kind, configs[kind], params[kind], batch, new, hf, args.repeats))
    if torch_version:
        hf_source = (f"measured in this run, each case right before ours: torch {torch_version}, "
                     f"{args.hf_threads} thread(s), GPT-2 shape (MHA)")
    write(rows, hf_source, args)


def write(rows, hf_source, args) -> None:
    RESULTS.mkdir(exist_ok=True)
    meta = dict(jax=jax.__version__, machine=platform.machine(), cpus=os.cpu_count(), prompt_len=PROMPT_LEN,
                repeats=args.repeats, hf_source=hf_source, xla_flags=os.environ.get("XLA_FLAGS", ""))
    (RESULTS / "decode.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=2))
    lines = [f"Decode throughput (greedy, prompt {PROMPT_LEN}, median of {args.repeats}; jax {jax.__version__}, "
             f"{os.cpu_count()} CPUs). HF: {hf_source}.", "",
             "| model | attention | batch | new tokens | cached tok/s | recompute tok/s | HF tok/s | cached / HF "
             "| compile s | cache bytes/token |", "|" + " --- |" * 10]
    for r in rows:
        recompute = f"{r['recompute']['tokens_per_s']:,.0f}" if "recompute" in r else ""
        lines.append(f"| {r['model']} ({r['params'] / 1e6:.2f}M) | {r['kind']} | {r['batch']} | {r['new_tokens']} "
                     f"| {r['cached']['tokens_per_s']:,.0f} | {recompute} | {r['hf_tokens_per_s']:,.0f} "
                     f"| {r['vs_hf']:.1f}x | {r['cached']['compile_s']:.1f} | {r['cache_bytes_per_token']:,} |")
    (RESULTS / "decode.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
