"""Attention time and peak memory against sequence length: each kernel, jax.nn and PyTorch, in one run.

    PYTHONPATH=$PWD python bench/attention.py [--torch-python /path/to/python-with-torch] [--torch-threads N]
        [--lengths 256,512,1024,2048,4096,16384,32768] [--reps 5] [--dense-limit-gib 12]

B=1, N=8 query heads, H=64, float32, T = S; MHA (K=8) at every length and GQA (K=2) from 1024 to
16384; causal and not; forward, and forward+backward (the gradient of the output's sum with respect
to q, k and v). Implementations: `jax.nn.dot_product_attention` (its default), jaxattn's dense "xla"
and "custom_vjp", blockwise "chunked", "auto" (`scaled_dot_product_attention`'s default: what the
machine's rule picks per call) and, with --torch-python,
`torch.nn.functional.scaled_dot_product_attention` (its CPU flash kernel) run by that interpreter
with --torch-threads threads (default: as many as the cores JAX uses). Per case, the JAX
implementations are compiled in one process and timed in turns (alternating order), each with the
memory XLA plans for its program (`memory_analysis()`: temporaries, arguments and outputs); torch
runs in its own process, right before or after. From 16384 keys each JAX implementation runs alone
in its process, so its peak RSS (the kernel's `ru_maxrss` of the process, Python and the runtime
included) is its own, as is torch's everywhere. Dense paths are skipped where their `[N, T, S]`
float32 arrays would pass --dense-limit-gib; from 16384 keys "chunked" is not run apart from "auto",
whose rule picks it there (the same program). Writes bench/results/attention.{json,md} and
docs/attention_benchmark.png.
Decode tokens/s against the cache length is `bench/decode.py --cache-sweep`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import fresh  # noqa: E402
from bench.machine import cpu_cores  # noqa: E402
from bench.timing import median_of, milliseconds_cell, ratio, time_call, time_compiled, times_cell  # noqa: E402

RESULTS = ROOT / "bench" / "results"
JAX_IMPLS = ("jax.nn", "xla", "custom_vjp", "chunked", "auto")
DENSE = ("jax.nn", "xla", "custom_vjp")
SAME_AS_AUTO_FROM = 16384  # from here "chunked" is timed once, as "auto" (minutes per run)
B, N, H = 1, 8, 64


# -- one measurement, in its own process ---------------------------------------------------------

def _jax_program(impl: str, K: int, causal: bool, passes: str):
    import jax
    import jax.numpy as jnp
    from jaxattn import scaled_dot_product_attention
    if impl == "jax.nn":
        attend = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
    else:
        attend = lambda q, k, v: scaled_dot_product_attention(q, k, v, is_causal=causal,  # noqa: E731
                                                              implementation=impl)
    if passes == "fwd+bwd":
        return jax.jit(jax.grad(lambda q, k, v: attend(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2)))
    return jax.jit(attend)


def measure_jax(spec: dict) -> dict:
    """Every implementation of `spec["impls"]` compiled, then timed in turns (alternating order)."""
    import jax
    T, K = spec["T"], spec["K"]
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (B, T, N, H))
    k, v = (jax.random.normal(key, (B, T, K, H)) for key in keys[1:])
    programs = {impl: (_jax_program(impl, K, spec["causal"], spec["pass"]), (q, k, v)) for impl in spec["impls"]}
    return time_compiled(programs, spec["reps"], warmup=spec["reps"] > 1)


def measure_torch(spec: dict) -> dict:
    import torch
    import torch.nn.functional as F
    T, K, causal = spec["T"], spec["K"], spec["causal"]
    torch.set_num_threads(spec["threads"])
    torch.manual_seed(0)
    q, k, v = torch.randn(B, N, T, H), torch.randn(B, K, T, H), torch.randn(B, K, T, H)
    gqa = dict(enable_gqa=True) if K != N else {}
    if spec["pass"] == "fwd":
        def run():
            with torch.no_grad():
                F.scaled_dot_product_attention(q, k, v, is_causal=causal, **gqa)
    else:
        for x in (q, k, v):
            x.requires_grad_(True)

        def run():
            F.scaled_dot_product_attention(q, k, v, is_causal=causal, **gqa).sum().backward()
    timing = time_call(run, spec["reps"], warmup=spec["reps"] > 1)
    return {"times_s": timing.times_s, "median_s": timing.median_s, "torch": torch.__version__,
            "threads": torch.get_num_threads()}


def worker(spec: dict) -> dict:
    """In the fresh process: `{impl: {"median_s", "times_s", ...}}` of `spec`'s implementations."""
    return {"torch": measure_torch(spec)} if spec["impls"] == ["torch"] else measure_jax(spec)


