"""bench/serve.py's `server` runner: the load sent over HTTP to `python -m train.serve`, streamed.

The runner starts the server on the benchmark's checkpoint (a free loopback port, the engine's
settings), sends the warm-up requests, then the load: each request a streamed `/v1/completions`
of its prompt ids (`"ignore_eos": true`, greedy), each token timed as its server-sent event
arrives. The client is a few lines of asyncio over one HTTP/1.1 connection per request, not the
`openai` client: the client shares the machine's cores with the server, and a lighter one takes
less of them (what is measured is the server).

The checkpoint needs a tokenizer.json for `--hf`: `ensure_tokenizer` writes a word-level one whose
token i is the word "t<i>", so the streamed text gives the ids back.
"""

from __future__ import annotations

import asyncio
import collections
import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
READY = re.compile(r"^ready: http://([\d.]+):(\d+) .*?([\d,]+) pages of (\d+) tokens, ([\d.,]+) MiB of KV cache"
                   r"[^;]*; \d+ step programs compiled in ([\d.]+) s")
WORD = re.compile(r"t(\d+)")


def ensure_tokenizer(checkpoint: Path, vocab_size: int) -> None:
    """A word-level tokenizer.json in `checkpoint` (token i = "t<i>"), written once."""
    path = checkpoint / "tokenizer.json"
    if path.is_file():
        return
    from tokenizers import Tokenizer, models, pre_tokenizers
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    scratch = path.with_suffix(".tmp")
    tokenizer.save(str(scratch))
    scratch.rename(path)


async def stream_completion(host: str, port: int, body: dict, on_text) -> None:
    """POSTs a streamed completion; calls `on_text(text, time)` for each chunk's text as it arrives."""
    reader, writer = await asyncio.open_connection(host, port)
    payload = json.dumps(body).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (host.encode(), len(payload), payload))
    await writer.drain()
    status = await reader.readline()
    if b" 200 " not in status:
        raise RuntimeError(f"the server answered {status.decode().strip()}: {(await reader.read()).decode()[:500]}")
    while (await reader.readline()) not in (b"\r\n", b""):
        pass
    buffer = b""
    while True:
        size = int((await reader.readline()).strip() or b"0", 16)  # chunked transfer encoding
        if size == 0:
            break
        buffer += await reader.readexactly(size + 2)
        buffer = buffer[:-2] if buffer.endswith(b"\r\n") else buffer
        *events, buffer = buffer.split(b"\n\n")
        now = time.perf_counter()
        for event in events:
            data = event.decode().removeprefix("data: ")
            if data == "[DONE]":
                writer.close()
                return
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"the stream ended with an error: {chunk['error']['message']}")
            text = chunk["choices"][0]["text"]
            if text:
                on_text(text, now)
    writer.close()


async def drive_load(host, port, load, clock) -> tuple[dict, dict]:
    """The load over HTTP (fixed concurrency, or Poisson arrivals); per request its arrival, token
    times and ids."""
    arrivals, times, ids = {}, collections.defaultdict(list), collections.defaultdict(list)

    async def one(i, request):
        def on_text(text, at):
            for word in WORD.findall(text):
                ids[i].append(int(word))
                times[i].append(clock(at))
        body = {"model": "bench", "prompt": list(request.prompt), "max_tokens": request.max_tokens,
                "temperature": 0, "stream": True, "ignore_eos": True}
        await stream_completion(host, port, body, on_text)

    tasks = []
    if load.kind == "concurrency":
        slots = asyncio.Semaphore(load.concurrency)

        async def held(i, request):
            async with slots:
                arrivals[i] = clock()
                await one(i, request)
        tasks = [asyncio.create_task(held(i, r)) for i, r in enumerate(load.requests)]
    else:
        for i, request in enumerate(load.requests):
            await asyncio.sleep(max(request.arrival_s - clock(), 0.0))
            arrivals[i] = request.arrival_s
            tasks.append(asyncio.create_task(one(i, request)))
    await asyncio.gather(*tasks)
    return arrivals, {"times": times, "ids": ids}


async def peak_pages(host: str, port: int, done: asyncio.Event) -> int:
    """The most KV-cache pages held at once, read from /metrics every 0.25 s until `done`."""
    peak = 0
    while not done.is_set():
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        text = (await reader.read()).decode()
        writer.close()
        found = re.search(r"^jaxattn_kv_pages_used (\S+)$", text, re.M)
        peak = max(peak, int(float(found.group(1)))) if found else peak
        try:
            await asyncio.wait_for(done.wait(), 0.25)
        except asyncio.TimeoutError:
            pass
    return peak


def run_server(spec: dict, load, warmups: list[list[int]], max_seqs: int, num_pages: int, clock_type) -> dict:
    """The `server` runner's record (bench/serve.py's RUNNERS: the same fields as the engine's)."""
    from jaxattn import hf
    from jaxattn.cache.build import cache_bytes_per_token
    checkpoint = Path(spec["checkpoint"])
    config, _ = hf.load_pretrained(checkpoint, dtype="float32")
    ensure_tokenizer(checkpoint, config.vocab_size)
    command = [sys.executable, "-m", "train.serve", "--hf", str(checkpoint), "--served-model-name", "bench",
               "--host", "127.0.0.1", "--port", "0", "--max-seqs", str(max_seqs), "--page-size",
               str(spec["page_size"]), "--num-pages", str(num_pages), "--token-budget", str(spec["token_budget"]),
               "--max-waiting", str(len(load.requests) + len(warmups)), "--log-level", "warning",
               *shlex.split(spec.get("serve_args", ""))]
    start = time.perf_counter()
    server = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = server.stdout.readline()
        ready = READY.match(line)
        if ready is None:
            server.kill()
            raise RuntimeError(f"train.serve did not start: {line.strip()} {server.stderr.read()[-2000:]}")
        host, port = ready.group(1), int(ready.group(2))
        pages, page_size = int(ready.group(3).replace(",", "")), int(ready.group(4))
        pool_bytes = pages * page_size * cache_bytes_per_token(config)["bytes"]  # the line's MiB are rounded
        compile_s, ready_s = float(ready.group(6)), time.perf_counter() - start

        async def everything():
            warm = time.perf_counter()
            await asyncio.gather(*(stream_completion(host, port, {
                "model": "bench", "prompt": p, "max_tokens": 4, "temperature": 0, "stream": True,
                "ignore_eos": True}, lambda text, at: None) for p in warmups))
            warmup_s = time.perf_counter() - warm
            clock = clock_type()
            done = asyncio.Event()
            watcher = asyncio.create_task(peak_pages(host, port, done))
            arrivals, got = await drive_load(host, port, load, clock)
            end_s = clock()
            done.set()
            return warmup_s, arrivals, got, end_s, await watcher

        warmup_s, arrivals, got, end_s, peak = asyncio.run(everything())
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
    requests = [{"arrival_s": arrivals[i], "token_times_s": got["times"][i], "output_ids": got["ids"][i]}
                for i in range(len(load.requests))]
    return {"available": True, "compile_s": compile_s, "warmup_s": warmup_s, "end_s": end_s, "ready_s": ready_s,
            "requests": requests,
            "memory": {"pool_bytes": pool_bytes, "reserved_peak_bytes": peak * pool_bytes / pages,
                       "used_peak_bytes": None},
            "settings": {"command": " ".join(command[1:]).replace(str(checkpoint), "CHECKPOINT"),
                         "page_size": page_size, "num_pages": pages, "ready_s": round(ready_s, 1)}}
