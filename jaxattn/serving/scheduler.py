"""Who runs in a step, and what happens to each request after it: admission, the queue, the budget.

`Scheduler.schedule()` returns a `SchedulerOutput`, plain data the model runner turns into a step's
arrays; `Scheduler.update(...)` takes the tokens the step drew (and the log-probabilities the rows
asked for) and moves each request on. A request that only scores its prompt (`max_tokens` 0, with
`prompt_logprobs`) ends once its prompt is computed, drawing nothing.

* First come, first served: a waiting request is admitted, in arrival order, once a row is free (at
  most `max_seqs` running) and the KV-cache manager can have the pages its tokens need; a request
  that cannot be admitted holds back the ones behind it.
* The queue's limit: more than `max_waiting` requests waiting beyond the rows the next step can fill
  and `check_room` raises `QueueFull` (the HTTP server's 429).
* A token budget per step: every running sequence that has computed its prompt decodes one token,
  and the rest of the budget goes to prompt chunks (at most `prefill_rows` rows of `chunk` tokens, one
  prompt taking several rows if it is alone): a long prompt is computed over several steps, mixed with
  the others' decoding, and never stalls them.
* Guides: `update` advances a guided request's guide by each token drawn (its mask is the model
  runner's) and ends the request ("stop") once the guide is complete. A preempted request keeps its
  guide's state: its tokens are recomputed, never drawn again.
* Preemption by recompute: when a decoding sequence needs a page and none can be had, the newest
  running request gives its pages back and waits at the head of the queue; readmitted, it computes its
  prompt and what it had drawn as one longer prompt, and goes on. Greedy tokens stay those of
  `jaxattn.generate` on the prompt alone: the cache is exact (docs/theory.md §9, §25).

* Several decode steps per program call (`jaxattn.serving.multi_step`): when every running row only
  decodes, nothing waits and no row is guided, `schedule` gives each decode row its turns (up to
  `max_steps`, no more than its `max_tokens` and the context leave, nor than the free pages hold:
  `KVCacheManager.reserve` takes them now, preempting nobody), and `update` takes each row's tokens in
  order, cut at the first that ends its request (a stop token, a stop string, `max_tokens`).
* Overlap (`schedule_ahead`): while a plain decode step runs, the next one is scheduled and queued
  behind it, its rows fed the running step's tokens on the device; `update` skips a row whose request
  the step before ended.
* A request cancelled while a step runs is dropped when the step's tokens are handed out: its row and
  pages are free for the next step.

* Speculative decoding (`EngineConfig.speculative`, `jaxattn.serving.speculation`): when no prompt chunk
  runs and no row is guided, the decode rows propose drafts (prompt lookup, each row's k adapting); a
  step where some row drafts verifies them (`SchedulerOutput.drafts`, `jaxattn.serving.verify`), its
  pages reserved, the budget counting a row's drafts and its last token, and `update_verify` hands each
  row its kept drafts and its own token, cut as a multi-step call's.
* LoRA adapters (`jaxattn.serving.loras`): a request naming an adapter is admitted once its adapter
  holds a slot: one it is in, a free one, or the least recently used one no running request's adapter
  holds (written at admission); while every slot is held by running requests' adapters it waits, as
  for pages, and holds back those behind it. A running request keeps its slot until it ends or is
  preempted.

vLLM V1's Scheduler is the model (read for its shape).
"""

from __future__ import annotations

import collections
import time

from jaxattn.serving.engine_config import EngineConfig
from jaxattn.serving.kv_cache_manager import KVCacheManager
from jaxattn.serving.loras import LoraTable
from jaxattn.serving.requests import Request, Status
from jaxattn.serving.scheduler_output import PromptChunk, SchedulerOutput
from jaxattn.serving.speculation import Speculator

# Why a guided request ends with "error" when its mask leaves nothing to draw: the request's fault (a 400).
GUIDE_DEAD_END = ("the guide allows no token of the model's vocabulary here: the vocabulary cannot write what it "
                  "asks for next")


class QueueFull(Exception):
    """More requests are waiting than `EngineConfig.max_waiting` allows."""


