"""The continuous-batching engine: many requests share one model and one paged KV cache.

    engine = Engine(params, config, EngineConfig(max_seqs=32))  # compiles every step program
    request = engine.add_request(prompt_ids, SamplingParams(temperature=0.0, max_tokens=64))
    while engine.has_unfinished():
        engine.step()                # one forward over every running sequence
        tokens, text = request.take_new()

`Engine` is the facade the HTTP server and Python callers use; the work is done by four parts, each a
module with one job (vLLM V1's split, read for its shape):

* `jaxattn.serving.validation`: every check of a request (`add_request` runs it);
* `jaxattn.serving.scheduler.Scheduler`: admission (first come, first served), the queue's limit,
  the token budget, preemption by recompute; `schedule()` says what a step computes, `update()` hands
  out what it drew;
* `jaxattn.serving.kv_cache_manager.KVCacheManager`: each request's pages (prefix-cache hits on
  admission, a page per page of tokens, full pages keyed, pages behind a sliding window given back);
* `jaxattn.serving.model_runner.ModelRunner`: the parameters and pools where they run, the compiled
  step programs, a scheduled step turned into their arrays and run.

One `step()` is `schedule()`, `execute()`, `update()`; with `EngineConfig.overlap` (the default) the next
plain decode step is scheduled and queued before a step's tokens are read, fed them on the device, so
the host's part of a step runs while the device computes the one before (vLLM V1's asynchronous
scheduling). Greedy tokens are those of `jaxattn.generate`
on each prompt alone, whatever else runs (docs/theory.md §25).

A guided request (`SamplingParams.guide`) is compiled here (`jaxattn.serving.structured`); the model
runner fills each guided row's mask of allowed tokens on the host and the step program applies it
before the draw; the scheduler advances the guide by each token drawn and ends the request when the
guide is complete.

When every running row only decodes, one `step()` may run several decode steps in one program call
(`EngineConfig.decode_steps`, by default 8 on an accelerator and 1 on a CPU: `jaxattn.serving.multi_step`);
the tokens are those of one step at a time.

Speculative decoding (`EngineConfig.speculative`, or a draft model: `draft`): when every running row
decodes, rows propose drafts (`jaxattn.serving.speculation`) and one step verifies each row's last token and its drafts
(`jaxattn.serving.verify`); a row emits its kept drafts and one token of its own. Greedy tokens are those
of one step at a time; `speculator` holds the counters (vLLM's spec-decode metrics).

LoRA adapters (`EngineConfig.max_loras` > 0; `jaxattn.serving.loras`): `add_lora(name, params)` keeps one,
`remove_lora(name)` forgets it (refused while requests name it), `SamplingParams(lora=name)` runs a
request with it. Rows of different adapters share every step; each request's greedy tokens are those of
its adapter merged into the base (`jaxattn.lora.merge_lora`) alone.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Callable

import jax
import numpy as np
from jax.sharding import Mesh

from jaxattn.cache.build import cache_bytes_per_token
from jaxattn.config import ModelConfig
from jaxattn.kernels import Kernels, call_kernels
from jaxattn.lora import is_slots
from jaxattn.program_store import ProgramStore
from jaxattn.serving import validation
from jaxattn.serving.engine_config import EngineConfig
from jaxattn.serving.kv_cache_manager import KVCacheManager, local_window
from jaxattn.serving.kv_memory import available_bytes, pool_plan
from jaxattn.serving.loras import HostAdapter, LoraTable
from jaxattn.serving.model_runner import ModelRunner
from jaxattn.serving.requests import Request, SamplingParams
from jaxattn.serving.scheduler import Scheduler
from jaxattn.serving.speculation import Speculator
from jaxattn.serving.step_clock import StepClock
from jaxattn.serving.structured import GuideCompiler
from jaxattn.speculative import DraftProposer, NgramProposer

class Engine:
    """Continuous batching over a paged KV cache (see the module docstring).

    Args:
      params: `DecoderLM(config)` parameters.
      config: the model.
      engine_config: rows, pages, budget, buckets, the queue's limit.
      kernels: which implementations run the model (`kernels.paged` the paged attention). None: the
        reference, except that a quantized model's matmuls take the platform's fast path, its weights
        laid out for it once here (`jaxattn.kernels.call_kernels`); `Kernels()`: the reference throughout.
      mesh: a device mesh (`jaxattn.axes.make_mesh`): parameters laid out by `jaxattn.axes.RULES`,
        the pools split over kv heads (tensor parallelism over heads); tokens equal one device's.
      detokenize: ids -> text, for streamed text and stop strings (None: tokens only).
      seed: the generator of seeds for requests that give none.
      progress: called `(done, total, shape)` as each step program compiles.
      guide_compiler: compiles requests' guides for the model's tokenizer and fills their masks
        (`jaxattn.serving.structured.GuideCompiler`); None: a guided request is refused.
      draft: a draft model for speculative decoding (`jaxattn.speculative.DraftProposer`, the target's
        vocabulary; its `k` the most drafts per row), instead of `EngineConfig.speculative`'s prompt lookup.
      store: where the step programs are kept traced between runs (`jaxattn.program_store`); None: beside
        the program cache this process enabled (`jaxattn.program_cache.enable`), else nowhere.

    Attributes:
      scheduler, kv_cache_manager, model_runner: the parts; `stats` their counters (steps, tokens,
        prefix hits, preemptions, pages given back behind a window).
      pool: the KV pool's size and why (`jaxattn.serving.kv_memory.PoolPlan`: a size given, or the
        smaller of the full need and a share of the memory available).
      speculator: speculative decoding's drafts and counters (`EngineConfig.speculative`; None: off).
      steps_per_call, steps_reason: the most decode steps one program call runs, and why
        (`EngineConfig.steps_per_call`).
    """

    def __init__(self, params, config: ModelConfig, engine_config: EngineConfig = EngineConfig(), *,
                 kernels: Kernels | None = None, mesh: Mesh | None = None,
                 detokenize: Callable[[list[int]], str] | None = None, seed: int = 0,
                 progress: Callable | None = None, guide_compiler: GuideCompiler | None = None,
                 store: ProgramStore | None = None, draft: DraftProposer | None = None):
        if not isinstance(config, ModelConfig):
            raise TypeError(f"config must be a ModelConfig, got {type(config).__name__}")
        if not isinstance(engine_config, EngineConfig):
            raise TypeError(f"engine_config must be an EngineConfig, got {type(engine_config).__name__}")
        if engine_config.max_loras and mesh is not None:
            raise ValueError("EngineConfig.max_loras needs one device (mesh=None): LoRA slots are not laid out "
                             "over a mesh")
        ec = self.engine_config = engine_config
        kernels, params = call_kernels(params, kernels, on_mesh=mesh is not None)
        self.detokenize, self.stats = detokenize, collections.Counter()
        self.max_model_len = min(ec.max_model_len or config.max_seq_len, config.max_seq_len)
        self.token_bytes = cache_bytes_per_token(config, ec.kv_cache)["bytes"]
        device = mesh.devices.flat[0] if mesh is not None else jax.devices()[0]
        # Checked against the memory there is before any of it is taken (`jaxattn.serving.kv_memory`).
        self.pool = pool_plan(ec, self.token_bytes, self.max_model_len, available_bytes(device), device.platform)
        num_pages = self.pool.pages
        self.kv_cache_manager = KVCacheManager(num_pages, ec.page_size, prefix_caching=ec.prefix_caching,
                                               window=local_window(config), stats=self.stats)
        self.steps_per_call, self.steps_reason = ec.steps_per_call(device.platform)
        proposer = _proposer(ec, draft, config)
        self.clock = StepClock()  # where the steps' time goes (jaxattn.serving.step_clock)
        self.model_runner = ModelRunner(params, config, ec, num_pages=num_pages, max_model_len=self.max_model_len,
                                        kernels=kernels, mesh=mesh, progress=progress,
                                        guide_compiler=guide_compiler, store=store, max_steps=self.steps_per_call,
                                        max_drafts=None if proposer is None else proposer.k)
        runner = self.model_runner
        self.loras = LoraTable(ec.max_loras, ec.max_lora_rank, runner.write_slot,
                                runner.check_adapter) if ec.max_loras else None
        self.speculator = None if proposer is None else Speculator(proposer, rows=ec.max_seqs,
                                                                   capacity=self.max_model_len, adaptive=ec.adaptive_k)
        if self.speculator is not None:
            self.speculator.warm_up()
        self.scheduler = Scheduler(ec, self.kv_cache_manager, self.max_model_len, self.stats, self.steps_per_call,
                                   self.loras, self.speculator)
        self.guide_compiler = guide_compiler
        self.limits = validation.RequestLimits(config.vocab_size, self.max_model_len, num_pages, ec.page_size,
                                               detokenizer=detokenize is not None,
                                               guides=guide_compiler is not None,
                                               token_history=self.kv_cache_manager.window is None)
        self._rng = np.random.default_rng(seed)
        self._in_flight = None  # a step queued on the device, its tokens not yet read (`EngineConfig.overlap`)

    # -- requests -----------------------------------------------------------------------------

    def add_request(self, prompt_ids, sampling: SamplingParams = SamplingParams()) -> Request:
        """Queues a request (first come, first served) and returns it; its tokens stream out as steps run.

        `validation.RequestError` (a ValueError naming the parameter) for an empty prompt, ids outside
        the vocabulary, a prompt plus `max_tokens` longer than `max_model_len` or the pool, or stop
        strings without a detokenizer, a guide that does not compile (param "guide"), an adapter not held
        (`sampling.lora`: `jaxattn.serving.loras.UnknownLora`, param "lora");
        `scheduler.QueueFull` past `EngineConfig.max_waiting`.
        """
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        ids, max_tokens = validation.check_request(prompt_ids, sampling, self.limits)
        adapter = self._adapter(sampling.lora)
        self.scheduler.check_room()
        guide_state = None if sampling.guide is None else self.guide_compiler.start(sampling.guide)
        if max_tokens != sampling.max_tokens:  # None: the rest of the context, now known
            sampling = dataclasses.replace(sampling, max_tokens=max_tokens)
        seed = int(self._rng.integers(2**31)) if sampling.seed is None else sampling.seed % 2**31
        request = Request(ids, sampling, seed, self.detokenize)
        request.guide_state = guide_state
        request.cache_root = b"" if adapter is None else adapter.cache_root
        self.scheduler.add(request)
        return request

    def add_choices(self, prompt_ids, sampling: SamplingParams = SamplingParams(), *, n: int = 1,
                    best_of: int | None = None) -> list[Request]:
        """Queues `best_of` (None: `n`) sequences of one prompt and returns them; `best` picks the n to answer.

        Choice i draws with seed `s + i` (`s` the request's seed, or one the engine draws), so a seeded
        choice equals a solo request with that seed. The prompt is computed once: the first choice
        leads, and the others are admitted once it has computed the prompt's full pages, which the
        prefix cache then shares with them: each computes only the prompt's tokens past the last full
        page of all but its last token (1 to `page_size` tokens). With `best_of > n` every sequence sums its drawn tokens' raw
        log-probabilities (`Request.cumulative_logprob`). RequestError naming `n` or `best_of` out of
        range (`validation.check_choices`), or what `add_request` refuses.
        """
        count = validation.check_choices(n, best_of)
        self.scheduler.check_room(count)  # all of them queue, or none
        seed = int(self._rng.integers(2**31)) if sampling.seed is None else sampling.seed
        requests = []
        for i in range(count):
            choice = dataclasses.replace(sampling, seed=(seed + i) % 2**31)
            request = self.add_request(prompt_ids, choice) if not requests else self._sibling(requests[0], choice)
            request.wants_logprob = count > n
            requests.append(request)
        return requests

    def _sibling(self, leader: Request, sampling: SamplingParams) -> Request:
        """Another choice of `leader`'s prompt (already checked), admitted after it has computed it."""
        request = Request(leader.prompt_ids, sampling, sampling.seed, self.detokenize)
        request.guide_state = None if sampling.guide is None else self.guide_compiler.start(sampling.guide)
        request.leader = leader if self.kv_cache_manager.allocator.prefix_caching else None
        request.cache_root = leader.cache_root
        self.scheduler.add(request)
        return request

    @staticmethod
    def best(requests: list[Request], n: int) -> list[Request]:
        """The `n` finished sequences of highest cumulative log-probability, highest first (vLLM's best_of)."""
        return sorted(requests, key=lambda r: r.cumulative_logprob, reverse=True)[:n]

    def cancel(self, request: Request) -> None:
        """Ends a request: it is dropped from the queue, or its pages are given back at the next step."""
        self.scheduler.cancel(request)

    def has_unfinished(self) -> bool:
        return self._in_flight is not None or self.scheduler.has_unfinished()

    # -- LoRA adapters ------------------------------------------------------------------------

    def add_lora(self, name: str, adapter_params) -> None:
        """Keeps adapter `name` (a params tree with `LoraWeight`s: `jaxattn.hf.peft.load_adapter`'s,
        `jaxattn.lora.add_lora`'s, on this model's layers unrolled) for requests that name it: written into a free
        slot, else kept on the host until a request needs it. Compiles nothing. ValueError: no slots
        (`EngineConfig.max_loras` 0), a name not a non-empty str, a name already held
        (`jaxattn.serving.loras.LoraExists`), an adapter that does not fit the slots (its rank above
        `max_lora_rank`, a projection `lora_targets` leaves out: the message names the weight)."""
        if self.loras is None:
            raise ValueError("this engine has no LoRA slots: EngineConfig.max_loras is 0")
        self.loras.add(name, adapter_params)

    def remove_lora(self, name: str) -> None:
        """Forgets adapter `name` and empties its slot. `jaxattn.serving.loras.UnknownLora` (a ValueError)
        for a name not held; `LoraInUse` (a ValueError) while requests running or waiting name it: the
        caller stops sending them and removes it once they end (see `jaxattn.serving.loras`)."""
        if self.loras is None:
            raise ValueError("this engine has no LoRA slots: EngineConfig.max_loras is 0")
        self.loras.remove(name, self.scheduler.in_use(name))

    @property
    def lora_names(self) -> tuple[str, ...]:
        """The adapters held, in the order added (a snapshot other threads may read)."""
        return () if self.loras is None else self.loras.names

    def _adapter(self, name: str | None) -> HostAdapter | None:
        """The adapter a request names (None for none); `UnknownLora` for one not held."""
        if name is None:
            return None
        if self.loras is None:
            raise validation.RequestError(f"lora {name!r}: this engine has no LoRA slots (max_loras 0)",
                                          param="lora", code="model_not_found")
        return self.loras.get(name)

    # -- steps --------------------------------------------------------------------------------

    def step(self) -> list[Request]:
        """Schedules, runs one compiled step (or, when every row only decodes, one call of several decode
        steps), hands out the tokens; returns the requests that got any or ended (cancelled ones included).
        With `EngineConfig.overlap`, the next plain decode step is queued before this one's tokens are
        read (it takes them on the device), and the next `step()` starts from it. `clock` adds up where
        the steps' time went."""
        clock, started = self.clock, time.perf_counter()
        step_started = started
        running, self._in_flight = self._in_flight, None
        if running is None:
            output = self.scheduler.schedule()
            if output.empty:  # not a step: not counted
                return output.ended
            if output.steps > 1 or output.drafts:
                clock.seconds["schedule"] += time.perf_counter() - started
                ended = self._verify(output) if output.drafts else self._run(output)
                self._time_step(output, started, output.steps)
                return ended
            running = self.model_runner.dispatch(output, clock)
            started = time.perf_counter()
        ahead = self.scheduler.schedule_ahead(running.output) if self.engine_config.overlap else None
        clock.seconds["schedule"] += time.perf_counter() - started
        if ahead is not None:  # queued behind `running` before its tokens are read: the host works meanwhile
            self._in_flight = self.model_runner.dispatch(ahead, clock, after=running)
            self.stats["overlapped_steps"] += 1
        tokens, finite, logprobs = self.model_runner.collect(running, clock)
        with clock.phase("update"):
            ended = self.scheduler.update(running.output, tokens, finite, logprobs)
        clock.steps += 1
        self._time_step(running.output, step_started)
        return ended

    def _time_step(self, output, started: float, steps: int = 1) -> None:
        """A decode-only step's wall time a step, for the speculator's choice of k (what drafting costs here)."""
        if self.speculator is not None and output.decode and not output.prefill:
            self.speculator.observe(len(output.decode), max(map(len, output.drafts), default=0),
                                    (time.perf_counter() - started) / steps)

    def _run(self, output) -> list[Request]:
        """A multi-step call (`jaxattn.serving.multi_step`), read back at its end."""
        tokens, finite, logprobs = self.model_runner.execute_run(output, self.clock)
        with self.clock.phase("update"):
            ended = self.scheduler.update_run(output, tokens, finite, logprobs)
        self.clock.steps += max(map(len, tokens), default=1)
        return ended

    def _verify(self, output) -> list[Request]:
        """A verification step (`jaxattn.serving.verify`): each row's kept drafts and its own token."""
        tokens, finite, logprobs = self.model_runner.execute_verify(output, self.clock)
        with self.clock.phase("update"):
            ended = self.scheduler.update_verify(output, tokens, finite, logprobs)
        self.clock.steps += 1
        return ended

    def run(self) -> None:
        """Steps until every request has finished."""
        while self.has_unfinished():
            self.step()

    def generate(self, prompts, sampling: SamplingParams = SamplingParams()) -> list[list[int]]:
        """Adds every prompt, runs to the end, returns each one's output ids (in order)."""
        requests = [self.add_request(p, sampling) for p in prompts]
        self.run()
        return [r.output_ids for r in requests]

    # -- what it holds ------------------------------------------------------------------------

    def memory(self) -> dict:
        """The cache's memory: the pool, the pages held (reserved) and the tokens they hold (used)."""
        allocator, page_bytes = self.allocator, self.page_size * self.token_bytes
        return {"pool_bytes": allocator.num_pages * page_bytes,
                "pages_total": allocator.num_pages, "pages_in_use": allocator.in_use,
                "pages_cached": allocator.cached, "reserved_bytes": allocator.in_use * page_bytes,
                "used_bytes": self.kv_cache_manager.tokens_held(self.running) * self.token_bytes,
                "running": len(self.running), "waiting": len(self.waiting)}

    # The parts' state, under the names callers used before the engine had parts.
    running = property(lambda self: self.scheduler.running, doc="The requests holding a row, in the order admitted.")
    waiting = property(lambda self: self.scheduler.waiting, doc="The queue, its head first.")
    token_budget = property(lambda self: self.scheduler.token_budget, doc="Tokens per step, decoding first.")
    allocator = property(lambda self: self.kv_cache_manager.allocator, doc="The pool (`PageAllocator`).")
    page_size = property(lambda self: self.kv_cache_manager.page_size, doc="Slots per page.")
    window = property(lambda self: self.kv_cache_manager.window,
                      doc="The widest window when every layer has one (pages behind it are given back), else None.")
    config = property(lambda self: self.model_runner.config, doc="The model (its layers unrolled).")
    kernels = property(lambda self: self.model_runner.kernels, doc="The implementations that run it.")
    params = property(lambda self: self.model_runner.params, doc="The parameters, placed (LoRA slots included).")
    base_params = property(lambda self: jax.tree.map(lambda w: w.base if is_slots(w) else w, self.params,
                                                     is_leaf=is_slots),
                           doc="The parameters without LoRA slots: the same arrays, for a forward of the base.")
    pools = property(lambda self: self.model_runner.pools, doc="Each layer's page pool, placed.")
    programs = property(lambda self: self.model_runner.programs, doc="The compiled step programs.")
    pages_per_seq = property(lambda self: self.model_runner.pages_per_seq, doc="A block table's width.")


def _proposer(ec: EngineConfig, draft: DraftProposer | None, config: ModelConfig):
    """The speculative proposer: the draft model given, else prompt lookup by `ec.speculative`, else None."""
    if draft is None:
        return None if ec.speculative is None else NgramProposer(ec.speculative)
    if ec.speculative is not None:
        raise ValueError("give a draft model or EngineConfig.speculative (prompt lookup), not both")
    if not isinstance(draft, DraftProposer):
        raise TypeError(f"draft must be a jaxattn.speculative.DraftProposer, got {type(draft).__name__}")
    if draft.vocab_size != config.vocab_size:
        raise ValueError(f"the draft model's vocabulary ({draft.vocab_size}) is not the target's ({config.vocab_size})")
    return draft
