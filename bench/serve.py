"""Serving: the same requests through several runners, at fixed concurrency and under Poisson arrivals.

    PYTHONPATH=$PWD .venv/bin/python bench/serve.py [--model baby|smollm2] [--requests 32]
        [--concurrency 1,8,32] [--poisson-rate 2] [--prompt-range 32,512] [--output-range 32,256]
        [--runners engine,hf_generate_batch,static_generate] [--threads N] [--repeats 3]
        [--serve-args '--decode-steps 4'] [--out bench/results/serve]

Runners, each in a fresh process per (load, repeat), in turns (the order reversed every other repeat),
medians of --repeats:

* `engine`: `jaxattn.serving.Engine` (continuous batching over a paged cache), driven by a loop that
  adds the requests whose time has come, then calls `engine.step()`. Reported as unavailable where
  `jaxattn.serving` does not import.
* `hf_generate_batch`: transformers' continuous batching (the `ContinuousBatchingManager` that
  `model.generate_batch` wraps: `continuous_batching_context_manager`, `add_request`, `get_result`),
  on the same checkpoint, with per-token timestamps (`record_timestamps=True`); torch threads = the
  cores JAX uses (--threads).
* `static_generate`: `jaxattn.generate` in padded batches, one after another (greedy).
* `engine_guided` (asked by name in --runners): the engine with the even requests guided by a JSON
  schema (structured outputs: an object of one long string, masks filled by llguidance on the host),
  beside `engine` on the same load; it also reports the host's time per guided row per step. The
  guides' tokenizer is --guide-tokenizer's (a GGUF file or a tokenizer.json, e.g. SmolLM2's for
  --model smollm2), else the corpus's characters ($, & and 3 read as {, } and ", which it lacks).
* `engine_lora1`, `engine_lora2`, `engine_lora8`, `engine_lora32` (asked by name): the engine with that
  many random rank-16 LoRA adapters on every projection in as many slots (`EngineConfig.max_loras`),
  request i under adapter i mod N, beside `engine` on the same load: a table of each one's output tokens/s
  against `engine`'s follows the main one.
* `server`: the same engine behind `python -m train.serve`, over HTTP: each request a streamed
  `/v1/completions` from a client in the runner's process (bench/serve_http.py), each token timed as
  its event arrives. The server process is started by the runner and shares its cores.

The loads: --requests requests drawn once (seeded) from Tiny Shakespeare: prompt and output lengths
uniform on --prompt-range and --output-range, each prompt a slice of the text at a uniform offset,
its characters mapped to ids (index in the sorted set of the text's 65 characters: valid ids in
every model here). Fixed concurrency keeps C requests in flight (a new one joins as one ends);
Poisson arrivals come at --poisson-rate requests/s (exponential gaps, the first at 0). Greedy; EOS
ignored: every request generates exactly its output length (checked).

Reported per (load, runner): output tokens/s and requests/s (over the run, first arrival to last
token), time to first token (TTFT, from arrival) p50/p99, inter-token latency (ITL, gaps between a
request's consecutive tokens, pooled) p50/p99, and the KV cache's memory. Models: `baby`
(configs/shakespeare_char_baby.toml, max_seq_len 1024), `smollm2` (SmolLM2-135M's shape: Llama, 30
layers, d 576, 9 query / 3 kv heads of 64, MLP 1536, vocab 49152, tied, RMSNorm, RoPE theta 1e5,
max_seq_len 2048) and `tiny` (the smoke test's), randomly initialised (seed 0) and saved once with
`jaxattn.hf.save_pretrained` under --cache-dir, which every runner loads. Writes
bench/results/serve.json and serve.md (--out PATH: PATH.json and PATH.md).

    python bench/serve.py --runner NAME --spec SPEC.json    # one runner once, in this process (the children)
"""

from __future__ import annotations

import argparse
import bisect
import collections
import hashlib
import json
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import fresh  # noqa: E402
from bench.machine import cpu_cores, load_average, write_results  # noqa: E402

RESULTS = ROOT / "bench" / "results"
SHARED_CORPUS = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"
RUNNER_NAMES = ("engine", "server", "hf_generate_batch", "static_generate")  # engine_guided, engine_lora<N>: by name
MAX_SEQ_LEN = {"tiny": 128, "baby": 1024, "smollm2": 2048}
SEED = 0


class UsageError(Exception):
    """A bad command line: exit status 2."""


class BenchError(Exception):
    """A runtime failure: exit status 1."""


# ---------------------------------------------------------------- the load

@dataclass(frozen=True)
class Request:
    """One request: its prompt ids, the tokens it asks, and (Poisson loads) its arrival in seconds."""

    prompt: list[int]
    max_tokens: int
    arrival_s: float | None = None


@dataclass(frozen=True)
class Load:
    """The requests of one load: `concurrency` in flight, or arrivals at `rate` per second (Poisson)."""

    kind: str  # "concurrency" or "poisson"
    requests: list[Request]
    concurrency: int | None = None
    rate: float | None = None

    @property
    def name(self) -> str:
        return f"concurrency {self.concurrency}" if self.kind == "concurrency" else f"Poisson {self.rate:g}/s"


def corpus_path(explicit: str | None = None) -> Path:
    """Tiny Shakespeare: --data, else $JAXATTN_SHAKESPEARE, else ../shared/data/tinyshakespeare.txt beside the
    repository, else the cache (downloaded once): `train.data.corpus.resolve_data_path`'s order."""
    from train.data.corpus import ENV_PATH, resolve_data_path
    if not explicit and not os.environ.get(ENV_PATH) and SHARED_CORPUS.is_file():
        return SHARED_CORPUS
    return resolve_data_path(explicit)


def text_ids(text: str) -> list[int]:
    """Each character's index in the sorted set of the text's characters (Tiny Shakespeare: 65 ids)."""
    index = {c: i for i, c in enumerate(sorted(set(text)))}
    return [index[c] for c in text]


def draw_requests(ids: list[int], n: int, prompt_range: tuple[int, int], output_range: tuple[int, int],
                  seed: int = SEED) -> list[Request]:
    """`n` requests: prompt and output lengths uniform on the (inclusive) ranges, each prompt the slice of
    `ids` at a uniform offset. The same seed gives the same requests."""
    if len(ids) < prompt_range[1]:
        raise BenchError(f"the corpus has {len(ids)} tokens, fewer than the longest prompt ({prompt_range[1]})")
    rng = random.Random(seed)
    requests = []
    for _ in range(n):
        length = rng.randint(*prompt_range)
        start = rng.randint(0, len(ids) - length)
        requests.append(Request(prompt=ids[start:start + length], max_tokens=rng.randint(*output_range)))
    return requests


