"""How long `python -m train.serve` takes to be ready, the first time and again with its programs kept.

    PYTHONPATH=$PWD .venv/bin/python bench/serve_startup.py [--model baby|smollm2] [--gguf FILE]
        [--repeats 3] [--out bench/results/serve_startup]

For each model (bench/serve.py's checkpoints, written once, and --gguf's file, e.g. the real
SmolLM2-135M-Instruct), in fresh server processes with the program's defaults (`--max-seqs 32`, the
default KV pool: `jaxattn.serving.kv_memory`), per repeat: a first start with an empty program
cache (`JAXATTN_CACHE_DIR` a new folder), then a second start with the programs the first kept
(`jaxattn.program_cache`). Each: seconds from launching the process to its `ready:` line, that
`/health` then answers 200, the time of one 1-token completion right after, and the programs read
back and compiled (the server's `programs:` line). Medians of --repeats; the compile time is the
server's own (in its ready line).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import serve as serve_bench  # noqa: E402
from bench.machine import describe_machine, machine_line, write_results  # noqa: E402
from bench.serve_http import ensure_tokenizer  # noqa: E402

READY = re.compile(r"^ready: (\S+) .*?(\d+) step programs compiled in ([\d.]+) s")


PROGRAMS = re.compile(r"programs: (\d+) programs? read back from the cache, (\d+) compiled"
                      r"(?:; traced programs: (\d+) read back, (\d+) traced and kept)?")


def once(source: list[str], cache: Path) -> dict:
    """One server started on `source` (its model flags) keeping its programs in `cache`."""
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as stderr:
        server = subprocess.Popen([sys.executable, "-m", "train.serve", *source, "--port", "0",
                                   "--served-model-name", "bench", "--log-level", "warning"], cwd=ROOT,
                                  stdout=subprocess.PIPE, stderr=stderr, text=True,
                                  env={**os.environ, "JAXATTN_CACHE_DIR": str(cache)})
        try:
            line = server.stdout.readline()
            ready_s = time.perf_counter() - start
            match = READY.match(line)
            if match is None:
                stderr.seek(0)
                raise RuntimeError(f"train.serve did not start: {line!r} {stderr.read()[-2000:]}")
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
        stderr.seek(0)
        kept = PROGRAMS.search(stderr.read())
    return {"ready_s": ready_s, "compile_s": float(match.group(3)), "programs": int(match.group(2)),
            "health": health, "first_request_s": first_s, "exit_code": code,
            "read_back": int(kept[1]) if kept else None, "compiled": int(kept[2]) if kept else None,
            "traced_read_back": int(kept[3]) if kept and kept[3] else 0,
            "traced": int(kept[4]) if kept and kept[4] else 0}


def first_and_second(source: list[str], repeats: int) -> dict:
    """Per repeat, a first start on an empty program cache and a second on what it kept -> medians."""
    runs = {"first": [], "second": []}
    for _ in range(repeats):
        with tempfile.TemporaryDirectory(prefix="jaxattn-programs-") as cache:
            runs["first"].append(once(source, Path(cache)))
            runs["second"].append(once(source, Path(cache)))
    keys = ("ready_s", "compile_s", "first_request_s", "read_back", "compiled", "traced_read_back", "traced")
    return {start: {"runs": r, "median": {key: statistics.median(run[key] for run in r) for key in keys},
                    "health": {run["health"] for run in r} == {200}, "exit_codes": [run["exit_code"] for run in r]}
            for start, r in runs.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="baby,smollm2", help="comma-separated: baby, smollm2, tiny")
    parser.add_argument("--gguf", type=Path, help="also a GGUF file (e.g. SmolLM2-135M-Instruct's Q4_1)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--serve-args", default="", help="more train.serve flags, e.g. '--kv-memory 2'")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "serve_startup")
    args = parser.parse_args(argv)
    sources = []
    for model in [m for m in args.model.split(",") if m]:
        checkpoint, facts = serve_bench.ensure_checkpoint(model, serve_bench.default_cache_dir())
        ensure_tokenizer(checkpoint, facts["vocab_size"])
        sources.append((model, facts["num_layers"], ["--hf", str(checkpoint)]))
    if args.gguf:
        sources.append((f"{args.gguf.name} (real weights)", None, ["--gguf", str(args.gguf)]))
    sources = [(name, layers, source + args.serve_args.split()) for name, layers, source in sources]
    rows = []
    for name, layers, source in sources:
        print(f"{name}: {args.repeats} first and second starts", file=sys.stderr, flush=True)
        starts = first_and_second(source, args.repeats)
        rows.append({"model": name, "layers": layers, "programs": starts["first"]["runs"][0]["programs"], **starts})
    machine = describe_machine()
    command = "PYTHONPATH=$PWD python bench/serve_startup.py " + shlex.join(
        a if not a.startswith("/") else "/path/to/" + Path(a).name for a in (argv or sys.argv[1:]))
    extra = f" and `{args.serve_args}`" if args.serve_args else ""
    lines = ["# `python -m train.serve`: start to ready, first and second", "",
             f"{machine_line(machine)}; defaults (`--max-seqs 32`){extra}; medians of {args.repeats} fresh "
             "processes each. First: an empty program cache; second: the programs the first kept, compiled "
             "(`jaxattn.program_cache`) and traced (`jaxattn.program_store`).", "",
             "| model | layers | step programs | start | start to ready s | of it step programs s | compiled: read "
             "back / compiled | traced: read back / traced | /health | first request ms | exit on SIGTERM |",
             "|" + " --- |" * 11]
    for row in rows:
        for start in ("first", "second"):
            m, r = row[start]["median"], row[start]
            lines.append(f"| {row['model']} | {row['layers'] or ''} | {row['programs']} | {start} | {m['ready_s']:.1f} "
                         f"| {m['compile_s']:.1f} | {m['read_back']:.0f} / {m['compiled']:.0f} "
                         f"| {m['traced_read_back']:.0f} / {m['traced']:.0f} "
                         f"| {'200' if r['health'] else 'not 200'} | {m['first_request_s'] * 1e3:.0f} "
                         f"| {', '.join(map(str, r['exit_codes']))} |")
    lines += ["", f"Command: `{command.strip()}`", ""]
    write_results(args.out.parent, args.out.name, {"machine": machine, "command": command, "rows": rows},
                  "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
