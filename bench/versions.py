"""One benchmark run from two checkouts in turns: what a change did to its figures, side by side.

    git worktree add ../jaxattn-base COMMIT        # the version to compare with, checked out beside this one
    PYTHONPATH=$PWD python bench/versions.py --base ../jaxattn-base --rounds 3 --name versions_serve \\
        --keys 'output_tokens_per_s|itl_p50_s' --out-flag -- bench/serve.py --model baby --runners engine

Each round runs the command once in each checkout, this one and `--base`, the order reversed every
other round so that neither side always runs first on a machine whose speed drifts; each run is the
checkout's own script (`python SCRIPT ARGS` with the checkout as working directory and PYTHONPATH), so
a change of the library's API between the versions does not matter. Its result is the JSON the script
writes: with `--out-flag`, `--out TMP` is added to the command and TMP.json read; else `--result FILE`,
a path in the checkout the script always writes (kept as it was before the run, restored after).

The numbers compared are the JSON's numeric leaves whose path matches `--keys` (a regular expression);
a list of records is indexed by each record's identifying fields (`load`, `runner`, `model`, `kind`,
`batch`, `new_tokens`), so `loads[concurrency 8].rows[engine].median.output_tokens_per_s` names one
figure in both versions. Reported per figure: each side's median over the rounds and the ratio
this / base. Writes bench/results/NAME.json and NAME.md, with the CPU, the commits and the command.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe_machine, load_average, machine_line, portable_command, write_results  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
ID_KEYS = ("load", "runner", "model", "kind", "batch", "new_tokens")


def flatten(value, path: str = "") -> dict[str, float]:
    """The numeric leaves of a JSON value by path; a list's records named by their identifying fields."""
    if isinstance(value, bool):
        return {}
    if isinstance(value, (int, float)):
        return {path: float(value)}
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in flatten(item, f"{path}.{key}".lstrip(".")).items()}
    if isinstance(value, list):
        found = {}
        for i, item in enumerate(value):
            name = " ".join(str(item[k]) for k in ID_KEYS if isinstance(item, dict) and k in item) or str(i)
            found.update(flatten(item, f"{path}[{name}]"))
        return found
    return {}


def commit_of(checkout: Path) -> str:
    done = subprocess.run(["git", "log", "-1", "--format=%h %s"], cwd=checkout, capture_output=True, text=True)
    return done.stdout.strip()[:90] or "(not a git checkout)"


def run_once(checkout: Path, command: list[str], args: argparse.Namespace, scratch: Path) -> dict:
    """The command's JSON result from one run in `checkout` (see the module docstring)."""
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    argv = [sys.executable, *command]
    kept = None
    if args.out_flag:
        out = scratch / f"run{len(list(scratch.iterdir()))}"
        argv += ["--out", str(out)]
        result = out.with_suffix(".json")
    else:
        result = checkout / args.result
        if result.exists():
            kept = scratch / f"kept{len(list(scratch.iterdir()))}"
            shutil.copy2(result, kept)
    try:
        done = subprocess.run(argv, cwd=checkout, env=env, capture_output=True, text=True, timeout=args.timeout)
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            raise SystemExit(f"error: {' '.join(command)} failed in {checkout} (exit {done.returncode}): {tail[0]}")
        return json.loads(result.read_text())
    finally:
        if kept is not None:
            shutil.copy2(kept, result)


def compare(rounds: dict[str, list[dict]], keys: str) -> list[dict]:
    """Per figure matching `keys` in both versions: each side's values and median, and the ratio."""
    pattern = re.compile(keys)
    flat = {side: [flatten(r) for r in results] for side, results in rounds.items()}
    common = set.intersection(*(set(f) for runs in flat.values() for f in runs))
    rows = []
    for path in sorted(p for p in common if pattern.search(p)):
        values = {side: [f[path] for f in runs] for side, runs in flat.items()}
        medians = {side: statistics.median(v) for side, v in values.items()}
        ratio = medians["this"] / medians["base"] if medians["base"] else None
        rows.append(dict(figure=path, base=values["base"], this=values["this"], base_median=medians["base"],
                         this_median=medians["this"], ratio=ratio))
    return rows


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = [f"# {meta['name']}: the same benchmark from two versions, in turns", "",
             f"{meta['machine']}; {meta['rounds']} rounds, the order reversed every other round; 1-minute load "
             f"average {meta['load_average']:.1f} at the start.", "",
             f"* base: `{meta['base_commit']}`", f"* this: `{meta['this_commit']}`", "",
             "| figure | base (median) | this (median) | this / base |", "| --- | ---: | ---: | ---: |"]
    for r in rows:
        ratio = "n/a" if r["ratio"] is None else f"{r['ratio']:.3f}"
        lines.append(f"| `{r['figure']}` | {r['base_median']:.4g} | {r['this_median']:.4g} | {ratio} |")
    lines += ["", f"Command: `{meta['command']}`", ""]
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, required=True, help="the other checkout (git worktree add DIR COMMIT)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--name", required=True, help="writes bench/results/NAME.json and NAME.md")
    parser.add_argument("--keys", default="tokens_per_s", help="regular expression over the figures' paths")
    how = parser.add_mutually_exclusive_group(required=True)
    how.add_argument("--out-flag", action="store_true", help="the script takes --out PATH and writes PATH.json")
    how.add_argument("--result", help="the JSON file, relative to a checkout, the script writes")
    parser.add_argument("--timeout", type=float, default=7200, help="seconds per run")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- SCRIPT ARGS, run with this Python")
    args = parser.parse_args(argv)
    args.command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not args.command:
        parser.error("give the benchmark after --, e.g. -- bench/serve.py --model baby")
    if not (args.base / args.command[0]).is_file():
        parser.error(f"--base {args.base} has no {args.command[0]}")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    return args


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    sides = {"this": ROOT, "base": args.base.resolve()}
    machine = describe_machine()
    meta = dict(name=args.name, machine=machine_line(machine), machine_record=machine, rounds=args.rounds,
                load_average=load_average() or 0.0, base_commit=commit_of(sides["base"]), this_commit=commit_of(ROOT),
                command="PYTHONPATH=$PWD python bench/versions.py " + portable_command(argv, ("--base",)))
    rounds: dict[str, list[dict]] = {"this": [], "base": []}
    with tempfile.TemporaryDirectory(prefix="versions-") as scratch:
        for i in range(args.rounds):
            order = ("base", "this") if i % 2 == 0 else ("this", "base")
            for side in order:
                rounds[side].append(run_once(sides[side], args.command, args, Path(scratch)))
                print(f"round {i + 1}/{args.rounds}: {side} done", file=sys.stderr, flush=True)
    rows = compare(rounds, args.keys)
    write_results(RESULTS, args.name, dict(meta=meta, rows=rows), markdown(meta, rows))


if __name__ == "__main__":
    main()
