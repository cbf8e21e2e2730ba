"""Decode tokens/s: KV-cached `generate` vs full recomputation vs Hugging Face, per attention kind.

    PYTHONPATH=$PWD python bench/decode.py [--hf-python PYTHON] [--hf-threads N] [--models baby,small]
        [--kinds 'MHA,GQA kv=2,MQA,MLA'] [--lengths 256,1000] [--repeats 3]

Random-init models (speed does not depend on the weights), greedy, prompt of 16 tokens, batch 1 and
8, 256 and 1000 new tokens (`--lengths 256`: the short run). Medians of --repeats runs, the
attention kinds of a case timed in turns; compile time (first call minus a steady call) reported
separately. Models: "baby" (4 layers, 4 heads, d 128, vocab 65, 0.8M params) and "small" (6 layers,
6 heads, d 384, vocab 65, 10.7M params), both with max_seq_len 1024 so that 1000 new tokens fit (the
trained 10.7M model has block 256). Hugging Face's `generate` (GPT-2 shape, KV cache) runs each
(model, batch, length) case in a fresh process of --hf-python (default: this interpreter, where it
has torch and transformers; else the peers' quoted figures) right before ours, so that both are
timed in the same minutes of a machine whose speed drifts, with as many torch threads as the cores
JAX uses (--hf-threads; both counts are recorded, with the 1-minute load average of each case). On a
machine shared with other jobs, torch's idle threads spin on the cores their partners need:
OMP_WAIT_POLICY=PASSIVE, where set, is passed on to it. Our side runs with the kernels "auto"
resolves to on the machine it runs on (`jaxattn.resolve_kernels`, recorded with the results). Writes
bench/results/decode.json and bench/results/decode.md.

    PYTHONPATH=$PWD python bench/decode.py --cache-sweep [--repeats 7 --batch 1]

instead measures what one decode step costs against the cache's length and its
allocation (`sweep_cache_lengths`): the baby model of configs/shakespeare_char_baby.toml
(RoPE, max_seq_len raised to 8192) steps through the last --sweep-steps tokens up to
each cache length, in a cache of max_len 8192 and, for 256, one of max_len 256, for
each decode kernel in turns. Writes bench/results/decode_cache_sweep.json and .md (with --batch N
above 1: decode_cache_sweep_bN.json and .md).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench import fresh  # noqa: E402
from bench.machine import cpu_cores, describe_machine, load_average, machine_line, write_results  # noqa: E402
from bench.timing import Timing, in_turns  # noqa: E402
from jaxattn.cache.build import cache_bytes_per_token, init_cache  # noqa: E402
from jaxattn.config import MLAConfig, ModelConfig  # noqa: E402
from jaxattn.decoding import generate, generate_without_cache  # noqa: E402
from jaxattn.kernels import Kernels, resolve_kernels  # noqa: E402
from jaxattn.model import DecoderLM, count_params  # noqa: E402
from train.config import load_config  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
HF_SCRIPT = Path(__file__).with_name("hf_decode.py")
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
# measured outside this repository: quoted when no interpreter with torch and transformers is given.
HF_QUOTED = {("baby", 1): 499, ("baby", 8): 3021, ("small", 1): 167, ("small", 8): 598}


def make_config(model: str, kind: str) -> ModelConfig:
    shape = MODELS[model]
    return ModelConfig(vocab_size=65, max_seq_len=1024, **shape, **KINDS[kind](shape))


def generation(fn, params, config, batch: int, new_tokens: int):
    """A zero-argument call: greedy `fn` (generate or generate_without_cache) from a fixed prompt; its tokens."""
    prompt = np.asarray(jax.random.randint(jax.random.PRNGKey(0), (batch, PROMPT_LEN), 1, 65), np.int32)
    lengths = np.full((batch,), PROMPT_LEN, np.int32)
    return lambda: fn(params, config, prompt, lengths, max_new_tokens=new_tokens, rng=jax.random.PRNGKey(0),
                      temperature=0.0).tokens


def speed(timing: Timing, tokens: int) -> dict:
    return dict(seconds=timing.median_s, tokens_per_s=tokens / timing.median_s, compile_s=timing.compile_s,
                runs=timing.times_s)


def run_hf(hf_python: str, case: tuple[str, int, int], threads: int, repeats: int) -> tuple[float, str]:
    """Hugging Face's tokens/s for one (model, batch, new tokens) case, in a fresh process; torch's version."""
    model, batch, new = case
    data = fresh.run([hf_python, HF_SCRIPT, "--cases", f"{model}:{batch}:{new}", "--threads", str(threads),
                      "--repeats", str(repeats)], what="Hugging Face's generate",
                     env=fresh.environment(threads)).json()
    return data["results"][0]["tokens_per_s"], data["torch"]


def measure_case(model, kinds, configs, params, kernels, batch, new, hf_tokens_per_s, repeats) -> list[dict]:
    """One row per attention kind: cached (and for one case recomputed) decoding, every kind in turns."""
    cached, recomputed = (functools.partial(fn, kernels=kernels) for fn in (generate, generate_without_cache))
    calls = {(kind, "cached"): generation(cached, params[kind], configs[kind], batch, new) for kind in kinds}
    if "MHA" in kinds and batch == 1 and new == 256:  # recompute is O(L) per step: one point
        calls[("MHA", "recompute")] = generation(recomputed, params["MHA"], configs["MHA"], batch, new)
    load = load_average()
    timings = in_turns(calls, repeats)
    rows = []
    for kind in kinds:
        row = dict(model=model, kind=kind, params=count_params(params[kind]), batch=batch, new_tokens=new,
                   cache_bytes_per_token=cache_bytes_per_token(configs[kind])["bytes"], load_average=load,
                   cached=speed(timings[(kind, "cached")], batch * new))
        if (kind, "recompute") in timings:
            row["recompute"] = speed(timings[(kind, "recompute")], batch * new)
        row["hf_tokens_per_s"] = hf_tokens_per_s or HF_QUOTED.get((model, batch))
        row["vs_hf"] = row["cached"]["tokens_per_s"] / row["hf_tokens_per_s"]
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def has_hf() -> bool:
    """Whether this interpreter can run bench/hf_decode.py (torch and transformers)."""
    return all(importlib.util.find_spec(name) is not None for name in ("torch", "transformers"))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf-python", default=sys.executable if has_hf() else None,
                        help="interpreter with torch + transformers (default: this one where it has them; "
                             "without one, the peers' quoted figures)")
    parser.add_argument("--hf-threads", type=int, default=cpu_cores(),
                        help="torch threads of Hugging Face's side (default: the cores JAX uses, %(default)s)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", default="baby,small")
    parser.add_argument("--kinds", default=",".join(KINDS), help="comma-separated subset of " + ",".join(KINDS))
    parser.add_argument("--lengths", default="256,1000", help="new tokens per case (256: the short run)")
    parser.add_argument("--small-kinds", default=None, help="kinds for the 10.7M model (default: --kinds)")
    parser.add_argument("--cache-sweep", action="store_true", help="decode step cost against cache length instead")
    parser.add_argument("--batch", type=int, default=1, help="batch of --cache-sweep")
    parser.add_argument("--sweep-steps", type=int, default=64, help="decode steps per timed call of --cache-sweep")
    args = parser.parse_args(argv)
    for name in ("hf_threads", "repeats", "batch", "sweep_steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.cache_sweep:
        return sweep_cache_lengths(args)
    lengths = [int(n) for n in args.lengths.split(",")]
    rows, torch_version = [], None
    kernels, reasons = resolve_kernels()
    print(f"kernels: {kernels} ({reasons['decode']}; {reasons['matmul']})", flush=True)
    for model in args.models.split(","):
        kinds = ((args.small_kinds or args.kinds) if model == "small" else args.kinds).split(",")
        configs = {kind: make_config(model, kind) for kind in kinds}
        params = {kind: jax.jit(DecoderLM(c).init)(jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32))["params"]
                  for kind, c in configs.items()}
        for batch in (1, 8):
            for new in lengths:
                hf = None  # HF right before ours for the same case: the machine's speed drifts over minutes
                if args.hf_python:
                    hf, torch_version = run_hf(args.hf_python, (model, batch, new), args.hf_threads, args.repeats)
                rows += measure_case(model, kinds, configs, params, kernels, batch, new, hf, args.repeats)
    hf_source = "quoted, not measured in this run: the peers' figures for this CPU type (256 new tokens)"
    if torch_version:
        policy = os.environ.get("OMP_WAIT_POLICY")
        hf_source = (f"measured in this run, each case right before ours: torch {torch_version}, "
                     f"{args.hf_threads} thread(s){f' (OMP_WAIT_POLICY={policy})' if policy else ''}, "
                     "GPT-2 shape (MHA)")
    write(rows, hf_source, kernels, args, measured=torch_version is not None)


def load_note(rows, cores: int) -> str:
    """" (1-minute load average L1-L2, ...)" where it was read: above `cores`, other jobs shared the cores."""
    loads = [r["load_average"] for r in rows if r.get("load_average") is not None]
    if not loads:
        return ""
    shared = ": other jobs shared the cores, both sides alike" if max(loads) > cores else ""
    return f" (1-minute load average {min(loads):.1f}-{max(loads):.1f} during the run{shared})"


def write(rows, hf_source, kernels, args, measured: bool) -> None:
    machine = describe_machine()
    # the wait policy of torch's idle threads: None is torch's default (`bench.fresh.THREAD_VARIABLES`)
    threads = {"ours": machine["cores"], "hf": args.hf_threads if measured else None,
               "hf_omp_wait_policy": os.environ.get("OMP_WAIT_POLICY") if measured else None}
    meta = dict(machine=machine, prompt_len=PROMPT_LEN, repeats=args.repeats, hf_source=hf_source,
                kernels=kernels.to_dict(), threads=threads,
                hf_python=None if not measured else "this interpreter" if args.hf_python == sys.executable
                else Path(args.hf_python).name)  # no machine path in the results
    lines = [f"Decode throughput (greedy, prompt {PROMPT_LEN}, median of {args.repeats}, attention kinds in turns) "
             f"on {machine_line(machine)}, decode kernels {kernels.decode!r}, matmul {kernels.matmul!r}, "
             f"ours on {threads['ours']} core(s){load_note(rows, threads['ours'])}. HF: {hf_source}.", "",
             "| model | attention | batch | new tokens | cached tok/s | recompute tok/s | HF tok/s | cached / HF "
             "| compile s | cache bytes/token |", "|" + " --- |" * 10]
    for r in rows:
        recompute = f"{r['recompute']['tokens_per_s']:,.0f}" if "recompute" in r else ""
        lines.append(f"| {r['model']} ({r['params'] / 1e6:.2f}M) | {r['kind']} | {r['batch']} | {r['new_tokens']} "
                     f"| {r['cached']['tokens_per_s']:,.0f} | {recompute} | {r['hf_tokens_per_s']:,.0f} "
                     f"| {r['vs_hf']:.1f}x | {r['cached']['compile_s']:.1f} | {r['cache_bytes_per_token']:,} |")
    write_results(RESULTS, "decode", dict(meta=meta, rows=rows), "\n".join(lines) + "\n")


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


def _sweep_cases():
    """(kernel, max_len, cache length): every length in 8192 slots, and 256 in 256 slots right beside
    256 in 8192 (the ratio of the two allocations, timed seconds apart on a machine whose speed drifts)."""
    return [(name, max_len, length) for name in SWEEP_KERNELS
            for max_len, length in ((8192, 256), (256, 256), *((8192, n) for n in SWEEP_LENGTHS[1:]))]


def sweep_cache_lengths(args) -> None:
    """Decode tokens/s per (kernel, max_len, cache length): steps from length - steps to length, in turns."""
    config = load_config("shakespeare_char_baby").model.replace(max_seq_len=8192)  # RoPE: no position table
    params = jax.jit(DecoderLM(config).init)(jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32))["params"]
    caches = {max_len: _full_cache(config, args.batch, max_len) for max_len in (8192, 256)}
    token = jnp.ones((args.batch,), jnp.int32)

    def steps(name, max_len, length):
        def call():
            start = caches[max_len].replace(lengths=jnp.full((args.batch,), length - args.sweep_steps, jnp.int32))
            caches[max_len], tokens = _decode_steps(params, start, token, config=config,
                                                    kernels=Kernels(decode=name), steps=args.sweep_steps)
            return tokens  # the donated cache comes back for the next call
        return call
    timings = in_turns({case: steps(*case) for case in _sweep_cases()}, args.repeats)
    rows = [dict(kernel=name, max_len=max_len, cache_length=length, runs=timing.times_s,
                 tokens_per_s=args.batch * args.sweep_steps / timing.median_s)
            for (name, max_len, length), timing in timings.items()]
    write_sweep(rows, args)


def write_sweep(rows, args) -> None:
    machine = describe_machine()
    meta = dict(machine=machine, batch=args.batch, steps=args.sweep_steps, repeats=args.repeats,
                model="configs/shakespeare_char_baby.toml, max_seq_len 8192")
    tps = {(r["kernel"], r["max_len"], r["cache_length"]): r["tokens_per_s"] for r in rows}
    lines = [f"Decode tokens/s against cache length (baby model, RoPE, batch {args.batch}, greedy steps from "
             f"length - {args.sweep_steps} to length, median of {args.repeats} calls, kernels in turns) on "
             f"{machine_line(machine)}.", "",
             "| cache length | max_len | " + " | ".join(SWEEP_KERNELS) + " |",
             "|" + " ---: |" * (2 + len(SWEEP_KERNELS))]
    for max_len, length in sorted({(m, n) for _, m, n in tps}, key=lambda c: (-c[0], c[1])):
        lines.append(f"| {length:,} | {max_len:,} | "
                     + " | ".join(f"{tps[(k, max_len, length)]:,.0f}" for k in SWEEP_KERNELS) + " |")
    name = "decode_cache_sweep" if args.batch == 1 else f"decode_cache_sweep_b{args.batch}"
    write_results(RESULTS, name, dict(meta=meta, rows=rows), "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