# -- the sweep ---------------------------------------------------------------------------------------

def reps_for(T: int, reps: int) -> int:
    """Fewer repetitions where one run takes seconds to minutes."""
    return reps if T <= 4096 else 1


def dense_gib(T: int, passes: str) -> float:
    """What a dense path holds at once: about 3 (forward) or 5 (with backward) `[N, T, S]` float32 arrays."""
    return (3 if passes == "fwd" else 5) * N * T * T * 4 / 2**30


def implementations(T: int, K: int, passes: str, args) -> tuple[list[str], dict[str, str]]:
    """What runs for a case, and why the others do not."""
    from jaxattn.kernels.auto import CHUNKED_FROM_KEYS
    run, skipped = [], {}
    for impl in JAX_IMPLS + (("torch",) if args.torch_python else ()):
        if impl in DENSE and dense_gib(T, passes) > args.dense_limit_gib:
            skipped[impl] = f"needs ~{dense_gib(T, passes):.0f} GiB (--dense-limit-gib {args.dense_limit_gib})"
        elif impl == "chunked" and T >= SAME_AS_AUTO_FROM and T >= CHUNKED_FROM_KEYS:
            skipped[impl] = "auto runs this program here"
        else:
            run.append(impl)
    return run, skipped


def measure(spec: dict, args) -> dict:
    """`spec`'s implementations in a fresh process (torch's under --torch-python, with --torch-threads);
    the process's peak RSS goes to its implementation where it ran only one."""
    torch = spec["impls"] == ["torch"]
    argv = fresh.function_argv("bench.attention:worker", dict(spec, threads=args.torch_threads),
                               args.torch_python if torch else None)
    try:
        done = fresh.run(argv, what=f"{'/'.join(spec['impls'])} at T={spec['T']}", timeout=args.timeout,
                         env=fresh.environment(args.torch_threads if torch else None))
    except fresh.FreshProcessError as error:
        return {impl: {"error": str(error)} for impl in spec["impls"]}
    results = done.json()
    if len(results) == 1:
        next(iter(results.values()))["peak_rss_bytes"] = done.peak_rss_bytes
    return results


def cases(lengths: list[int]):
    for T in lengths:
        for label, K in (("MHA", 8), ("GQA K=2", 2)):
            if K == 2 and not 1024 <= T <= 16384:
                continue
            for causal in (False, True):
                for passes in ("fwd", "fwd+bwd"):
                    yield {"T": T, "K": K, "heads": label, "causal": causal, "pass": passes}


def sweep(args) -> list[dict]:
    rows = []
    for i, case in enumerate(cases(args.lengths)):
        impls, skipped = implementations(case["T"], case["K"], case["pass"], args)
        row = dict(case, results={}, skipped=skipped)
        jax_impls, other = [i for i in impls if i != "torch"], [["torch"]] if "torch" in impls else []
        groups = [jax_impls] if case["T"] < SAME_AS_AUTO_FROM else [[i] for i in jax_impls]  # RSS of each
        for group in (groups + other) if i % 2 == 0 else (other + groups):
            row["results"].update(measure(dict(case, impls=group, reps=reps_for(case["T"], args.reps)), args))
        print(f"T={case['T']} {case['heads']} causal={case['causal']} {case['pass']}: " + ", ".join(
            f"{impl} {r.get('median_s', r.get('error'))}" for impl, r in row["results"].items()), flush=True)
        rows.append(row)
    return rows