def poisson_arrivals(n: int, rate: float, seed: int = SEED) -> list[float]:
    """`n` arrival times in seconds of a Poisson process of `rate` per second: the first at 0, then
    exponential gaps of mean 1/rate (strictly increasing)."""
    rng = random.Random(seed + 1)
    times, now = [], 0.0
    for i in range(n):
        if i:
            now += max(rng.expovariate(rate), 1e-9)
        times.append(now)
    return times


def make_loads(requests: list[Request], concurrency: list[int], rate: float, seed: int = SEED) -> list[Load]:
    """The fixed-concurrency loads, then (rate > 0) the Poisson load, all of the same requests."""
    loads = [Load("concurrency", requests, concurrency=c) for c in concurrency]
    if rate > 0:
        arrived = [Request(r.prompt, r.max_tokens, t) for r, t in zip(requests, poisson_arrivals(len(requests),
                                                                                                 rate, seed))]
        loads.append(Load("poisson", arrived, rate=rate))
    return loads


# ---------------------------------------------------------------- metrics

def percentile(values, q: float) -> float | None:
    """The q-th percentile (0-100) by linear interpolation between the closest ranks (numpy's default);
    None for no values."""
    xs = sorted(values)
    if not xs:
        return None
    position = (len(xs) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(xs) - 1)
    return xs[low] + (xs[high] - xs[low]) * (position - low)


def metrics(run: dict) -> dict:
    """One run's figures from its requests ({"arrival_s", "token_times_s"}, seconds from the run's start)
    and `end_s` (when the runner was done): throughput over first arrival to the end, TTFT per request,
    ITL pooled over every request's consecutive tokens."""
    requests = run["requests"]
    start = min(r["arrival_s"] for r in requests)
    end = max([run["end_s"], *(r["token_times_s"][-1] for r in requests if r["token_times_s"])])
    duration = end - start
    tokens = sum(len(r["token_times_s"]) for r in requests)
    ttft = [r["token_times_s"][0] - r["arrival_s"] for r in requests if r["token_times_s"]]
    itl = [b - a for r in requests for a, b in zip(r["token_times_s"], r["token_times_s"][1:])]
    return {"duration_s": duration, "output_tokens": tokens,
            "output_tokens_per_s": tokens / duration if duration > 0 else None,
            "requests_per_s": len(requests) / duration if duration > 0 else None,
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "itl_p50_s": percentile(itl, 50), "itl_p99_s": percentile(itl, 99)}


def median_metrics(runs: list[dict]) -> dict:
    """Each figure's median over the repeats (figures that are None in every repeat stay None)."""
    keys = runs[0].keys()
    out = {}
    for key in keys:
        values = [r[key] for r in runs if r[key] is not None]
        out[key] = statistics.median(values) if values else None
    return out


def check_tokens(requests: list[Request], outputs: list[list[int]], runner: str) -> None:
    """Every request got exactly the tokens it asked (EOS ignored)."""
    for i, (request, output) in enumerate(zip(requests, outputs)):
        if len(output) != request.max_tokens:
            raise BenchError(f"{runner}: request {i} asked {request.max_tokens} tokens and got {len(output)}")


# ---------------------------------------------------------------- the models and their checkpoint

def model_config(name: str):
    """The jaxattn config of --model NAME."""
    from jaxattn.config import ModelConfig
    from train.config import load_config
    if name == "baby":
        return load_config("shakespeare_char_baby").model.replace(max_seq_len=MAX_SEQ_LEN["baby"])
    if name == "smollm2":  # SmolLM2-135M's shape (LlamaForCausalLM)
        return ModelConfig(vocab_size=49152, d_model=576, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                           mlp_hidden=1536, mlp="swiglu", norm="rmsnorm", norm_eps=1e-5, positions="rope",
                           rope_theta=100000.0, use_bias=False, tie_embeddings=True, max_seq_len=MAX_SEQ_LEN["smollm2"])
    if name == "tiny":  # the smoke test's: the baby's kind, smaller
        return load_config("shakespeare_char_baby").model.replace(d_model=32, num_layers=2, num_heads=2,
                                                                   max_seq_len=MAX_SEQ_LEN["tiny"])
    raise UsageError(f"unknown model {name!r} (baby, smollm2, tiny)")


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "jaxattn" / "bench-serve"


def load_model(checkpoint: str, dtype: str = "float32"):
    """(config, params) of a transformers checkpoint in `dtype`, q, k and v fused into one projection as
    `train.serve` loads a model (`jaxattn.with_fused_qkv`)."""
    from jaxattn import hf, with_fused_qkv
    config, params = hf.load_pretrained(checkpoint, dtype=dtype)
    params, config = with_fused_qkv(params, config)
    return config, params


def ensure_checkpoint(name: str, cache_dir: Path, config=None) -> tuple[Path, dict]:
    """The checkpoint of --model NAME (or of `config`, named `name`) under `cache_dir` (written once:
    random init, seed 0, then `jaxattn.hf.save_pretrained`, renamed into place complete); (its
    directory, facts about it)."""
    import jax
    import jax.numpy as jnp

    from jaxattn import hf
    from jaxattn.model import DecoderLM, count_params
    config = model_config(name) if config is None else config
    key = hashlib.sha256(f"{config!r} seed={SEED}".encode()).hexdigest()[:12]
    path = cache_dir / f"{name}-{key}"
    if not (path / "model.safetensors").is_file():
        cache_dir.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=cache_dir))
        try:
            print(f"writing the {name} checkpoint to {path} (once)", file=sys.stderr, flush=True)
            params = jax.jit(DecoderLM(config).init)(jax.random.PRNGKey(SEED), jnp.zeros((1, 1), jnp.int32))["params"]
            hf.save_pretrained(scratch, config, params, overwrite=True)
            try:
                scratch.rename(path)
            except OSError:  # another run put it there first
                if not (path / "model.safetensors").is_file():
                    raise
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    loaded, params = hf.load_pretrained(path, dtype="float32")
    architecture = json.loads((path / "config.json").read_text())["architectures"][0]
    return path, {"architecture": architecture, "params": count_params(params), "max_seq_len": loaded.max_seq_len,
                  "vocab_size": loaded.vocab_size, "num_layers": loaded.num_layers, "d_model": loaded.d_model}


# ---------------------------------------------------------------- runners (each in its own process)

def load_of(spec: dict) -> Load:
    load = spec["load"]
    return Load(load["kind"], [Request(**r) for r in load["requests"]], load.get("concurrency"), load.get("rate"))


def rows_at_once(spec: dict, load: Load) -> int:
    """The most requests a runner holds at once: the concurrency, or --max-seqs under Poisson arrivals."""
    return load.concurrency if load.kind == "concurrency" else spec["max_seqs"]


