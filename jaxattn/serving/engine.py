"""The continuous-batching engine: many requests share one model and one paged KV cache.

    engine = Engine(params, config, EngineConfig(max_seqs=32))  # compiles every step program
    request = engine.add_request(prompt_ids, SamplingParams(temperature=0.0, max_tokens=64))
    while engine.has_unfinished():
        engine.step()                # one forward over every running sequence
        tokens, text = request.take_new()

Each `step()` schedules (`_schedule`), runs one compiled program (`jaxattn.serving.step`) and
hands each drawn token to its request:

* first come, first served: a waiting request is admitted, in arrival order, once a row is free
  (at most `max_seqs` running) and the pages its tokens need can be had; a request that cannot be
  admitted holds back the ones behind it;
* a token budget per step: every running sequence that has drawn its prompt decodes one token,
  and the rest of the budget goes to prompt chunks (at most `prefill_rows` rows of `chunk`
  tokens, one prompt taking several rows if it is alone): a long prompt is computed over several
  steps, mixed with the others' decoding, and never stalls them; a step whose prompt work is one
  short piece runs a shape of one short row (`EngineConfig.short_chunk`);
* prefix caching (`jaxattn.serving.pages`): a new prompt's full pages whose hash chain is known
  are shared, not recomputed;
* preemption by recompute: when a decoding sequence needs a page and none can be had, the newest
  running request gives its pages back and waits at the head of the queue; readmitted, it
  computes its prompt and what it had drawn as one longer prompt, and goes on. Greedy tokens stay
  those of `jaxattn.generate` on the prompt alone: the cache is exact (docs/theory.md §9, §25).

A model whose every layer has a sliding window gives back the pages that fall out of it.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time
from typing import Callable

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxattn import sharding
from jaxattn.axes import MeshShape
from jaxattn.cache.containers import KV_CACHES, PagedBatch, RowGroup
from jaxattn.cache.build import cache_bytes_per_token, init_pools
from jaxattn.scan_plan import relayout
from jaxattn.config import ModelConfig
from jaxattn.kernels import Kernels
from jaxattn.serving.pages import PageAllocator, page_keys
from jaxattn.serving.requests import Request, SamplingParams, Status
from jaxattn.serving.step import DrawKnobs, StepInputs, StepPrograms, StepShape


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """The engine's shape and memory.

    Attributes:
      max_seqs: the most requests running at once (decode rows per step).
      page_size: slots per page.
      num_pages: pages in the pool (None: enough for every running sequence to reach the
        context, `max_seqs * ceil(max_seq_len / page_size)`; or from `kv_memory_gib`).
      kv_memory_gib: the pool's size in GiB instead of `num_pages`.
      chunk: prompt tokens per prefill row per step.
      prefill_rows: prompt chunks per step.
      token_budget: tokens per step, decoding first (None: max_seqs + prefill_rows * chunk).
      decode_buckets: the decode-row counts compiled (None: 1, 4, 16, ... up to max_seqs); a
        step runs the smallest that holds its decoding sequences.
      short_chunk: a second prefill shape, one row of this many tokens (None: chunk // 8, at least
        page_size; 0: none), for a step whose prompt work is one short piece (a prompt's tail, a
        short prompt, the few tokens after a prefix-cache hit): it costs its tokens, not a full chunk.
      prefix_caching: share full prompt pages between requests.
      max_model_len: the longest sequence (prompt + output; None: the model's max_seq_len).
      kv_cache: the pages' storage: "auto" (the compute dtype) or "int8" (int8 values and a float32
        scale per token and head: about a quarter of float32's bytes, so `kv_memory_gib` holds about
        four times the pages; `jaxattn.cache.build.cache_bytes_per_token`).
    """

    max_seqs: int = 8
    page_size: int = 16
    num_pages: int | None = None
    kv_memory_gib: float | None = None
    chunk: int = 128
    prefill_rows: int = 2
    token_budget: int | None = None
    decode_buckets: tuple[int, ...] | None = None
    prefix_caching: bool = True
    max_model_len: int | None = None
    short_chunk: int | None = None
    kv_cache: str = "auto"

    def __post_init__(self):
        if self.kv_cache not in KV_CACHES:
            raise ValueError(f"EngineConfig.kv_cache must be one of {KV_CACHES}, got {self.kv_cache!r}")
        for name in ("max_seqs", "page_size", "chunk", "prefill_rows"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"EngineConfig.{name} must be a positive int, got {value!r}")
        for name in ("num_pages", "token_budget", "max_model_len"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"EngineConfig.{name} must be a positive int or None, got {value!r}")
        if self.num_pages is not None and self.kv_memory_gib is not None:
            raise ValueError("EngineConfig: give num_pages or kv_memory_gib, not both")
        if self.kv_memory_gib is not None and not self.kv_memory_gib > 0:
            raise ValueError(f"EngineConfig.kv_memory_gib must be > 0, got {self.kv_memory_gib!r}")
        if self.short_chunk is not None and (not isinstance(self.short_chunk, int) or self.short_chunk < 0):
            raise ValueError(f"EngineConfig.short_chunk must be an int >= 0 or None, got {self.short_chunk!r}")
        if self.decode_buckets is not None and (not self.decode_buckets or any(
                not isinstance(b, int) or b < 1 or b > self.max_seqs for b in self.decode_buckets)):
            raise ValueError(f"EngineConfig.decode_buckets must be ints in [1, max_seqs={self.max_seqs}], "
                             f"got {self.decode_buckets!r}")

    def prefill_shapes(self) -> tuple[tuple[int, int], ...]:
        """The (rows, chunk) prefill shapes compiled: the full one and, unless 0, one short row."""
        short = max(self.page_size, self.chunk // 8) if self.short_chunk is None else self.short_chunk
        full = (self.prefill_rows, self.chunk)
        return (full,) if short == 0 or short >= self.chunk else ((1, short), full)

    def buckets(self) -> tuple[int, ...]:
        """The decode-row counts compiled, always ending at max_seqs."""
        if self.decode_buckets is not None:
            return tuple(sorted(set(self.decode_buckets) | {self.max_seqs}))
        sizes, size = {self.max_seqs}, 1
        while size < self.max_seqs:
            sizes.add(size)
            size *= 4
        return tuple(sorted(sizes))


def _local_window(config: ModelConfig) -> int | None:
    """The widest window when every layer is local (its pages before it can be given back), else None."""
    windows = [config.layer_attention(i).window for i in range(config.num_layers)]
    return None if any(w is None for w in windows) else max(windows)


class Engine:
    """Continuous batching over a paged KV cache (see the module docstring).

    Args:
      params: `DecoderLM(config)` parameters.
      config: the model.
      engine_config: rows, pages, budget, buckets.
      kernels: which implementations run the model (`kernels.paged` the paged attention).
      mesh: a device mesh (`jaxattn.axes.make_mesh`): parameters laid out by `jaxattn.axes.RULES`,
        the pools split over kv heads (tensor parallelism over heads); tokens equal one device's.
      detokenize: ids -> text, for streamed text and stop strings (None: tokens only).
      seed: the generator of seeds for requests that give none.
      progress: called `(done, total, shape)` as each step program compiles.
    """

    def __init__(self, params, config: ModelConfig, engine_config: EngineConfig = EngineConfig(), *,
                 kernels: Kernels = Kernels(), mesh: Mesh | None = None,
                 detokenize: Callable[[list[int]], str] | None = None, seed: int = 0,
                 progress: Callable | None = None):
        if not isinstance(config, ModelConfig):
            raise TypeError(f"config must be a ModelConfig, got {type(config).__name__}")
        if not isinstance(engine_config, EngineConfig):
            raise TypeError(f"engine_config must be an EngineConfig, got {type(engine_config).__name__}")
        # A paged step runs its layers unrolled: a scan would copy each layer's pool out of the stack
        # and back on every step (`jaxattn.scan_plan`), so stacked parameters are unstacked once here.
        params, config = relayout(nn.unbox(params), config, scan_layers=False)
        ec = self.engine_config = engine_config
        self.config, self.kernels, self.detokenize = config, kernels, detokenize
        self.max_model_len = min(ec.max_model_len or config.max_seq_len, config.max_seq_len)
        self.page_size = ec.page_size
        self.pages_per_seq = -(-self.max_model_len // ec.page_size)
        self.token_bytes = cache_bytes_per_token(config, ec.kv_cache)["bytes"]
        num_pages = self._num_pages(ec)
        self.allocator = PageAllocator(num_pages, ec.page_size, prefix_caching=ec.prefix_caching)
        self.window = _local_window(config)
        self.token_budget = ec.token_budget or ec.max_seqs + ec.prefill_rows * ec.chunk
        self._rng = np.random.default_rng(seed)
        pools = init_pools(config, num_pages, ec.page_size, ec.kv_cache)
        params, pools, place = self._placed(params, pools, mesh)
        self.params, self.pools = params, pools
        shapes = [StepShape(d, 0, ec.chunk) for d in ec.buckets()]
        shapes += [StepShape(d, rows, chunk) for d in (0, *ec.buckets()) for rows, chunk in ec.prefill_shapes()]
        self.programs = StepPrograms(config, kernels, params, pools, shapes, pages_per_seq=self.pages_per_seq,
                                     num_slots=num_pages * ec.page_size, place=place, progress=progress)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self._cancelled: list[Request] = []
        self.stats = collections.Counter()

    # -- set-up -------------------------------------------------------------------------------

    def _num_pages(self, ec: EngineConfig) -> int:
        if ec.num_pages is not None:
            return ec.num_pages
        if ec.kv_memory_gib is not None:
            pages = int(ec.kv_memory_gib * 2**30 // (self.token_bytes * ec.page_size))
            if pages < self.pages_per_seq:
                raise ValueError(f"kv_memory_gib={ec.kv_memory_gib} holds {pages} pages of {ec.page_size} tokens "
                                 f"({self.token_bytes * ec.page_size} bytes each); one sequence of "
                                 f"{self.max_model_len} tokens needs {self.pages_per_seq}")
            return pages
        return ec.max_seqs * self.pages_per_seq

    def _placed(self, params, pools, mesh):
        """Params and pools on `mesh` (and a function placing each step's inputs), or as they are."""
        if mesh is None:
            return params, pools, lambda tree: tree
        shape = MeshShape.of(mesh)
        params = sharding.place(nn.unbox(params), sharding.param_layout(self.config, shape).shardings(mesh))
        specs = sharding.pool_specs(pools, self.config, shape)
        pools = sharding.place(pools, jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                                                   is_leaf=lambda x: isinstance(x, PartitionSpec)))
        replicated = NamedSharding(mesh, PartitionSpec())
        return params, pools, lambda tree: jax.device_put(tree, replicated)

    # -- requests -----------------------------------------------------------------------------

    def add_request(self, prompt_ids, sampling: SamplingParams = SamplingParams()) -> Request:
        """Queues a request (first come, first served) and returns it; its tokens stream out as steps run.

        ValueError for an empty prompt, ids outside the vocabulary, a prompt plus `max_tokens`
        longer than `max_model_len`, or stop strings without a detokenizer.
        """
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        ids = np.asarray(prompt_ids)
        if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"prompt_ids must be a non-empty sequence of ints, got {ids.dtype} {ids.shape}")
        V = self.config.vocab_size
        if ids.min() < 0 or ids.max() >= V:
            raise ValueError(f"prompt_ids must be in [0, vocab_size={V}), got range [{ids.min()}, {ids.max()}]")
        if ids.size + sampling.max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({ids.size} tokens) + max_tokens ({sampling.max_tokens}) exceeds "
                             f"max_model_len={self.max_model_len}")
        if -(-(ids.size + sampling.max_tokens) // self.page_size) > self.allocator.num_pages:
            raise ValueError(f"prompt ({ids.size}) + max_tokens ({sampling.max_tokens}) needs more pages than the "
                             f"pool holds ({self.allocator.num_pages} of {self.page_size} tokens)")
        if sampling.stop and self.detokenize is None:
            raise ValueError("stop strings need the engine's detokenizer (Engine(..., detokenize=...))")
        bad = [t for t in sampling.stop_token_ids if not 0 <= t < V]
        if bad:
            raise ValueError(f"stop_token_ids must be in [0, vocab_size={V}), got {bad}")
        seed = int(self._rng.integers(2**31)) if sampling.seed is None else sampling.seed % 2**31
        request = Request(tuple(int(t) for t in ids), sampling, seed, self.detokenize)
        self.waiting.append(request)
        return request

    def cancel(self, request: Request) -> None:
        """Ends a request: it is dropped from the queue, or its pages are given back at the next step."""
        if not request.finished:
            self._cancelled.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step -----------------------------------------------------------------------------

    def step(self) -> list[Request]:
        """Schedules, runs one compiled step, hands out the tokens; returns the requests that got one
        or ended (cancelled ones included)."""
        touched = self._drop_cancelled()
        decode, prefill = self._schedule()
        if not decode and not prefill:
            return touched
        shape = self._shape(len(decode), prefill)
        inputs = self._inputs(shape, decode, prefill)
        self.pools, drawn, finite = self.programs(shape, self.params, self.pools, inputs)
        now = time.perf_counter()
        self.stats["steps"] += 1
        self.stats["decode_tokens"] += len(decode)
        self.stats["prefill_tokens"] += sum(n for _, _, n in prefill)
        for row, request in enumerate(decode):
            self._computed(request, 1)
            self._append(request, int(drawn[row]), bool(finite[row]), now)
            touched.append(request)
        for row, (request, _, count) in enumerate(prefill):
            self._computed(request, count)
            if request.num_computed == request.num_tokens:  # the chunk reached the end: draw
                self._append(request, int(drawn[shape.decode_rows + row]), bool(finite[shape.decode_rows + row]), now)
                touched.append(request)
        return touched

    def run(self) -> None:
        """Steps until every request has finished."""
        while self.has_unfinished():
            self.step()

    def generate(self, prompts, sampling: SamplingParams = SamplingParams()) -> list[list[int]]:
        """Adds every prompt, runs to the end, returns each one's output ids (in order)."""
        requests = [self.add_request(p, sampling) for p in prompts]
        self.run()
        return [r.output_ids for r in requests]

    # -- scheduling ---------------------------------------------------------------------------

    def _schedule(self) -> tuple[list[Request], list[tuple[Request, int, int]]]:
        """This step's rows: the decoding requests (1 token each, first) and the prompt chunks
        `(request, first position, tokens)` in arrival order, within the token budget."""
        decode = [r for r in self.running if r.num_tokens - r.num_computed == 1]
        for request in list(decode):
            if request in decode:  # not preempted for an earlier one's page
                self._page_for_next(request, decode)
        self._admit()
        budget, prefill = self.token_budget - len(decode), []
        for request in list(self.running):
            left = request.num_tokens - request.num_computed
            if request in decode:
                continue
            if left == 1:  # admitted with one token to compute (its pages were taken on admission)
                decode.append(request)
                continue
            # A prompt may take several rows of one step: every row's keys are written before any row
            # attends, so a row sees the rows before it as it sees earlier steps.
            start = request.num_computed
            while left > 0 and len(prefill) < self.engine_config.prefill_rows and budget > 0:
                count = min(left, self.engine_config.chunk, budget)
                prefill.append((request, start, count))
                start, left, budget = start + count, left - count, budget - count
        return decode, prefill

    def _admit(self) -> None:
        """Admits waiting requests in order while a row is free and their pages can be had."""
        while self.waiting and len(self.running) < self.engine_config.max_seqs:
            request = self.waiting[0]
            tokens = request.tokens
            # Shared pages: full pages of every token but the last (at least one is computed, to draw from).
            keys = page_keys(tokens[:-1], self.page_size)
            hits = self.allocator.lookup(keys)
            needed = -(-len(tokens) // self.page_size) - len(hits)
            if needed > self.allocator.available:
                self.allocator.release(hits)
                self.allocator.hits -= len(hits)
                self.allocator.queries -= len(keys)
                return
            self.waiting.popleft()
            request.pages = hits + self.allocator.allocate(needed)
            request.page_keys = keys[:len(hits)]
            request.num_computed = request.num_cached_tokens = len(hits) * self.page_size
            request.status = Status.RUNNING
            self.running.append(request)
            self.stats["prefix_hit_tokens"] += request.num_cached_tokens

    def _page_for_next(self, request: Request, decode: list[Request]) -> bool:
        """Makes sure slot `num_computed` of a decoding request has a page, preempting the newest
        running requests while none can be had. False if the request itself was preempted."""
        if request.num_computed // self.page_size < len(request.pages):
            return True
        while self.allocator.available == 0:
            victim = max(self.running, key=lambda r: (r.arrival_time, r.id))
            self._preempt(victim)
            if victim in decode:
                decode.remove(victim)
            if victim is request:
                return False
        request.pages += self.allocator.allocate(1)
        return True

    def _preempt(self, request: Request) -> None:
        """Gives back every page of a running request; it waits at the head of the queue, to be recomputed."""
        self._release(request)
        self.running.remove(request)
        request.status = Status.WAITING
        request.num_preemptions += 1
        self.stats["preemptions"] += 1
        self.waiting.appendleft(request)

    def _release(self, request: Request) -> None:
        self.allocator.release([p for p in request.pages if p >= 0])
        request.pages, request.page_keys, request.num_computed = [], [], 0

    def _drop_cancelled(self) -> list[Request]:
        dropped = []
        for request in self._cancelled:
            if request.finished:
                continue
            if request in self.waiting:
                self.waiting.remove(request)
            elif request in self.running:
                self._release(request)
                self.running.remove(request)
            self._finish(request, "cancelled")
            dropped.append(request)
        self._cancelled = []
        return dropped

    # -- after a step -------------------------------------------------------------------------

    def _computed(self, request: Request, count: int) -> None:
        """`count` more tokens of the request are in its pages: key the pages that are now full and,
        past a sliding window everything has, give back the pages no query can see again."""
        request.num_computed += count
        full = request.num_computed // self.page_size
        if full > len(request.page_keys):
            parent = request.page_keys[-1] if request.page_keys else b""
            start = len(request.page_keys) * self.page_size
            new = page_keys(request.tokens[start:full * self.page_size], self.page_size, parent)
            for index, key in enumerate(new, start=len(request.page_keys)):
                if request.pages[index] >= 0:
                    self.allocator.register(request.pages[index], key)
            request.page_keys += new
        if self.window is not None:
            lowest_visible = request.num_computed - self.window + 1  # of the next query, at num_computed
            for index in range(max(lowest_visible, 0) // self.page_size):
                if request.pages[index] >= 0:
                    self.allocator.release([request.pages[index]])
                    request.pages[index] = -1
                    self.stats["pages_past_window"] += 1

    def _append(self, request: Request, token: int, finite: bool, now: float) -> None:
        request.output_ids.append(token)
        request.token_times.append(now)
        self.stats["generated_tokens"] += 1
        sampling = request.sampling
        if token in sampling.stop_token_ids:  # its text (an end-of-sequence marker) is not the output's
            self._end(request, "stop")
        elif request.text is not None and request.text.add(token):
            self._end(request, "stop")
        elif len(request.output_ids) >= sampling.max_tokens or request.num_tokens >= self.max_model_len:
            self._end(request, "length")
        elif not finite:
            self._end(request, "error")

    def _end(self, request: Request, reason: str) -> None:
        self._release(request)
        self.running.remove(request)
        self._finish(request, reason)

    def _finish(self, request: Request, reason: str) -> None:
        request.status, request.finish_reason = Status.FINISHED, reason
        if request.text is not None:
            request.text.finish()

    # -- shapes and inputs --------------------------------------------------------------------

    def _shape(self, decoding: int, prefill: list[tuple[Request, int, int]]) -> StepShape:
        """The smallest compiled shape that holds the step: decode rows, then prefill rows and chunk."""
        decode_rows = min((d for d in self.engine_config.buckets() if d >= decoding), default=0)
        if not prefill:
            return StepShape(decode_rows, 0, self.engine_config.chunk)
        rows, chunk = next((r, c) for r, c in self.engine_config.prefill_shapes()
                           if r >= len(prefill) and c >= max(n for _, _, n in prefill))
        return StepShape(0 if decoding == 0 else decode_rows, rows, chunk)

    def _block_table(self, request: Request) -> np.ndarray:
        table = np.zeros(self.pages_per_seq, np.int32)
        table[:len(request.pages)] = np.maximum(request.pages, 0)  # pages given back: never visible again
        return table

    def _inputs(self, shape: StepShape, decode: list[Request],
                prefill: list[tuple[Request, int, int]]) -> StepInputs:
        """The step's host arrays: flat tokens, positions and slots, the rows' groups, the draws' knobs."""
        inputs = StepInputs.empty(shape, self.pages_per_seq, self.allocator.num_pages * self.page_size)
        groups = iter(inputs.batch.groups)
        decode_group = next(groups) if shape.decode_rows else None
        prefill_group = next(groups, None)
        rows = [(request, request.num_computed, 1, row, row, decode_group) for row, request in enumerate(decode)]
        rows += [(request, start, count, row, shape.decode_rows + row * shape.chunk, prefill_group)
                 for row, (request, start, count) in enumerate(prefill)]
        for request, start, count, row, first, group in rows:
            positions = start + np.arange(count)
            flat = first + np.arange(count)
            inputs.tokens[flat] = request.tokens[positions[0]:positions[-1] + 1]
            inputs.batch.positions[flat] = positions
            pages = np.asarray(request.pages)[positions // self.page_size]
            inputs.batch.slots[flat] = pages * self.page_size + positions % self.page_size
            group.positions[row, :count] = positions
            group.block_table[row] = self._block_table(request)
            draw = row if group is decode_group else shape.decode_rows + row  # the row's logits
            inputs.batch.logit_tokens[draw] = flat[-1]
            knobs, sampling = inputs.knobs, request.sampling
            knobs.temperature[draw], knobs.top_k[draw], knobs.top_p[draw] = (
                sampling.temperature, sampling.top_k, sampling.top_p)
            knobs.seed[draw], knobs.position[draw] = request.seed, request.num_tokens  # the drawn token's position
        return inputs

    # -- what it holds ------------------------------------------------------------------------

    def memory(self) -> dict:
        """The cache's memory: the pool, the pages held (reserved) and the tokens they hold (used)."""
        page_bytes = self.page_size * self.token_bytes
        used_tokens = sum(r.num_computed - (sum(p < 0 for p in r.pages) * self.page_size) for r in self.running)
        return {"pool_bytes": self.allocator.num_pages * page_bytes,
                "pages_total": self.allocator.num_pages, "pages_in_use": self.allocator.in_use,
                "pages_cached": self.allocator.cached,
                "reserved_bytes": self.allocator.in_use * page_bytes, "used_bytes": used_tokens * self.token_bytes,
                "running": len(self.running), "waiting": len(self.waiting)}
