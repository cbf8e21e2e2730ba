"""Decode tokens/s: KV-cached `generate` vs full recomputation vs Hugging Face, per attention kind.

    PYTHONPATH=$PWD python bench/decode.py [--hf-python /path/to/python-with-torch-and-transformers] [--models baby,small --kinds MHA,GQA\ kv=2,MQA,MLA --lengths 256,1000]

Random-init models (speed does not depend on the weights), greedy, prompt of
16 tokens, batch 1 and 8, 256 and 1000 new tokens. Medians of --repeats runs;
compile time (first call minus a steady call) reported separately. Models:
"baby" (4 layers, 4 heads, d 128, vocab 65, 0.8M params) and "small" (6 layers,
6 heads, d 384, vocab 65, 10.7M params), both with max_seq_len 1024 so that
1000 new tokens fit (the trained 10.7M model has block 256). With --hf-python,
Hugging Face's `generate` runs each (model, batch, length) case right before
ours, so that both are timed in the same minutes of a machine whose speed
drifts. Our side runs with the kernels "auto" resolves to on this machine
(`jaxattn.resolve_kernels`, recorded with the results). Writes
bench/results/decode.json and bench/results/decode.md.

    PYTHONPATH=$PWD python bench/decode.py --cache-sweep [--repeats 7 --batch 1]

instead measures what one decode step costs against the cache's length and its
allocation (`sweep_cache_lengths`): the baby model of configs/shakespeare_char_baby.toml
(RoPE, max_seq_len raised to 8192) steps through the last --sweep-steps tokens up to
each cache length, in a cache of max_len 8192 and, for 256, one of max_len 256, for
each decode kernel in turns. Writes bench/results/decode_cache_sweep.json and .md.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.machine import describe_machine  # noqa: E402
from jaxattn.cache import cache_bytes_per_token, init_cache  # noqa: E402
from jaxattn.config import MLAConfig, ModelConfig  # noqa: E402
from jaxattn.decoding import generate, generate_without_cache  # noqa: E402
from jaxattn.kernels import Kernels, resolve_kernels  # noqa: E402
from jaxattn.model import DecoderLM, count_params  # noqa: E402
from train.config import load_config  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PROMPT_LEN = 16
MODELS = {"baby": dict(num_layers=4, num_heads=4, d_model=128), "small": dict(num_layers=6, num_heads=6, d_model=384)}
KINDS = {
    "MHA": lambda m: dict(),
    "GQA kv=2": lambda m: dict(num_kv_heads=2),
    "MQA": lambda m: dict(num_kv_heads=1),
    "MLA": lambda m: dict(positions="rope", mla=MLAConfig(
        kv_lora_rank=m["d_model"] // 4, qk_nope_head_dim=m["d_model"] // m["num_heads"] // 2 * 2,
        qk_rope_head_dim=16, v_head_dim=m["d_model"] // m["num_heads"])),
}
# The peers' figures for this CPU type (HF generate, KV cache, greedy, prompt 16, 256 new tokens),
# measured outside this repository: quoted when --hf-python is not given.
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


def measure_row(model, kind, config, params, kernels, batch, new, hf_tokens_per_s, repeats) -> dict:
    """One table row: our cached (and for one case recomputed) decoding, and the ratio to HF."""
    cached, recomputed = (functools.partial(fn, kernels=kernels) for fn in (generate, generate_without_cache))
    row = dict(model=model, kind=kind, params=count_params(params), batch=batch, new_tokens=new,
               cache_bytes_per_token=cache_bytes_per_token(config)["bytes"],
               cached=time_generation(cached, params, config, batch, new, repeats))
    if kind == "MHA" and batch == 1 and new == 256:  # recompute is O(L) per step: one point
        row["recompute"] = time_generation(recomputed, params, config, batch, new, repeats)
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
    parser.add_argument("--cache-sweep", action="store_true", help="decode step cost against cache length instead")
    parser.add_argument("--batch", type=int, default=1, help="batch of --cache-sweep")
    parser.add_argument("--sweep-steps", type=int, default=64, help="decode steps per timed call of --cache-sweep")
    args = parser.parse_args()
    if args.cache_sweep:
        return sweep_cache_lengths(args)
    models = args.models.split(",")
    lengths = [int(n) for n in args.lengths.split(",")]
    rows = []
    hf_source = "quoted, not measured in this run: the peers' figures for this CPU type (256 new tokens)"
    torch_version = None
    kernels, reasons = resolve_kernels()
    print(f"kernels: {kernels} ({reasons['decode']}; {reasons['matmul']})", flush=True)
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
                    rows.append(measure_row(model, kind, configs[kind], params[kind], kernels, batch, new, hf,
                                            args.repeats))
    if torch_version:
        hf_source = (f"measured in this run, each case right before ours: torch {torch_version}, "
                     f"{args.hf_threads} thread(s), GPT-2 shape (MHA)")
    write(rows, hf_source, kernels, args)


def write(rows, hf_source, kernels, args) -> None:
    RESULTS.mkdir(exist_ok=True)
    machine = describe_machine()
    meta = dict(machine=machine, prompt_len=PROMPT_LEN, repeats=args.repeats, hf_source=hf_source,
                kernels=kernels.to_dict())
    (RESULTS / "decode.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=2))
    lines = [f"Decode throughput (greedy, prompt {PROMPT_LEN}, median of {args.repeats}) on {machine['cpu']} "
             f"({machine['platform']}, {machine['cpus']} CPUs), jax {machine['jax']}, decode kernels "
             f"{kernels.decode!r}, matmul {kernels.matmul!r}. HF: {hf_source}.", "",
             "| model | attention | batch | new tokens | cached tok/s | recompute tok/s | HF tok/s | cached / HF "
             "| compile s | cache bytes/token |", "|" + " --- |" * 10]
    for r in rows:
        recompute = f"{r['recompute']['tokens_per_s']:,.0f}" if "recompute" in r else ""
        lines.append(f"| {r['model']} ({r['params'] / 1e6:.2f}M) | {r['kind']} | {r['batch']} | {r['new_tokens']} "
                     f"| {r['cached']['tokens_per_s']:,.0f} | {recompute} | {r['hf_tokens_per_s']:,.0f} "
                     f"| {r['vs_hf']:.1f}x | {r['cached']['compile_s']:.1f} | {r['cache_bytes_per_token']:,} |")
    (RESULTS / "decode.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


# ---------------------------------------------------------------- --cache-sweep

SWEEP_LENGTHS = (256, 1024, 2048, 4096, 8192)
SWEEP_KERNELS = ("xla", "xla_cpu", "blocked")


@functools.partial(jax.jit, static_argnames=("config", "kernels", "steps"), donate_argnums=(1,))
def _decode_steps(params, cache, token, *, config, kernels, steps):
    """`steps` greedy one-token `extend` steps; returns the cache (donated: written in place, never copied)."""
    model = DecoderLM(config, kernels)

    def step(carry, _):
        cache, token = carry
        logits, cache = model.apply({"params": params}, token[:, None], cache, method=DecoderLM.extend)
        token = jnp.argmax(logits[:, 0], -1).astype(jnp.int32)
        return (cache, token), token
    (cache, _), tokens = jax.lax.scan(step, (cache, token), None, length=steps)
    return cache, tokens


def _full_cache(config, batch, max_len):
    """A cache of max_len slots holding random finite keys and values in every slot (speed ignores the values)."""
    cache = init_cache(config, batch, max_len)
    keys = jax.random.split(jax.random.PRNGKey(1), len(cache.layers))
    layers = tuple(type(layer)(k=jax.random.normal(key, layer.k.shape), v=jax.random.normal(key, layer.v.shape))
                   for layer, key in zip(cache.layers, keys))
    return cache.replace(layers=layers)


def _sweep_cases(args):
    """(kernel, max_len, cache length): every length in 8192 slots, and 256 in 256 slots right after
    256 in 8192 (the ratio the issue asks about, timed seconds apart on a machine whose speed drifts)."""
    return [(name, max_len, length) for name in SWEEP_KERNELS
            for max_len, length in ((8192, 256), (256, 256), *((8192, n) for n in SWEEP_LENGTHS[1:]))]


def sweep_cache_lengths(args) -> None:
    """Decode tokens/s per (kernel, max_len, cache length): steps from length - steps to length, in turns."""
    config = load_config("shakespeare_char_baby").model.replace(max_seq_len=8192)  # RoPE: no position table
    params = jax.jit(DecoderLM(config).init)(jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32))["params"]
    caches = {max_len: _full_cache(config, args.batch, max_len) for max_len in (8192, 256)}
    token = jnp.ones((args.batch,), jnp.int32)
    runs = {case: [] for case in _sweep_cases(args)}
    for round_ in range(args.repeats + 1):  # round 0 compiles
        for name, max_len, length in runs:
            start = caches[max_len].replace(lengths=jnp.full((args.batch,), length - args.sweep_steps, jnp.int32))
            begin = time.perf_counter()
            cache, tokens = _decode_steps(params, start, token, config=config, kernels=Kernels(decode=name),
                                          steps=args.sweep_steps)
            tokens.block_until_ready()
            caches[max_len] = cache  # the donated buffers come back
            if round_:
                runs[(name, max_len, length)].append(time.perf_counter() - begin)
    rows = [dict(kernel=name, max_len=max_len, cache_length=length, runs=times,
                 tokens_per_s=args.batch * args.sweep_steps / statistics.median(times))
            for (name, max_len, length), times in runs.items()]
    write_sweep(rows, args)


def write_sweep(rows, args) -> None:
    machine = describe_machine()
    RESULTS.mkdir(exist_ok=True)
    meta = dict(machine=machine, batch=args.batch, steps=args.sweep_steps, repeats=args.repeats,
                model="configs/shakespeare_char_baby.toml, max_seq_len 8192")
    (RESULTS / "decode_cache_sweep.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=2))
    tps = {(r["kernel"], r["max_len"], r["cache_length"]): r["tokens_per_s"] for r in rows}
    lines = [f"Decode tokens/s against cache length (baby model, RoPE, batch {args.batch}, greedy steps from "
             f"length - {args.sweep_steps} to length, median of {args.repeats} calls, kernels in turns) on "
             f"{machine['cpu']} ({machine['platform']}, {machine['cpus']} CPUs), jax {machine['jax']}.", "",
             "| cache length | max_len | " + " | ".join(SWEEP_KERNELS) + " |",
             "|" + " ---: |" * (2 + len(SWEEP_KERNELS))]
    for max_len, length in sorted({(m, n) for _, m, n in tps}, key=lambda c: (-c[0], c[1])):
        lines.append(f"| {length:,} | {max_len:,} | "
                     + " | ".join(f"{tps[(k, max_len, length)]:,.0f}" for k in SWEEP_KERNELS) + " |")
    (RESULTS / "decode_cache_sweep.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
