"""MoE routed experts: forward+backward time of the dense reference and the grouped paths, against tokens and experts.

    PYTHONPATH=$PWD python bench/moe.py [--tokens 64,256,1024,4096] [--experts 4,8,16,32,64] [--reps 5]
        [--max-grouped-rows 262144] [--decode-tokens 1,8,32] [--report-only]

One `jaxattn.layers.moe.MoE` layer (router + routed experts, no shared expert), D=256, F=512,
float32, M tokens ([1, M, D]), k=2 experts per token at each E, and k=8 at E=64. Timed: the
gradient of a fixed projection of the output with respect to the input and every parameter
(forward and backward, one jitted program). Implementations (`jaxattn.kernels.moe`): "dense"
(the reference, every expert on every token), "grouped" (tokens sorted by expert,
`jax.lax.ragged_dot`) and "grouped_cpu" (the same grouping in tiles of rows, batched matmuls).
Per case, every implementation is compiled in one fresh process and timed in turns (alternating
order), with the memory XLA plans for its program. "grouped" is skipped where M*k*E passes
--max-grouped-rows: XLA:CPU lowers ragged_dot to a dense masked product over all M*k rows per
expert, minutes per run and gigabytes there. A second table times the forward pass alone at the
few tokens of a decoding step (--decode-tokens, batch rows of one new token each) for "dense",
"grouped_cpu" and "gathered" (each pair with its expert's weights gathered). Writes
bench/results/moe.{json,md}, with what the
rule of `auto_cpu` (`jaxattn.kernels.moe.cpu_rule`) picks in each case against the faster one;
--report-only writes them again from the JSON's measurements (after a change of the rule).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import fresh  # noqa: E402
from bench.timing import median_of, milliseconds_cell, ratio, time_compiled, times_cell  # noqa: E402

RESULTS = ROOT / "bench" / "results"
IMPLS = ("dense", "grouped", "grouped_cpu")
DECODE_IMPLS = ("dense", "grouped_cpu", "gathered")
D, F = 256, 512


# -- one case, in its own process ----------------------------------------------------------------

def _program(impl: str, M: int, E: int, k: int, forward_only: bool = False):
    import jax
    import jax.numpy as jnp
    from jaxattn import Kernels, ModelConfig
    from jaxattn.layers.moe import MoE, MoEConfig
    import flax.linen as nn
    module = MoE(ModelConfig(d_model=D, num_heads=4), MoEConfig(num_experts=E, experts_per_token=k, expert_hidden=F),
                 Kernels(moe=impl))
    x = jax.random.normal(jax.random.key(0), (1, M, D))
    shapes = nn.unbox(jax.eval_shape(module.init, jax.random.key(0), x))["params"]
    leaves, tree = jax.tree.flatten(shapes)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    params = jax.tree.unflatten(tree, [0.05 * jax.random.normal(key, s.shape) for key, s in zip(keys, leaves)])
    cotangent = jax.random.normal(jax.random.key(2), (1, M, D))

    def loss(params, x):
        y, _ = module.apply({"params": params}, x)
        return jnp.sum(y * cotangent)

    if forward_only:
        return jax.jit(lambda params, x: module.apply({"params": params}, x)[0]), (params, x)
    return jax.jit(jax.grad(loss, argnums=(0, 1))), (params, x)


def worker(spec: dict) -> dict:
    """In the fresh process: `{impl: {"median_s", "times_s", "compile_s", "xla_bytes"}}` for `spec`'s
    implementations, compiled, then timed in turns."""
    programs = {impl: _program(impl, spec["M"], spec["E"], spec["k"], spec.get("forward_only", False))
                for impl in spec["impls"]}
    return time_compiled(programs, spec["reps"])


# -- the sweep -------------------------------------------------------------------------------------

def cases(tokens: list[int], experts: list[int]):
    for M in tokens:
        for E in experts:
            yield {"M": M, "E": E, "k": 2}
        if 64 in experts:
            yield {"M": M, "E": 64, "k": 8}


def implementations(case: dict, args) -> tuple[list[str], dict[str, str]]:
    rows = case["M"] * case["k"] * case["E"]
    if rows > args.max_grouped_rows:
        return ["dense", "grouped_cpu"], {"grouped": f"M*k*E = {rows} > --max-grouped-rows {args.max_grouped_rows}"}
    return list(IMPLS), {}


def decode_sweep(args) -> list[dict]:
    """Forward passes over a few tokens (a decoding step's), every implementation in turns."""
    rows = []
    for M in args.decode_tokens:
        for E, k in [(E, 2) for E in args.experts if E >= 8] + ([(64, 8)] if 64 in args.experts else []):
            spec = {"M": M, "E": E, "k": k, "impls": list(DECODE_IMPLS), "reps": 4 * args.reps, "forward_only": True}
            results = measure(spec, args)
            rows.append(dict(M=M, E=E, k=k, results=results))
            print(f"decode M={M} E={E} k={k}: " + ", ".join(
                f"{impl} {r.get('median_s', r.get('error'))}" for impl, r in results.items()), flush=True)
    return rows


def reps_for(case: dict, reps: int) -> int:
    """Fewer repetitions where the dense reference takes seconds."""
    return reps if case["M"] * case["E"] <= 1024 * 64 else max(3, reps // 2)


def measure(spec: dict, args) -> dict:
    """`spec`'s implementations in a fresh process; an error record for each where it failed."""
    try:
        return fresh.call("bench.moe:worker", spec, timeout=args.timeout)
    except fresh.FreshProcessError as error:
        return {impl: {"error": str(error)} for impl in spec["impls"]}


def sweep(args) -> list[dict]:
    rows = []
    for case in cases(args.tokens, args.experts):
        impls, skipped = implementations(case, args)
        results = measure(dict(case, impls=impls, reps=reps_for(case, args.reps)), args)
        rows.append(dict(case, results=results, skipped=skipped))
        print(f"M={case['M']} E={case['E']} k={case['k']}: " + ", ".join(
            f"{impl} {r.get('median_s', r.get('error'))}" for impl, r in results.items()), flush=True)
    return rows


# -- the report -------------------------------------------------------------------------------------

def table(rows) -> list[str]:
    lines = ["| M tokens | E | k | " + " | ".join(f"{i} ms" for i in IMPLS) + " | dense / grouped_cpu | "
             "dense / grouped | auto_cpu picks | dense XLA GiB | grouped_cpu XLA GiB |",
             "| ---: | ---: | ---: |" + " ---: |" * len(IMPLS) + " ---: | ---: | --- | ---: | ---: |"]
    for row in rows:
        gib = lambda impl: (f"{row['results'][impl]['xla_bytes'] / 2**30:.3f}"  # noqa: E731
                            if "xla_bytes" in row["results"].get(impl, {}) else "–")
        dense = median_of(row, "dense")
        lines.append(f"| {row['M']} | {row['E']} | {row['k']} | "
                     + " | ".join(milliseconds_cell(row, i, ",.1f") for i in IMPLS)
                     + f" | {times_cell(ratio(dense, median_of(row, 'grouped_cpu')))}"
                     f" | {times_cell(ratio(dense, median_of(row, 'grouped')))} | {row['auto_picks']} | "
                     f"{gib('dense')} | {gib('grouped_cpu')} |")
    return lines


def rule_misses(rows) -> tuple[int, list[str]]:
    """How many cases `auto_cpu` picked the faster of dense and grouped_cpu in, and the others."""
    judged = [r for r in rows if median_of(r, "dense") and median_of(r, "grouped_cpu")]
    misses = [f"M={r['M']} E={r['E']} k={r['k']}: picks {r['auto_picks']}, dense / grouped_cpu "
              f"{times_cell(ratio(median_of(r, 'dense'), median_of(r, 'grouped_cpu')))}" for r in judged
              if r["auto_picks"] != min(("dense", "grouped_cpu"), key=lambda impl: median_of(r, impl))]
    return len(judged) - len(misses), misses


def targets(rows) -> list[str]:
    from8 = [r for r in rows if r["E"] >= 8 and r["M"] >= 256]  # where grouping is meant to pay
    lines = ["| target | measured |", "| --- | --- |"]
    for impl in ("grouped_cpu", "grouped"):
        speedups = [x for r in from8 if (x := ratio(median_of(r, "dense"), median_of(r, impl)))]
        if speedups:
            verdict = "met" if min(speedups) > 1 else "not met"
            lines.append(f"| {impl} faster than dense from 8 experts on (fwd+bwd, 256 tokens or more) | {verdict}: "
                         f"{min(speedups):.2f}x to {max(speedups):.2f}x dense's speed over {len(speedups)} cases |")
    return lines


def decode_table(rows) -> list[str]:
    from jaxattn.kernels import moe
    lines = ["| M tokens | E | k | " + " | ".join(f"{i} ms" for i in DECODE_IMPLS) + " | dense / gathered | "
             "auto_cpu picks | fastest |", "| ---: | ---: | ---: |" + " ---: |" * len(DECODE_IMPLS) + " ---: | --- | --- |"]
    for row in rows:
        medians = {impl: median_of(row, impl) for impl in DECODE_IMPLS}
        fastest = min((i for i in DECODE_IMPLS if medians[i]), key=lambda i: medians[i], default="–")
        cells = " | ".join(f"{medians[i] * 1e3:,.2f}" if medians[i] else "error" for i in DECODE_IMPLS)
        lines.append(f"| {row['M']} | {row['E']} | {row['k']} | {cells} | "
                     f"{times_cell(ratio(medians['dense'], medians['gathered']))} | "
                     f"{moe.cpu_rule(row['M'], row['E'], row['k'])[0]} | {fastest} |")
    return lines


def write_report(rows, args, argv, decode_rows=()) -> None:
    from bench.machine import describe_machine, machine_line, write_results
    from jaxattn.kernels import Platform, moe
    for row in rows:
        row["auto_picks"] = moe.cpu_rule(row["M"], row["E"], row["k"])[0]
    machine = describe_machine()
    right, misses = rule_misses(rows)
    command = "PYTHONPATH=$PWD python " + " ".join(["bench/moe.py"] + argv[1:])
    rule = {"auto_cpu": moe.rule(Platform("cpu"))[1], "right": right, "misses": misses}
    record = {"meta": {"machine": machine, "command": command, "D": D, "F": F, "dtype": "float32",
                       "pass": "fwd+bwd"}, "rule": rule, "rows": rows, "decode_rows": list(decode_rows)}
    lines = [f"# MoE routed experts on {machine_line(machine)}", "",
             f"Median milliseconds of forward+backward of one MoE layer (router + routed experts), D={D}, F={F}, "
             "float32, [1, M, D] tokens (bench/moe.py: per case the implementations in turns in one fresh "
             "process). XLA GiB: the memory XLA plans for the program. `–`: not run (see the JSON's "
             "`skipped`: XLA:CPU runs ragged_dot as a dense masked product, k times the reference's work).",
             "", *table(rows), "", "## The rule of auto", "",
             f"`auto` resolves to `auto_cpu` on a CPU: {rule['auto_cpu']} (`jaxattn.kernels.moe.cpu_rule`); "
             "elsewhere to `grouped` (ragged_dot, a grouped matmul where the backend has one; not measured "
             f"here). Here it picked the faster of dense and grouped_cpu in {right} of {right + len(misses)} "
             + ("cases." if not misses else "cases; not in:"),
             *([""] + [f"- {line}" for line in misses] if misses else []),
             "", "## Decoding steps", "",
             "Median milliseconds of the forward pass alone over M tokens (a decoding step of batch M), "
             "the same layer; `auto_cpu picks` is the rule's choice at that M.", "", *decode_table(decode_rows),
             "", "## Targets", "", *targets(rows), "", f"Made by: `{command}`", ""]
    write_results(RESULTS, "moe", record, "\n".join(lines))


def parse_args(argv=None):
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="64,256,1024,4096", type=ints)
    parser.add_argument("--experts", default="4,8,16,32,64", type=ints)
    parser.add_argument("--reps", type=int, default=5, help="timed runs per case (half, at least 3, for large ones)")
    parser.add_argument("--max-grouped-rows", type=int, default=2**18, help="skip ragged_dot beyond this M*k*E")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per case")
    parser.add_argument("--decode-tokens", default="1,8,32", type=ints, help="tokens of the forward-only table")
    parser.add_argument("--report-only", action="store_true", help="rewrite the report from moe.json's rows")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.report_only:
        saved = json.loads((RESULTS / "moe.json").read_text())
        write_report(saved["rows"], args, saved["meta"]["command"].split()[2:], saved.get("decode_rows", ()))
    else:
        decode_rows = decode_sweep(args)
        write_report(sweep(args), args, sys.argv, decode_rows)


if __name__ == "__main__":
    main()
