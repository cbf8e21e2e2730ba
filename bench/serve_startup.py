"""How long `python -m train.serve` takes to be ready, and its first request after that.

    PYTHONPATH=$PWD .venv/bin/python bench/serve_startup.py [--model baby|smollm2] [--repeats 3]
        [--out bench/results/serve_startup]

For each model (bench/serve.py's checkpoints, written once), in a fresh server process per
repeat with the program's defaults (`--max-seqs 32`, pages for every request to reach the
context): seconds from launching the process to its `ready:` line, that `/health` then answers
200, and the time of one 1-token completion right after. Medians of --repeats; the compile time
is the server's own (in its ready line).
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import serve as serve_bench  # noqa: E402
from bench.machine import describe_machine, machine_line, write_results  # noqa: E402
from bench.serve_http import ensure_tokenizer  # noqa: E402

READY = re.compile(r"^ready: (\S+) .*?(\d+) step programs compiled in ([\d.]+) s")


def once(checkpoint: Path) -> dict:
    start = time.perf_counter()
    server = subprocess.Popen([sys.executable, "-m", "train.serve", "--hf", str(checkpoint), "--port", "0",
                               "--served-model-name", "bench", "--log-level", "warning"], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = server.stdout.readline()
        ready_s = time.perf_counter() - start
        match = READY.match(line)
        if match is None:
            raise RuntimeError(f"train.serve did not start: {line!r}")
        url = match.group(1)
        health = urllib.request.urlopen(url + "/health", timeout=30).status
        body = json.dumps({"model": "bench", "prompt": [1, 2, 3], "max_tokens": 1}).encode()
        request = urllib.request.Request(url + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        first = time.perf_counter()
        urllib.request.urlopen(request, timeout=120).read()
        first_s = time.perf_counter() - first
    finally:
        server.send_signal(signal.SIGTERM)
        code = server.wait(120)
    return {"ready_s": ready_s, "compile_s": float(match.group(3)), "programs": int(match.group(2)),
            "health": health, "first_request_s": first_s, "exit_code": code}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="baby,smollm2", help="comma-separated: baby, smollm2, tiny")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "serve_startup")
    args = parser.parse_args(argv)
    rows = []
    for model in args.model.split(","):
        checkpoint, facts = serve_bench.ensure_checkpoint(model, serve_bench.default_cache_dir())
        ensure_tokenizer(checkpoint, facts["vocab_size"])
        runs = [once(checkpoint) for _ in range(args.repeats)]
        median = {key: statistics.median(r[key] for r in runs) for key in ("ready_s", "compile_s", "first_request_s")}
        rows.append({"model": model, "checkpoint": facts, "runs": runs, "median": median,
                     "programs": runs[0]["programs"], "health": {r["health"] for r in runs} == {200},
                     "exit_codes": [r["exit_code"] for r in runs]})
    machine = describe_machine()
    command = "PYTHONPATH=$PWD python bench/serve_startup.py " + " ".join(
        a if not a.startswith("/") else "/path/to/" + Path(a).name for a in (argv or sys.argv[1:]))
    lines = [f"# `python -m train.serve`: start to ready", "", f"{machine_line(machine)}; defaults (`--max-seqs 32`); "
             f"medians of {args.repeats} fresh processes.", "",
             "| model | layers | step programs | start to ready s | of it compiling s | /health | first request ms "
             "| exit on SIGTERM |", "|" + " --- |" * 8]
    for row in rows:
        m = row["median"]
        lines.append(f"| {row['model']} | {row['checkpoint']['num_layers']} | {row['programs']} | {m['ready_s']:.1f} "
                     f"| {m['compile_s']:.1f} | {'200' if row['health'] else 'not 200'} "
                     f"| {m['first_request_s'] * 1e3:.0f} | {', '.join(map(str, row['exit_codes']))} |")
    lines += ["", f"Command: `{command.strip()}`", ""]
    write_results(args.out.parent, args.out.name, {"machine": machine, "command": command, "rows": rows},
                  "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