# -- the report ---------------------------------------------------------------------------------------

def _gib(result: dict, field: str) -> str:
    return f"{result[field] / 2**30:.3f}" if field in result else "–"


def table(rows, impls) -> list[str]:
    lines = ["| heads | T=S | causal | pass | " + " | ".join(impls) + " | auto picks | jax.nn / auto | "
             "auto / torch | auto XLA GiB | jax.nn XLA GiB | auto RSS GiB | torch RSS GiB |",
             "| --- | ---: | --- | --- |" + " ---: |" * len(impls) + " --- |" + " ---: |" * 6]
    for row in rows:
        auto, results = median_of(row, "auto"), row["results"]
        lines.append(f"| {row['heads']} | {row['T']} | {'yes' if row['causal'] else 'no'} | {row['pass']} | "
                     + " | ".join(milliseconds_cell(row, i) for i in impls) + f" | {row.get('auto_picks', '')} | "
                     f"{times_cell(ratio(median_of(row, 'jax.nn'), auto))} | "
                     f"{times_cell(ratio(auto, median_of(row, 'torch')))} | "
                     f"{_gib(results.get('auto', {}), 'xla_bytes')} | {_gib(results.get('jax.nn', {}), 'xla_bytes')} | "
                     f"{_gib(results.get('auto', {}), 'peak_rss_bytes')} | "
                     f"{_gib(results.get('torch', {}), 'peak_rss_bytes')} |")
    return lines


def targets(rows, decode_sweep: Path) -> list[str]:
    long = [r for r in rows if r["T"] >= 1024]
    vs_jax = [x for r in long if (x := ratio(median_of(r, "jax.nn"), median_of(r, "auto")))]
    vs_torch = [x for r in long if (x := ratio(median_of(r, "auto"), median_of(r, "torch")))]
    rss = [r["results"]["auto"].get("peak_rss_bytes", 0) / 2**30 for r in rows
           if r["T"] == 32768 and r["pass"] == "fwd+bwd" and "auto" in r["results"]]
    at4k = {r["causal"]: median_of(r, "auto") for r in rows if r["T"] == 4096 and r["heads"] == "MHA"
            and r["pass"] == "fwd+bwd"}
    lines = ["| target | measured |", "| --- | --- |",
             f"| auto >= 2x faster than jax.nn, T >= 1024 | {min(vs_jax):.2f}x to {max(vs_jax):.2f}x |" if vs_jax
             else "| auto >= 2x faster than jax.nn | not measured |",
             f"| auto within 1.5x of torch, T >= 1024 | auto takes {min(vs_torch):.2f}x to {max(vs_torch):.2f}x "
             "torch's time |" if vs_torch else "| auto within 1.5x of torch | not measured (no --torch-python) |",
             f"| T=32k fwd+bwd peak RSS <= 4 GiB | {', '.join(f'{x:.2f}' for x in rss)} GiB |" if rss
             else "| T=32k fwd+bwd <= 4 GiB | not measured |"]
    if at4k.get(False) and at4k.get(True):
        lines.append(f"| causal >= 1.7x faster than non-causal at 4k (fwd+bwd, MHA) | {at4k[False] / at4k[True]:.2f}x |")
    if decode_sweep.exists():
        sweep = {(r["kernel"], r["max_len"], r["cache_length"]): r["tokens_per_s"]
                 for r in json.loads(decode_sweep.read_text())["rows"]}
        full, small = sweep.get(("blocked", 8192, 256)), max(v for (k, m, c), v in sweep.items() if m == c == 256)
        lines.append(f"| decode at cache 256 within 1.3x of a 256 cache (max_len 8192) | blocked {full:,.0f} vs "
                     f"best 256-cache {small:,.0f} tok/s: {small / full:.2f}x (bench/results/decode_cache_sweep.md) |")
    return lines