class Scheduler:
    """The queue, the running requests and the step's budget (see the module docstring).

    Args:
      config: rows, budget, chunks and the queue's limit.
      kv: the pages of every request.
      max_model_len: a request that reaches it ends ("length").
      stats: the engine's counters (steps, tokens, preemptions are counted here).
      max_steps: the most decode steps a program call runs (`EngineConfig.steps_per_call`).
      loras: the LoRA adapters and their slots (None: no adapters).
      speculator: the decode rows' drafts (`jaxattn.serving.speculation.Speculator`; None: no speculation).
    """

    def __init__(self, config: EngineConfig, kv: KVCacheManager, max_model_len: int, stats: collections.Counter,
                 max_steps: int = 1, loras: LoraTable | None = None, speculator: Speculator | None = None):
        self.max_steps, self.loras, self.speculator = max_steps, loras, speculator
        self.max_seqs, self.max_waiting = config.max_seqs, config.max_waiting
        self.chunk, self.prefill_rows, self.token_budget = config.chunk, config.prefill_rows, config.budget
        self.kv, self.max_model_len, self.stats = kv, max_model_len, stats
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self._cancelled: list[Request] = []

    # -- the queue ----------------------------------------------------------------------------

    def check_room(self, more: int = 1) -> None:
        """QueueFull when `more` requests (the sequences of one request's choices) would put more than
        `max_waiting` beyond the rows the next step can fill."""
        if self.max_waiting is None:
            return
        free_rows = self.max_seqs - len(self.running)
        queued = len(self.waiting) - max(free_rows, 0)  # those the next step cannot admit
        if queued + more > self.max_waiting:
            ours = f" and this request is {more} sequences" if more > 1 else ""
            raise QueueFull(f"{max(queued, 0)} requests are waiting for a row{ours}, the most this engine queues "
                            f"(max_waiting={self.max_waiting})")

    def add(self, request: Request) -> None:
        """Queues a checked request behind the others."""
        self.waiting.append(request)

    def cancel(self, request: Request) -> None:
        """Ends a request at the next `schedule()`: dropped from the queue, or its pages given back."""
        if not request.finished:
            self._cancelled.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step -----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """This step's rows: the decoding requests (1 token each, first) and the prompt chunks in arrival
        order, within the token budget; the requests cancelled since the last step have ended."""
        ended = self._drop_cancelled()
        decode = [r for r in self.running if r.num_tokens - r.num_computed == 1]
        for request in list(decode):
            if request in decode:  # not preempted for an earlier one's page
                self._page_for_next(request, decode)
        self._admit()
        prefill = self._chunks(decode)
        if prefill:
            return SchedulerOutput(decode, prefill, ended)
        drafts = self._drafts(decode)
        return SchedulerOutput(decode, [], ended, [] if drafts else self._turns(decode), drafts)

    def schedule_ahead(self, running: SchedulerOutput) -> SchedulerOutput | None:
        """The step after `running` (dispatched, its tokens not yet read), for the engine to queue before
        reading them: `running`'s decode rows, each a position further, fed on the device the tokens
        `running` draws; their next slots' pages reserved now. A row whose coming token is its last by
        `max_tokens` or the context is left out. None where the next step needs the host to have read
        `running`'s tokens: it computes prompt chunks or several steps, a request waits or was cancelled
        (the rows may change), a row is guided (its mask is the host's), or a next slot has no free page.
        A row that `running`'s token ends (a stop token or string) computes one token nobody takes. None too
        where some row may draft: its drafts are looked up in the tokens read back."""
        if (self.max_steps > 1 or self.waiting or self._cancelled or running.prefill or running.turns
                or running.drafts or any(r.guide_state is not None for r in running.decode)
                or (self.speculator is not None and self.speculator.may_draft(running.decode))):
            return None
        placed = zip(running.fed_by or range(len(running.decode)), running.decode)  # each request's row
        rows = [(row, request) for row, request in placed if not request.finished and self._left(request) >= 2]
        if not rows or any(self.kv.reserve(request, 2) < 2 for _, request in rows):
            return None
        if self.speculator is not None:
            self.speculator.plain_step([request for _, request in rows])
        return SchedulerOutput([request for _, request in rows], [], [], fed_by=[row for row, _ in rows])

    def _turns(self, decode: list[Request]) -> list[int]:
        """Each decode row's turns in a multi-step call, its pages reserved; empty when the step must be
        one: some request waits (a row may free up for it), some row is guided (its mask is the host's)."""
        if self.max_steps == 1 or self.waiting or not decode or any(r.guide_state is not None for r in decode):
            return []
        turns = [self.kv.reserve(request, min(self.max_steps, self._left(request))) for request in decode]
        return turns if max(turns) > 1 else []

    def _drafts(self, decode: list[Request]) -> list:
        """Each decode row's drafts, their slots' pages reserved; empty (a plain step) when no row drafts."""
        if self.speculator is None or not decode or any(r.guide_state is not None for r in decode):
            return []
        drafts = self.speculator.propose(decode, [self._left(r) for r in decode], self.token_budget, self.kv.reserve)
        return drafts if any(len(draft) for draft in drafts) else []

    def _left(self, request: Request) -> int:
        """The tokens a running request may still draw before `max_tokens` or the context ends it."""
        max_tokens = request.sampling.max_tokens
        by_tokens = self.max_model_len if max_tokens is None else max_tokens - len(request.output_ids)
        return max(min(by_tokens, self.max_model_len - request.num_tokens), 1)

    def _chunks(self, decode: list[Request]) -> list[PromptChunk]:
        """The prompt chunks that fit the budget beside `decode` (which gains the requests admitted with
        one token left to compute: their pages were taken on admission)."""
        budget, prefill = self.token_budget - len(decode), []
        for request in list(self.running):
            left = request.num_tokens - request.num_computed
            if request in decode:
                continue
            if left == 1:
                decode.append(request)
                continue
            # A prompt may take several rows of one step: every row's keys are written before any row
            # attends, so a row sees the rows before it as it sees earlier steps.
            start = request.num_computed
            while left > 0 and len(prefill) < self.prefill_rows and budget > 0:
                count = min(left, self.chunk, budget)
                prefill.append(PromptChunk(request, start, count))
                start, left, budget = start + count, left - count, budget - count
        return prefill

    def _admit(self) -> None:
        """Admits waiting requests in order while a row is free and their pages can be had; a sibling of
        n choices waits (holding back those behind it) while its running leader computes the prompt."""
        while self.waiting and len(self.running) < self.max_seqs:
            request = self.waiting[0]
            if (self._leader_computing(request) or not self._lora_slot(request)
                    or not self.kv.allocate_prompt(request)):
                return
            self.waiting.popleft()
            request.status = Status.RUNNING
            self.running.append(request)

    def _lora_slot(self, request: Request) -> bool:
        """The request's adapter in a slot (`request.lora_slot`; -1 without one); False when every slot is
        held by the adapter of some running request."""
        name = request.sampling.lora
        if name is None:
            return True
        slot = self.loras.acquire(name, {r.sampling.lora for r in self.running})
        if slot is None:
            self.stats["lora_slot_waits"] += 1
            return False
        request.lora_slot = slot
        return True

    def in_use(self, name: str) -> int:
        """The requests running or waiting that name adapter `name`."""
        return sum(r.sampling.lora == name for r in (*self.running, *self.waiting) if not r.finished)

    def _leader_computing(self, request: Request) -> bool:
        """The request's leader runs and has not yet keyed the full pages of its prompt (but the last
        token) that the prefix cache will share with the request."""
        leader = request.leader
        if leader is None or leader.status is not Status.RUNNING:
            return False
        return len(leader.page_keys) < (len(leader.prompt_ids) - 1) // self.kv.page_size

    def _page_for_next(self, request: Request, decode: list[Request]) -> bool:
        """Makes sure slot `num_computed` of a decoding request has a page, preempting the newest
        running requests while none can be had. False if the request itself was preempted."""
        if not self.kv.needs_page(request):
            return True
        while self.kv.available == 0:
            victim = max(self.running, key=lambda r: (r.arrival_time, r.id))
            self._preempt(victim)
            if victim in decode:
                decode.remove(victim)
            if victim is request:
                return False
        self.kv.append_page(request)
        return True

    def _preempt(self, request: Request) -> None:
        """Gives back every page of a running request; it waits at the head of the queue, to be recomputed."""
        self.kv.free(request)
        self.running.remove(request)
        request.status = Status.WAITING
        request.num_preemptions += 1
        self.stats["preemptions"] += 1
        self.waiting.appendleft(request)

    def _drop_cancelled(self) -> list[Request]:
        dropped = []
        for request in self._cancelled:
            if request.finished:
                continue
            if request in self.waiting:
                self.waiting.remove(request)
            elif request in self.running:
                self.kv.free(request)
                self.running.remove(request)
            _finish(request, "cancelled")
            dropped.append(request)
        self._cancelled = []
        return dropped

    # -- after a step -------------------------------------------------------------------------

    def update(self, output: SchedulerOutput, tokens: list[int], finite: list[bool], logprobs=None) -> list[Request]:
        """Hands the step's draws to their requests: `tokens` and `finite` hold one entry per decode
        row, then one per prompt chunk; `logprobs` (`model_runner.StepLogprobsOut`, or None) the
        log-probabilities the rows asked for. Returns the requests that got a token or ended (the
        cancelled ones included)."""
        now = time.perf_counter()
        decode, touched = output.decode, list(output.ended)
        drawn = logprobs.drawn if logprobs is not None else [None] * len(tokens)
        self.stats["steps"] += 1
        self.stats["prefill_tokens"] += sum(chunk.count for chunk in output.prefill)
        for row, request in enumerate(decode):
            if request.finished:  # scheduled ahead, and ended (or cancelled) by the step before
                continue
            self.stats["decode_tokens"] += 1
            self.kv.computed(request, 1)
            self._drawn(request, tokens[row], finite[row], now, drawn[row])
            touched.append(request)
        for row, (request, _, count) in enumerate(output.prefill, start=len(decode)):
            self.kv.computed(request, count)
            for position, scored in (logprobs.prompt[row - len(decode)] if logprobs is not None else ()):
                request.score_prompt(position, scored)
            if request.num_computed == request.num_tokens:  # the chunk reached the end: draw
                self._drawn(request, tokens[row], finite[row], now, drawn[row])
                touched.append(request)
        return _with(touched, self._drop_cancelled())

    def update_run(self, output: SchedulerOutput, tokens: list[list[int]], finite: list[list[bool]],
                   logprobs: list[list] | None = None) -> list[Request]:
        """Hands a multi-step call's draws to their requests: per decode row its tokens in order (and
        whether each was drawn from finite logits, its log-probabilities or None), taken until one ends
        the request; the rest are dropped. Returns the requests that got a token or ended."""
        self.stats["steps"] += max(map(len, tokens), default=0)
        self.stats["multi_step_calls"] += 1
        return self._take_runs(output, tokens, finite, logprobs)

    def update_verify(self, output: SchedulerOutput, tokens: list[list[int]], finite: list[list[bool]],
                      logprobs: list[list] | None = None) -> list[Request]:
        """Hands a verification step's tokens to their requests (per decode row its kept drafts and its own
        token, as `update_run` takes them) and tells the speculator what each row kept."""
        self.stats["steps"] += 1
        self.stats["verify_steps"] += 1
        self.speculator.steps += 1
        for row, request in enumerate(output.decode):
            if not request.finished:
                self.speculator.record(request, len(output.drafts[row]), len(tokens[row]) - 1)
        return self._take_runs(output, tokens, finite, logprobs)

    def _take_runs(self, output: SchedulerOutput, tokens, finite, logprobs) -> list[Request]:
        now, touched = time.perf_counter(), list(output.ended)
        for row, request in enumerate(output.decode):
            for turn, token in enumerate(tokens[row]):
                if request.finished or request in self._cancelled:
                    break
                self.kv.computed(request, 1)
                self.stats["decode_tokens"] += 1
                self._drawn(request, token, finite[row][turn], now, logprobs[row][turn] if logprobs else None)
            touched.append(request)
        return _with(touched, self._drop_cancelled())

    def _drawn(self, request: Request, token: int, finite: bool, now: float, logprobs) -> None:
        """A request's prompt and output are computed and a token was drawn: taken, or, for a request
        that only scores its prompt (`max_tokens` 0), the request ends there."""
        if request.sampling.max_tokens == 0:
            self._end(request, "length")
            return
        request.add_token(token, now, logprobs)
        self.stats["generated_tokens"] += 1
        sampling = request.sampling
        # The guide sees every token drawn from its mask, and none from a row with nothing to draw from.
        guide_end = request.guide_state.advance(token) if request.guide_state is not None and finite else None
        if token in sampling.stop_token_ids:  # its text (an end-of-sequence marker) is not the output's
            self._end(request, "stop")
        elif request.text is not None and request.text.add(token):
            self._end(request, "stop")
        elif guide_end is not None:  # "stop": the guide is complete; "error": it refused the token
            request.error = None if guide_end == "stop" else f"the guide refused token {token}"
            self._end(request, guide_end)
        elif len(request.output_ids) >= sampling.max_tokens or request.num_tokens >= self.max_model_len:
            self._end(request, "length")
        elif not finite:
            request.error = GUIDE_DEAD_END if request.guide_state is not None else "the model's logits were not finite"
            self._end(request, "error")

    def _end(self, request: Request, reason: str) -> None:
        self.kv.free(request)
        self.running.remove(request)
        _finish(request, reason)


def _with(touched: list[Request], ended: list[Request]) -> list[Request]:
    """`touched` and the requests of `ended` it lacks."""
    return touched + [request for request in ended if request not in touched]


def _finish(request: Request, reason: str) -> None:
    request.status, request.finish_reason = Status.FINISHED, reason
    if request.text is not None:
        request.text.finish()