def cache_pages(spec: dict, load: Load) -> int:
    """Pages (blocks) for every request held at once to reach the longest prompt + output."""
    return rows_at_once(spec, load) * -(-spec["max_model_len"] // spec["page_size"])


def warmup_prompts(spec: dict, load: Load) -> list[list[int]]:
    """The untimed requests run first (engine and HF alike): 8-token prompts, as many as the runner holds
    at once (at most 32), their ids shifted: unlike any prompt of the load (nothing to share in a prefix cache)."""
    ids = [t for r in load.requests for t in r.prompt]
    return [[(t + 1 + i) % 65 for t in (ids * 8)[8 * i:8 * i + 8]] for i in range(min(rows_at_once(spec, load), 32))]


def jax_kernels(spec: dict):
    from jaxattn.kernels import Kernels, resolve_kernels
    kernels = resolve_kernels()[0] if spec["kernels"] == "auto" else Kernels()
    return kernels if spec.get("paged", "auto") == "auto" else kernels.replace(paged=spec["paged"])


class Clock:
    """Seconds since the run's start (`time.perf_counter`)."""

    def __init__(self):
        self.t0 = time.perf_counter()

    def __call__(self, at: float | None = None) -> float:
        return (time.perf_counter() if at is None else at) - self.t0


def guided_schema(min_length: int) -> dict:
    """The guided runner's schema: an object of one string of at least `min_length` characters (the load's
    longest output: a guided answer of one character per token runs to its max_tokens, as the unguided do)."""
    return {"type": "object", "properties": {"text": {"type": "string", "minLength": min_length}},
            "required": ["text"], "additionalProperties": False}


JSON_STAND_INS = {"$": "{", "&": "}", "3": '"'}  # rare characters of Tiny Shakespeare read as JSON's


def guide_compiler(spec: dict, vocab_size: int):
    """The guided runner's `GuideCompiler`: --guide-tokenizer's (a GGUF file's tokenizer or a tokenizer.json),
    else the corpus's characters (the load's ids), one token each, the model's other ids refused; Tiny
    Shakespeare has no braces or double quotes, so three of its rarest characters stand for them."""
    from jaxattn.serving import GuideCompiler
    path = spec.get("guide_tokenizer")
    if path is None:
        text = corpus_path(spec.get("data")).read_text(encoding="utf-8")
        chars = [JSON_STAND_INS.get(c, c) for c in sorted(set(text))]
        index = {c: i for i, c in enumerate(chars)}
        return GuideCompiler.from_token_bytes([c.encode("utf-8") for c in chars],
                                              lambda text: [index[c] for c in text], vocab_size)
    if path.endswith(".gguf"):
        from jaxattn.gguf import GGUFModel
        tokenizer = GGUFModel.open(path).tokenizer()
        return GuideCompiler(tokenizer.tokenizer.to_str(), vocab_size, (tokenizer.eos_token_id,))
    return GuideCompiler(Path(path).read_text(encoding="utf-8"), vocab_size)


def run_engine_guided(spec: dict) -> dict:
    """The engine, every other request (the even ones) guided by a JSON schema (`guided_schema`)."""
    return run_engine(spec, guided=True)


LORA_RANK, LORA_COUNTS = 16, (1, 2, 8, 32)  # the engine_lora<N> runners: N adapters of this rank


def lora_targets(config) -> tuple[str, ...]:
    """Every projection: q, k, v, o, the MLP's up and down, and its gate where it has one."""
    return ("q", "k", "v", "o", "up", "down") + (("gate",) if config.mlp in ("swiglu", "geglu") else ())


def random_adapters(config, params, count: int) -> list:
    """`count` distinct rank-`LORA_RANK` adapters on every projection (params trees with `LoraWeight`s, a and
    b drawn N(0, 0.02): no product of zeros)."""
    import jax

    from jaxattn.lora import LoraConfig, add_lora, combine_lora, split_lora
    lora = LoraConfig(rank=LORA_RANK, alpha=32.0, targets=lora_targets(config))
    made = []
    for i in range(count):
        ab, frozen = split_lora(add_lora(params, config, lora, jax.random.PRNGKey(i)))
        leaves, tree = jax.tree.flatten(ab)
        keys = jax.random.split(jax.random.PRNGKey(1000 + i), len(leaves))
        made.append(combine_lora(frozen, jax.tree.unflatten(
            tree, [0.02 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)])))
    return made


def lora_runner(count: int):
    """The runner `engine_lora<count>`: the engine with `count` adapters in as many slots, request i asking
    adapter i mod `count`."""
    return lambda spec: run_engine(spec, adapters=count)


def run_engine(spec: dict, guided: bool = False, adapters: int = 0) -> dict:
    """jaxattn's continuous-batching engine: a loop that adds the requests whose time has come (Poisson)
    or keeps `concurrency` in flight, then runs one `engine.step()`. `adapters` > 0: that many random
    LoRA adapters in slots (`random_adapters`), mixed evenly among the requests."""
    try:
        from jaxattn.serving import Engine, EngineConfig, Guide, SamplingParams
    except ImportError as err:
        return {"available": False, "reason": f"jaxattn.serving does not import: {err}"}
    load = load_of(spec)
    config, params = load_model(spec["checkpoint"])
    kernels = jax_kernels(spec)
    slots = {"max_loras": adapters, "max_lora_rank": LORA_RANK, "lora_targets": lora_targets(config)} if adapters else {}
    engine_config = EngineConfig(max_seqs=rows_at_once(spec, load), page_size=spec["page_size"],
                                 num_pages=cache_pages(spec, load), token_budget=spec["token_budget"], **slots)
    start = time.perf_counter()
    compiler = guide_compiler(spec, config.vocab_size) if guided else None
    engine = Engine(params, config, engine_config, kernels=kernels, guide_compiler=compiler)  # compiles every step
    compile_s = time.perf_counter() - start
    for i, adapter in enumerate(random_adapters(config, params, adapters)):
        engine.add_lora(f"a{i}", adapter)
    guide = Guide("json_schema", json.dumps(guided_schema(max(r.max_tokens for r in load.requests))))

    def sampling(n, i=1):
        return SamplingParams(temperature=0.0, max_tokens=n, seed=0, guide=guide if guided and i % 2 == 0 else None,
                              lora=f"a{i % adapters}" if adapters else None)

    start = time.perf_counter()  # warm-up, untimed: short requests, as many as it holds, through prefill and decode
    for i, prompt in enumerate(warmup_prompts(spec, load)):  # (every adapter placed in its slot)
        engine.add_request(prompt, sampling(4, i))
    while engine.has_unfinished():
        engine.step()
    warmup_s = time.perf_counter() - start
    engine.clock.reset()  # the timed run's steps alone: where their time goes (jaxattn.serving.step_clock)

    pending = collections.deque(enumerate(load.requests))
    added: dict[int, object] = {}
    arrivals: dict[int, float] = {}
    in_flight: dict[int, object] = {}
    peak = {"reserved_bytes": 0, "used_bytes": 0}
    pool, guided_steps = None, 0
    runner = engine.model_runner
    masks_before = runner.mask_seconds, runner.masked_rows, runner.masks_late  # the warm-up's aside
    clock = Clock()
    while pending or engine.has_unfinished():
        now = clock()
        while pending and (len(in_flight) < load.concurrency if load.kind == "concurrency"
                           else pending[0][1].arrival_s <= now):
            i, request = pending.popleft()
            arrivals[i] = clock() if load.kind == "concurrency" else request.arrival_s
            added[i] = in_flight[i] = engine.add_request(list(request.prompt), sampling(request.max_tokens, i))
        if not engine.has_unfinished():
            time.sleep(max(pending[0][1].arrival_s - clock(), 0.0))  # idle until the next arrival
            continue
        masked = engine.model_runner.masked_rows
        engine.step()
        guided_steps += engine.model_runner.masked_rows > masked
        memory = engine.memory()
        pool = memory.get("pool_bytes", pool)
        for key in peak:
            peak[key] = max(peak[key], memory.get(key, 0))
        for i in [i for i, r in in_flight.items() if r.finished]:
            del in_flight[i]
    end_s = clock()
    outputs = [list(added[i].output_ids) for i in range(len(load.requests))]
    return {"available": True, "compile_s": compile_s, "warmup_s": warmup_s, "end_s": end_s,
            "requests": [{"arrival_s": arrivals[i], "token_times_s": [clock(t) for t in added[i].token_times],
                          "output_ids": outputs[i]} for i in range(len(load.requests))],
            "memory": {"pool_bytes": pool, "reserved_peak_bytes": peak["reserved_bytes"],
                       "used_peak_bytes": peak["used_bytes"]},
            "settings": {**asdict(engine_config), "kernels": kernels.to_dict()},
            "guides": {"mask_seconds": runner.mask_seconds - masks_before[0],
                       "masked_rows": runner.masked_rows - masks_before[1], "guided_steps": guided_steps,
                       "masks_late": runner.masks_late - masks_before[2], "steps": engine.stats["steps"]},
            "step_ms": engine.clock.per_step_ms(), "steps": engine.clock.steps}