def plot(rows, impls, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    panels = [(False, "median_s", "fwd+bwd, not causal: seconds"), (True, "median_s", "fwd+bwd, causal: seconds"),
              (False, "memory", "fwd+bwd, not causal: GiB (XLA's plan; torch: RSS)")]
    for ax, (causal, field, title) in zip(axes, panels):
        chosen = [r for r in rows if r["heads"] == "MHA" and r["pass"] == "fwd+bwd" and r["causal"] == causal]
        for impl in impls:
            key = field if field != "memory" else "peak_rss_bytes" if impl == "torch" else "xla_bytes"
            points = [(r["T"], r["results"][impl][key]) for r in chosen if key in r["results"].get(impl, {})]
            if points:
                xs, ys = zip(*points)
                ys = [y / 2**30 for y in ys] if field == "memory" else ys
                ax.plot(xs, ys, marker="o", label=impl)
        ax.set(xscale="log", yscale="log", xlabel="T = S", title=title)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend()
    fig.suptitle("Attention, B=1 N=8 H=64 float32 (bench/attention.py)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_report(rows, args, argv) -> None:
    from bench.machine import describe_machine, machine_line, portable_command
    from jaxattn.kernels import auto
    from jaxattn.kernels._call import AttentionCall
    for row in rows:
        call = AttentionCall(T=row["T"], S=row["T"], N=N, K=row["K"], H=H, Hv=H, dtype="float32",
                             is_causal=row["causal"])
        row["auto_picks"] = auto.cpu_rule(call)[0]
    machine = describe_machine()
    torch_info = next((r["results"]["torch"] for r in rows if "torch" in r["results"]
                       and "torch" in r["results"]["torch"]), {})
    command = "PYTHONPATH=$PWD python " + portable_command(["bench/attention.py"] + argv[1:], ("--torch-python",))
    meta = {"machine": machine, "torch": torch_info.get("torch"), "torch_threads": torch_info.get("threads"),
            "threads": {"ours": machine["cores"], "torch": torch_info.get("threads")},
            "command": command, "B": B, "N": N, "H": H}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "attention.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    impls = list(JAX_IMPLS) + (["torch"] if args.torch_python else [])
    threads = f"JAX on {machine['cores']} cores" + (f", torch with {meta['torch_threads']} threads"
                                                    if meta["torch_threads"] else "")
    lines = [f"# Attention against sequence length on {machine_line(machine)}"
             + (f", torch {meta['torch']}" if meta["torch"] else ""),
             "", "Median milliseconds, B=1, N=8, H=64, float32 (bench/attention.py: per case the JAX "
             f"implementations in turns in one process, torch in its own; each alone from 16384; {threads}). "
             "XLA GiB: the memory XLA plans for the program; RSS: the process's peak, where it ran "
             "that one program. `–`: not run (dense arrays too large, or the same program as auto).", "",
             *table(rows, impls), "", "## Targets", "",
             *targets(rows, RESULTS / "decode_cache_sweep.json"), "", f"Made by: `{command}`", ""]
    (RESULTS / "attention.md").write_text("\n".join(lines))
    plot(rows, impls, ROOT / "docs" / "attention_benchmark.png")
    print("\n".join(lines))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--torch-python", help="a Python with torch, for PyTorch's SDPA column")
    parser.add_argument("--torch-threads", type=int, default=cpu_cores(),
                        help="torch's threads (default: the cores JAX uses, %(default)s)")
    parser.add_argument("--lengths", default="256,512,1024,2048,4096,16384,32768",
                        type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--reps", type=int, default=5, help="timed runs per case up to T=4096 (1 beyond)")
    parser.add_argument("--dense-limit-gib", type=float, default=12.0)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per measurement")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    rows = sweep(args)
    write_report(rows, args, sys.argv)


if __name__ == "__main__":
    main()