def run_static(spec: dict) -> dict:
    """`jaxattn.generate` in padded batches, one after another, on a clock of measured call times.

    Fixed concurrency: batches of `concurrency` requests in order; each batch's requests arrive as it
    starts (their clients' previous answers came with the previous batch's end). Poisson: when the
    previous batch ends, the next takes every arrived request (up to --max-seqs), or waits for the next
    arrival. A batch runs to its longest request's output rounded up to --static-round. A new shape is
    compiled by an untimed call first. Its timed call takes T; a prefill-only call (max_new_tokens=1,
    the same batch) P: the first token of every row at start + P, the others evenly spaced to start + T
    (the scan's tokens are not observable one by one: `generate` returns them all at its end).
    """
    import jax
    import numpy as np

    from bench.timing import best_seconds, seconds
    from jaxattn.cache.build import cache_bytes_per_token
    from jaxattn.decoding import call_lengths, generate, prompt_bucket
    load = load_of(spec)
    config, params = load_model(spec["checkpoint"])
    kernels = jax_kernels(spec)
    token_bytes = cache_bytes_per_token(config)["bytes"]
    rows_cap = rows_at_once(spec, load)
    compiled, compile_s = set(), 0.0

    def call(prompt, lengths, new):
        return generate(params, config, prompt, lengths, max_new_tokens=new, rng=jax.random.PRNGKey(0),
                        temperature=0.0, kernels=kernels)

    def timed(prompt, lengths, new):
        nonlocal compile_s
        key = (prompt.shape[0], prompt_bucket(int(lengths.max()), config.max_seq_len), new)
        if key not in compiled:
            first = seconds(lambda: call(prompt, lengths, new))[1]
            out, steady = best_seconds(lambda: call(prompt, lengths, new))
            compile_s += max(first - steady, 0.0)
            compiled.add(key)
            return out, steady
        # The least of a few calls where one is short: the decode steps are told by a difference of two
        # timings, which a single noisy prefill-only call can outrun on a tiny model.
        return best_seconds(lambda: call(prompt, lengths, new))

    requests = list(enumerate(load.requests))
    clock, done = 0.0, 0
    results: dict[int, dict] = {}
    peak = {"reserved": 0, "used": 0}
    batches = []
    while done < len(requests):
        if load.kind == "concurrency":
            batch = requests[done:done + rows_cap]
        else:
            clock = max(clock, requests[done][1].arrival_s)
            arrived = bisect.bisect_right([r.arrival_s for _, r in requests], clock)
            batch = requests[done:min(arrived, done + rows_cap)]
        done += len(batch)
        width = max(len(r.prompt) for _, r in batch)
        prompt = np.zeros((len(batch), width), np.int32)
        for row, (_, r) in enumerate(batch):
            prompt[row, :len(r.prompt)] = r.prompt
        lengths = np.array([len(r.prompt) for _, r in batch], np.int32)
        bucket = prompt_bucket(width, config.max_seq_len)
        longest = max(r.max_tokens for _, r in batch)
        new = max(longest, min(-(-longest // spec["static_round"]) * spec["static_round"],
                               config.max_seq_len - bucket))
        _, prefill_s = timed(prompt, lengths, 1)
        out, total_s = timed(prompt, lengths, new)
        tokens = np.asarray(out.tokens)
        if not (np.asarray(out.counts) == new).all():
            raise BenchError(f"static_generate: a row stopped before {new} tokens")
        prefill_s = min(prefill_s, total_s)  # two calls, two measurements: never past the whole call's end
        step = (total_s - prefill_s) / max(new - 1, 1)
        for row, (i, r) in enumerate(batch):
            results[i] = {"arrival_s": clock if load.kind == "concurrency" else r.arrival_s,
                          "token_times_s": [clock + prefill_s + k * step for k in range(r.max_tokens)],
                          "output_ids": tokens[row, :r.max_tokens].tolist()}
        cache_len = call_lengths(config, width, new)[1]
        peak["reserved"] = max(peak["reserved"], len(batch) * cache_len * token_bytes)
        peak["used"] = max(peak["used"], sum(len(r.prompt) + r.max_tokens for _, r in batch) * token_bytes)
        batches.append({"rows": len(batch), "prompt_bucket": bucket, "new_tokens": new, "prefill_s": prefill_s,
                        "total_s": total_s})
        clock += total_s
    return {"available": True, "compile_s": compile_s, "end_s": clock,
            "requests": [results[i] for i in range(len(requests))],
            "memory": {"pool_bytes": peak["reserved"], "reserved_peak_bytes": peak["reserved"],
                       "used_peak_bytes": peak["used"]},
            "settings": {"batches": batches, "static_round": spec["static_round"], "kernels": kernels.to_dict()}}


def run_hf(spec: dict) -> dict:
    """transformers' continuous batching: the manager `generate_batch` wraps, fed as the load says
    (add_request at each arrival, or a new request as one finishes), per-token timestamps recorded."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    torch.set_num_threads(spec["threads"])
    load = load_of(spec)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # where JAX runs too, on a machine with a GPU
    model = AutoModelForCausalLM.from_pretrained(spec["checkpoint"], dtype=torch.float32,
                                                 attn_implementation=spec["hf_attn"]).to(device).eval()
    longest = max(r.max_tokens for r in load.requests)
    generation = GenerationConfig(max_new_tokens=longest, do_sample=False, eos_token_id=-1, pad_token_id=0)
    # Sized like the engine's pool (the default sizes a CPU's cache from 90% of the free RAM):
    batching = ContinuousBatchingConfig(page_size=spec["page_size"], num_blocks=cache_pages(spec, load),
                                        max_batch_tokens=spec["token_budget"],
                                        max_requests_per_batch=rows_at_once(spec, load))
    peak_reserved, pool = 0, None
    start = time.perf_counter()
    with model.continuous_batching_context_manager(generation_config=generation, continuous_batching_config=batching,
                                                   block=True, timeout=60) as manager:
        def add(request: Request, name: str) -> None:
            if manager.add_request(list(request.prompt), request_id=name, max_new_tokens=request.max_tokens,
                                   record_timestamps=True, eos_token_id=-1) is None:
                raise BenchError(f"hf_generate_batch: the manager refused request {name}")

        def wait(names: set[str]) -> dict:
            results = {}
            while names - set(results):
                result = manager.get_result(timeout=1)
                if result is None and not manager.is_running():
                    raise BenchError("hf_generate_batch: the generation thread stopped")
                if result is not None and result.is_finished():
                    results[result.request_id] = result
            return results

        warmups = set()  # untimed: first-call costs, as the engine's
        for i, prompt in enumerate(warmup_prompts(spec, load)):
            add(Request(prompt, 4), f"warmup{i}")
            warmups.add(f"warmup{i}")
        wait(warmups)
        setup_s = time.perf_counter() - start
        cache = manager.batch_processor.cache
        pool = cache.num_sectors * cache.bytes_per_sector
        arrivals, results = {}, {}
        pending = collections.deque(enumerate(load.requests))
        clock = Clock()
        while pending or len(results) < len(arrivals):
            now = clock()
            while pending and (len(arrivals) - len(results) < load.concurrency if load.kind == "concurrency"
                               else pending[0][1].arrival_s <= now):
                i, request = pending.popleft()
                arrivals[f"r{i}"] = clock() if load.kind == "concurrency" else request.arrival_s
                add(request, f"r{i}")
            timeout = 0.05 if not pending or load.kind == "concurrency" else \
                min(max(pending[0][1].arrival_s - clock(), 0.0), 0.05)
            result = manager.get_result(timeout=timeout) if len(results) < len(arrivals) else None
            if result is None and len(results) < len(arrivals) and not manager.is_running():
                raise BenchError("hf_generate_batch: the generation thread stopped")
            if result is not None and result.is_finished():
                if result.error:
                    raise BenchError(f"hf_generate_batch: request {result.request_id} failed: {result.error}")
                results[result.request_id] = result
            try:  # read from this thread while the loop runs: a sample, not a lock
                peak_reserved = max(peak_reserved, pool - int(cache.compute_free_capacity(relative=False)))
            except Exception:  # noqa: BLE001 - a racing read is skipped
                pass
            if load.kind == "poisson" and len(results) == len(arrivals) and pending:
                time.sleep(max(pending[0][1].arrival_s - clock(), 0.0))
        end_s = max(clock(t) for r in results.values() for t in (r.timestamps or [r.lifespan[1]]))
    names = [f"r{i}" for i in range(len(load.requests))]
    return {"available": True, "compile_s": None, "warmup_s": setup_s, "end_s": end_s,
            "requests": [{"arrival_s": arrivals[n], "token_times_s": [clock(t) for t in results[n].timestamps],
                          "output_ids": list(results[n].generated_tokens)} for n in names],
            "memory": {"pool_bytes": pool, "reserved_peak_bytes": peak_reserved, "used_peak_bytes": None},
            "settings": {"attn_implementation": model.config._attn_implementation, "page_size": spec["page_size"],
                         "num_blocks": cache.num_blocks, "max_batch_tokens": cache.max_batch_tokens,
                         "max_requests_per_batch": rows_at_once(spec, load), "torch": torch.__version__,
                         "transformers": transformers.__version__, "threads": torch.get_num_threads(),
                         "device": device}}


# The runners, by name: each takes the spec (checkpoint, load, settings) and returns its record:
# {"available", "requests": [{"arrival_s", "token_times_s", "output_ids"}], "end_s", "compile_s",
# "memory": {"pool_bytes", "reserved_peak_bytes", "used_peak_bytes"}, "settings"}, times in seconds
# from its run's start.
def run_server(spec: dict) -> dict:
    """The engine behind `python -m train.serve`, the load sent over HTTP (bench/serve_http.py)."""
    from bench import serve_http
    load = load_of(spec)
    return serve_http.run_server(spec, load, warmup_prompts(spec, load), rows_at_once(spec, load),
                                 cache_pages(spec, load), Clock)


RUNNERS = {"engine": run_engine, "engine_guided": run_engine_guided, "server": run_server, "hf_generate_batch": run_hf,
           "static_generate": run_static, **{f"engine_lora{n}": lora_runner(n) for n in LORA_COUNTS}}
TIMING_NOTES = {
    "engine": "each token's time is the engine's `time.perf_counter()` when its step returned it",
    **{f"engine_lora{n}": f"as `engine`'s, with {n} random rank-{LORA_RANK} LoRA adapter(s) on every projection in "
                          f"{n} slot(s) (`EngineConfig.max_loras`), request i under adapter i mod {n}: its tokens "
                          "are the adapted model's, not the reference's" for n in LORA_COUNTS},
    "engine_guided": "as `engine`'s; the even requests guided by a JSON schema (an object of one string of "
                     "at least the longest output's characters), whose answers may end before their output tokens "
                     "where a token holds several characters; mask: the host's time filling the guided "
                     "rows' masks, per guided row and per step that had one",
    "server": "each token's time is when its server-sent event reached the client (the runner's process, on "
              "the same cores as the server); the server started with the engine's settings (`--max-seqs`, "
              "`--page-size`, `--num-pages`, `--token-budget`); compile s: the server's, before it was ready; "
              "held: the most pages `jaxattn_kv_pages_used` showed (/metrics read every 0.25 s); used: n/a",
    "hf_generate_batch": "transformers' per-token timestamps (`record_timestamps=True`, taken when each step's "
                         "tokens are read back); requests added through the manager's `add_request` at their "
                         "arrival, or as one finishes (fixed concurrency); its cache sized like the engine's "
                         "(page size, pages, tokens per step, requests per step); used tokens: n/a",
    "static_generate": "no per-token times: a batch's first tokens at its start + the time of a prefill-only "
                       "call (max_new_tokens=1) of the same batch, the rest evenly spaced to its end (`generate` "
                       "returns every token at its end); a call under 0.2 s is timed as the least of repeats "
                       "(`bench.timing.best_seconds`); the clock advances by the measured calls; reserved = "
                       "rows x (prompt bucket + new tokens) slots; used = each row's prompt + asked tokens",
}


def child(runner: str, spec_path: str) -> int:
    """`--runner`: one runner once; its record as JSON on the last line of stdout."""
    spec = json.loads(Path(spec_path).read_text())
    if spec["threads"] < cpu_cores() and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:spec["threads"]])  # before JAX or torch starts
    record = RUNNERS[runner](spec)
    if record["available"]:
        requests = load_of(spec).requests
        kept = range(1 if runner == "engine_guided" else 0, len(requests), 2 if runner == "engine_guided" else 1)
        check_tokens([requests[i] for i in kept], [record["requests"][i]["output_ids"] for i in kept], runner)
    print(json.dumps(record), flush=True)
    return 0


# ---------------------------------------------------------------- the driver

def parse_range(text: str, flag: str) -> tuple[int, int]:
    try:
        low, high = (int(v) for v in text.split(","))
    except ValueError:
        raise UsageError(f"{flag} takes MIN,MAX (two integers), got {text!r}") from None
    if not 1 <= low <= high:
        raise UsageError(f"{flag} needs 1 <= MIN <= MAX, got {text!r}")
    return low, high


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="baby", choices=("baby", "smollm2", "tiny"))
    parser.add_argument("--requests", type=int, default=32, help="requests per load (default %(default)s)")
    parser.add_argument("--concurrency", default="1,8,32", help="fixed-concurrency loads (default %(default)s)")
    parser.add_argument("--poisson-rate", type=float, default=2.0,
                        help="requests/s of the Poisson load; 0: none (default %(default)s)")
    parser.add_argument("--max-seqs", type=int, default=32,
                        help="requests held at once under Poisson arrivals (default %(default)s)")
    parser.add_argument("--prompt-range", default="32,512", help="prompt tokens, MIN,MAX (default %(default)s)")
    parser.add_argument("--output-range", default="32,256", help="output tokens, MIN,MAX (default %(default)s)")
    parser.add_argument("--runners", default=",".join(RUNNER_NAMES), help="comma-separated subset of %(default)s")
    parser.add_argument("--threads", type=int, default=cpu_cores(),
                        help="torch threads, and the cores every runner may use (default: the cores JAX uses, "
                             "%(default)s)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--page-size", type=int, default=16, help="cache page (block) size of the engine and HF")
    parser.add_argument("--serve-args", default="", help="more arguments for the server runner's "
                        "`python -m train.serve`, e.g. '--decode-steps 4'")
    parser.add_argument("--token-budget", type=int, default=256,
                        help="tokens per step of the engine and HF (max_batch_tokens) (default %(default)s)")
    parser.add_argument("--static-round", type=int, default=32,
                        help="static_generate runs a batch to its longest output rounded up to this")
    parser.add_argument("--kernels", default="auto", choices=("auto", "reference"),
                        help="jaxattn's kernels: resolved for this machine, or the reference")
    parser.add_argument("--paged", default="auto", choices=("auto", "gather", "ragged"),
                        help="the engine's paged attention (Kernels.paged); auto: as --kernels says")
    parser.add_argument("--hf-attn", default="sdpa", choices=("sdpa", "paged|eager"),
                        help="transformers' attention for continuous batching (default %(default)s)")
    parser.add_argument("--seed", type=int, default=SEED, help="of the load's draws")
    parser.add_argument("--data", help="Tiny Shakespeare text file (default: $JAXATTN_SHAKESPEARE, "
                                       "../shared/data/tinyshakespeare.txt, or the cache)")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="where the checkpoints are written once (default: ~/.cache/jaxattn/bench-serve)")
    parser.add_argument("--out", type=Path, default=RESULTS / "serve", help="writes OUT.json and OUT.md")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per runner process")
    parser.add_argument("--guide-tokenizer", metavar="FILE", help="engine_guided: the guides' tokenizer, a GGUF "
                        "file's or a tokenizer.json (default: the corpus's characters, the load's ids)")
    parser.add_argument("--runner", choices=tuple(RUNNERS), help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)  # a bad flag: argparse's usage and one error line, status 2
    for name in ("requests", "max_seqs", "threads", "repeats", "page_size", "token_budget", "static_round"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1")
    if args.poisson_rate < 0:
        raise UsageError("--poisson-rate must be >= 0")
    try:
        args.concurrency = [int(c) for c in args.concurrency.split(",") if c]
    except ValueError:
        raise UsageError(f"--concurrency takes comma-separated integers, got {args.concurrency!r}") from None
    if any(c < 1 for c in args.concurrency):
        raise UsageError("every --concurrency must be at least 1")
    if not args.concurrency and not args.poisson_rate:
        raise UsageError("no load: give --concurrency or a --poisson-rate above 0")
    args.prompt_range = parse_range(args.prompt_range, "--prompt-range")
    args.output_range = parse_range(args.output_range, "--output-range")
    args.runners = [r for r in args.runners.split(",") if r]
    unknown = [r for r in args.runners if r not in RUNNERS]
    if unknown or not args.runners:
        raise UsageError(f"--runners: unknown {unknown or 'none given'} (choose from {', '.join(RUNNERS)})")
    longest = args.prompt_range[1] + args.output_range[1]
    if args.runner is None and longest > MAX_SEQ_LEN[args.model]:
        raise UsageError(f"the longest prompt + output ({longest}) is over the {args.model} model's "
                         f"max_seq_len {MAX_SEQ_LEN[args.model]}")
    if args.runner is not None and not args.spec:
        raise UsageError("--runner needs --spec")
    return args


def run_runner(name: str, spec_path: Path, threads: int, timeout: float) -> dict:
    done = fresh.run([sys.executable, Path(__file__), "--runner", name, "--spec", spec_path], what=name,
                     env=fresh.environment(threads), timeout=timeout)
    record = done.json()
    record["process_wall_s"], record["peak_rss_bytes"] = done.wall_s, done.peak_rss_bytes
    return record


def reference_runner(runners: list[str]) -> str:
    """The runner whose tokens the others' are compared with: static_generate where it runs, else the first."""
    return "static_generate" if "static_generate" in runners else runners[0]


def agreement(records: dict[str, dict], runners: list[str]) -> dict[str, int]:
    """Per runner: how many requests got the same tokens as the reference runner (the first of `runners`
    that ran, static_generate where it did)."""
    ran = [name for name in runners if records.get(name, {}).get("available")]
    if not ran:
        return {}
    reference = records["static_generate" if "static_generate" in ran else ran[0]]
    ids = [r["output_ids"] for r in reference["requests"]]
    ran = {name: records[name] for name in ran}
    return {name: sum(a["output_ids"] == b for a, b in zip(r["requests"], ids)) for name, r in ran.items()}


def measure_load(load: Load, args, checkpoint: Path, scratch: Path, unavailable: dict) -> dict:
    """Every runner on one load, --repeats times in turns; medians and each repeat's figures."""
    spec = {"checkpoint": str(checkpoint), "threads": args.threads, "max_seqs": args.max_seqs,
            "page_size": args.page_size, "token_budget": args.token_budget, "static_round": args.static_round,
            "kernels": args.kernels, "paged": args.paged, "hf_attn": args.hf_attn, "data": args.data,
            "guide_tokenizer": args.guide_tokenizer, "serve_args": args.serve_args,
            "max_model_len": args.prompt_range[1] + args.output_range[1],
            "load": {"kind": load.kind, "concurrency": load.concurrency, "rate": load.rate,
                     "requests": [asdict(r) for r in load.requests]}}
    spec_path = scratch / f"spec-{load.kind}-{load.concurrency or load.rate}.json"
    spec_path.write_text(json.dumps(spec))
    runs = {name: [] for name in args.runners}
    failures, settings, memory, compile_s, same, guides, step_ms = {}, {}, {}, {}, {}, {}, {}
    load_before = load_average()
    for repeat in range(args.repeats):
        order = args.runners if repeat % 2 == 0 else args.runners[::-1]
        records = {}
        for name in order:
            if name in unavailable or name in failures:
                continue
            print(f"{load.name}: {name}, repeat {repeat + 1} of {args.repeats}", file=sys.stderr, flush=True)
            try:
                record = run_runner(name, spec_path, args.threads, args.timeout)
            except fresh.FreshProcessError as err:
                failures[name] = str(err)
                continue
            if not record["available"]:
                unavailable[name] = record["reason"]
                continue
            records[name] = record
            runs[name].append(metrics(record))
            settings[name] = record.get("settings")
            memory.setdefault(name, []).append(record["memory"])
            if "guides" in record and record["guides"]["masked_rows"]:
                guides.setdefault(name, []).append(record["guides"])
            compile_s.setdefault(name, []).append(record.get("compile_s"))
            if record.get("step_ms"):
                step_ms.setdefault(name, []).append({**record["step_ms"], "steps": record["steps"]})
        for name, count in agreement(records, args.runners).items():
            same.setdefault(name, []).append(count)
    rows = []
    for name in args.runners:
        row = {"load": load.name, "runner": name}
        if name in unavailable:
            row["unavailable"] = unavailable[name]
        elif name in failures:
            row["failed"] = failures[name]
        if runs[name]:
            peaks = memory[name]
            row.update(median=median_metrics(runs[name]), repeats=runs[name], settings=settings[name],
                       compile_s=median([c for c in compile_s[name] if c is not None]),
                       memory={key: max((m[key] for m in peaks if m.get(key) is not None), default=None)
                               for key in ("pool_bytes", "reserved_peak_bytes", "used_peak_bytes")},
                       same_tokens_as_reference=min(same.get(name, [0])), requests=len(load.requests))
            if name in step_ms:  # each phase's median over the repeats
                row["step_ms"] = {key: median([r[key] for r in step_ms[name]]) for key in step_ms[name][0]}
            if name in guides:
                g = guides[name]
                row["mask"] = {"per_row_s": median([r["mask_seconds"] / r["masked_rows"] for r in g]),
                               "per_guided_step_s": median([r["mask_seconds"] / r["guided_steps"] for r in g]),
                               "rows_per_guided_step": median([r["masked_rows"] / r["guided_steps"] for r in g]),
                               "late_fraction": median([r["masks_late"] / r["guided_steps"] for r in g])}
        rows.append(row)
        if "median" in row:
            print(json.dumps({k: row[k] for k in ("load", "runner", "median", "memory")}), flush=True)
    return {"load": load.name, "kind": load.kind, "concurrency": load.concurrency, "rate": load.rate,
            "load_average": load_before, "rows": rows}


def median(values):
    return statistics.median(values) if values else None


def load_description(args, requests: list[Request]) -> str:
    prompts = [len(r.prompt) for r in requests]
    outputs = [r.max_tokens for r in requests]
    return (f"{len(requests)} requests from Tiny Shakespeare (seed {args.seed}): prompt tokens uniform on "
            f"[{args.prompt_range[0]}, {args.prompt_range[1]}] (drawn: mean {statistics.mean(prompts):.0f}, "
            f"{min(prompts)}-{max(prompts)}), output tokens uniform on [{args.output_range[0]}, "
            f"{args.output_range[1]}] (drawn: mean {statistics.mean(outputs):.0f}, {min(outputs)}-{max(outputs)}, "
            f"{sum(outputs):,} in all); ids: each character's index in the sorted set of the text's 65 characters")


def fmt(value, scale: float = 1.0, spec: str = ",.0f") -> str:
    return "–" if value is None else format(value * scale, spec)


def markdown(record: dict) -> str:
    meta = record["meta"]
    mib = 1 / 2 ** 20
    lines = [f"# Serving: {', '.join(meta['runners'])}", "",
             f"Model `{meta['model']}` ({meta['checkpoint']['architecture']}, "
             f"{meta['checkpoint']['params'] / 1e6:.2f}M "
             f"params, random init, float32) on {meta['machine_line']}; {meta['threads']} thread(s)/core(s) per runner "
             f"(torch threads = the cores JAX uses), each runner in a fresh process per load and repeat, in turns; "
             f"medians of {meta['repeats']}; jaxattn kernels {meta['kernels']}. Greedy, EOS ignored (every request "
             f"generates exactly its output tokens: checked).", "",
             f"Load: {meta['load']}. Fixed concurrency: C requests in flight, the next added as one ends. Poisson: "
             f"arrivals at the rate, the first at 0; at most {meta['max_seqs']} requests held at once. Engine and HF: "
             f"pages of {meta['page_size']} tokens, enough for every held request to reach {meta['max_model_len']} "
             f"tokens; {meta['token_budget']} tokens per step.", "",
             "TTFT: arrival to first token; ITL: the gaps between a request's consecutive tokens, pooled; tokens/s: "
             "output tokens over first arrival to last token. Cache MiB: the pool allocated / the most held at once "
             f"/ the most holding tokens. \"same tokens\": requests whose tokens equal {meta['reference']}'s.", "",
             "| load | runner | output tok/s | req/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms "
             "| cache pool / held / used MiB | compile s | same tokens |", "|" + " --- |" * 11]
    for load in record["loads"]:
        for row in load["rows"]:
            if "median" not in row:
                why = row.get("unavailable") or row.get("failed") or "not run"
                state = "unavailable" if "unavailable" in row else "failed"
                lines.append(f"| {row['load']} | {row['runner']} | {state}: {why} |" + " |" * 8)
                continue
            m, mem = row["median"], row["memory"]
            cache = " / ".join(fmt(mem[k], mib, ",.1f") if mem[k] is not None else "n/a"
                               for k in ("pool_bytes", "reserved_peak_bytes", "used_peak_bytes"))
            lines.append(f"| {row['load']} | {row['runner']} | {fmt(m['output_tokens_per_s'])} "
                         f"| {fmt(m['requests_per_s'], 1, ',.2f')} | {fmt(m['ttft_p50_s'], 1e3, ',.1f')} "
                         f"| {fmt(m['ttft_p99_s'], 1e3, ',.1f')} | {fmt(m['itl_p50_s'], 1e3, ',.2f')} "
                         f"| {fmt(m['itl_p99_s'], 1e3, ',.2f')} | {cache} | {fmt(row['compile_s'], 1, ',.1f')} "
                         f"| {row['same_tokens_as_reference']} of {row['requests']} |")
    for load in record["loads"]:
        for row in load["rows"]:
            if "mask" in row:
                mask = row["mask"]
                lines += ["", f"{row['load']}, {row['runner']}: the host filled the guided rows' masks in "
                              f"{mask['per_row_s'] * 1e6:,.0f} us per row, {mask['per_guided_step_s'] * 1e3:,.2f} ms per "
                              f"step with guided rows ({mask['rows_per_guided_step']:.1f} guided rows a step), while the "
                              f"step's forward ran: it had already ended when the masks were ready in "
                              f"{mask['late_fraction']:.0%} of those steps; "
                              f"{row['median']['output_tokens']:,} output tokens (the guided may end early)."]
    steps = [row for load in record["loads"] for row in load["rows"] if row.get("step_ms")]
    if steps:
        lines += ["", "Where an engine step's time goes (`Engine.clock`, `jaxattn.serving.step_clock`), ms per step of "
                      "the timed run: host = every phase but the wait for the device; on a CPU the device's work is the "
                      "model's arithmetic on the same cores.", "",
                  "| load | runner | steps | host | device | schedule | inputs | dispatch | outputs | update |",
                  "|" + " --- |" * 10]
        for row in steps:
            ms = row["step_ms"]
            lines.append(f"| {row['load']} | {row['runner']} | {ms['steps']:,.0f} | " + " | ".join(
                f"{ms[key]:.2f}" for key in ("host", "device", "schedule", "inputs", "dispatch", "outputs", "update"))
                + " |")
    lines += lora_table(record)
    lines += ["", "How each runner's times are taken:", ""]
    lines += [f"* `{name}`: {TIMING_NOTES[name]}." for name in meta["runners"]]
    loads = [f"{load['load']} {load['load_average']}" for load in record["loads"] if load["load_average"] is not None]
    if loads:
        lines += ["", f"1-minute load average as each load started: {', '.join(loads)} ({meta['cores']} cores)."]
    lines += ["", f"Command: `{meta['command']}`", ""]
    return "\n".join(lines)


def lora_table(record: dict) -> list[str]:
    """The engine's output tokens/s with N adapters in slots against none (`engine`), per load: the lines of
    a table, or none where no engine_lora<N> runner ran beside `engine`."""
    lines = []
    for load in record["loads"]:
        rows = {row["runner"]: row["median"]["output_tokens_per_s"] for row in load["rows"] if "median" in row}
        counts = [n for n in LORA_COUNTS if f"engine_lora{n}" in rows]
        if "engine" not in rows or not counts:
            continue
        lines += ["", f"{load['load']}: LoRA adapters in slots (rank {LORA_RANK}, every projection, mixed evenly "
                      "among the requests) against the same requests with none, output tokens/s:", "",
                  "| adapters | output tok/s | / no adapter |", "| ---: | ---: | ---: |",
                  f"| 0 | {fmt(rows['engine'], 1, ',.1f')} | 1.00x |"]
        lines += [f"| {n} | {fmt(rows[f'engine_lora{n}'], 1, ',.1f')} | "
                  f"{rows[f'engine_lora{n}'] / rows['engine']:.2f}x |" for n in counts]
    return lines


def drive(args, argv: list[str]) -> int:
    from bench.machine import describe_machine, limits_prefix, machine_line
    text = corpus_path(args.data).read_text(encoding="utf-8")
    requests = draw_requests(text_ids(text), args.requests, args.prompt_range, args.output_range, args.seed)
    loads = make_loads(requests, args.concurrency, args.poisson_rate, args.seed)
    checkpoint, facts = ensure_checkpoint(args.model, args.cache_dir or default_cache_dir())
    from jaxattn.kernels import resolve_kernels
    kernels = resolve_kernels()[0].to_dict() if args.kernels == "auto" else "reference"
    if args.paged != "auto":
        kernels = {**kernels, "paged": args.paged} if isinstance(kernels, dict) else f"reference, paged={args.paged}"
    unavailable: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as scratch:
        results = [measure_load(load, args, checkpoint, Path(scratch), unavailable) for load in loads]
    machine = describe_machine()
    command = " ".join([limits_prefix(machine["isa_limits"]) + "PYTHONPATH=$PWD python bench/serve.py",
                        *(a if not a.startswith("/") else "/path/to/" + Path(a).name for a in argv)])
    meta = {"machine": machine, "machine_line": machine_line(machine), "cores": cpu_cores(), "threads": args.threads,
            "model": args.model, "checkpoint": facts, "runners": args.runners, "repeats": args.repeats,
            "load": load_description(args, requests), "prompt_range": args.prompt_range,
            "output_range": args.output_range, "requests": args.requests, "seed": args.seed,
            "max_seqs": args.max_seqs, "page_size": args.page_size, "token_budget": args.token_budget,
            "max_model_len": args.prompt_range[1] + args.output_range[1], "static_round": args.static_round,
            "kernels": kernels, "hf_attn": args.hf_attn, "command": command,
            "reference": reference_runner(args.runners),
            "timing_notes": {name: TIMING_NOTES[name] for name in args.runners}}
    record = {"meta": meta, "loads": results}
    write_results(args.out.parent, args.out.name, record, markdown(record))
    failed = [f"{row['runner']} ({row['load']}): {row['failed']}" for load in results for row in load["rows"]
              if "failed" in row]
    if failed:
        raise BenchError(f"{len(failed)} run(s) failed, the first: {failed[0]}")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = parse_args(argv)
        return child(args.runner, args.spec) if args.runner else drive(args, argv)
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 1
    except Exception as err:  # noqa: BLE001 - one line, never a traceback
        print(f"error: {type(err).__name__}: {err}" if not isinstance(err, BenchError) else f"error: {err}",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
