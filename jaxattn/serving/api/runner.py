"""The engine on a thread of its own, and what crosses between it and the server's event loop.

The engine (`jaxattn.serving.Engine`) is not thread-safe and its `step()` runs for tens to
hundreds of milliseconds, so one thread owns it: it takes commands (add a request, cancel one)
from a queue between steps, steps while anything is unfinished, and hands each request's new
tokens and text to that request's `Ticket` on the event loop (`loop.call_soon_threadsafe`). The
HTTP handlers only ever touch tickets.

* `submit(...)` -> a `Ticket`; `await ticket.admitted()` raises what `Engine.add_request` raised: a
  `jaxattn.serving.validation.RequestError` (a 400) or `jaxattn.serving.scheduler.QueueFull` (a 429,
  more than `EngineConfig.max_waiting` requests waiting): the engine decides both. `submit_choices(...)`
  -> one ticket per sequence of n choices (`Engine.add_choices`), admitted or refused together.
* `cancel(ticket)`: the request ends at the next step (a client that went away).
* `call(fn)`: runs `fn()` on the engine's thread between two steps (work that uses the device beside
  the engine, e.g. an embedding) and returns a future of its result.
* `drain()`: refuse new requests (`Draining`, a 503); `cancel_all()` ends what is left.
* A step that raises is logged with the ids of the requests it held; those requests end with an
  error (a 500) and the thread goes on serving the requests that come next.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from typing import Callable

from jaxattn.serving import Engine, Request, SamplingParams
from jaxattn.serving.validation import check_choices

log = logging.getLogger("jaxattn.serving.api")


class Draining(Exception):
    """The server is shutting down and takes no new requests."""


@dataclasses.dataclass
class Update:
    """What one step gave a request: its new tokens and text, and whether and why it ended; with
    log-probabilities asked, the new tokens' (`(logprob, top)` each) and, once, the prompt's (one
    `(logprob, top)` per prompt token, `(None, None)` for the first: `Request.prompt_logprobs`)."""

    tokens: list[int]
    text: str
    finish_reason: str | None = None  # "stop", "length", "cancelled", "error", or None while it runs
    error: str | None = None  # why it ended with "error" (a guide's dead end: 400; else 500)
    logprobs: list[tuple[float, tuple]] | None = None
    prompt_logprobs: list[tuple[float | None, tuple | None]] | None = None


class Ticket:
    """One request as the event loop sees it: `await admitted()`, then `await next()` until it ends."""

    def __init__(self, tag: str, prompt_ids: list[int], sampling: SamplingParams, loop: asyncio.AbstractEventLoop):
        self.tag, self.prompt_ids, self.sampling, self.loop = tag, prompt_ids, sampling, loop
        self.request: Request | None = None
        self._admitted: concurrent.futures.Future = concurrent.futures.Future()
        self._updates: asyncio.Queue[Update] = asyncio.Queue()
        self.ended = False
        self.prompt_scored = False  # its prompt's log-probabilities were handed out

    async def admitted(self) -> None:
        await asyncio.wrap_future(self._admitted)

    async def next(self) -> Update:
        return await self._updates.get()

    def _put(self, update: Update) -> None:  # on the engine's thread
        if update.finish_reason is not None:
            self.ended = True
        try:
            self.loop.call_soon_threadsafe(self._updates.put_nowait, update)
        except RuntimeError:  # the event loop has closed (a forced exit): nobody is listening
            pass


class EngineRunner:
    """The thread that owns `engine` (see the module docstring).

    Args:
      engine: a compiled `Engine` (its `EngineConfig.max_waiting` bounds the queue).
      on_step: called on the engine's thread after each step with `(engine, requests that ended)`.
      on_tokens: called on the engine's thread with `(request, index of its first new token)` when
        a step gave it tokens (their times are `request.token_times`).
    """

    def __init__(self, engine: Engine, *, on_step: Callable | None = None,
                 on_tokens: Callable[[Request, int], None] | None = None):
        self.engine = engine
        self.on_step, self.on_tokens = on_step, on_tokens
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._tickets: dict[int, Ticket] = {}  # by engine request id
        self._wake = threading.Event()
        self._stop = False
        self.draining = False
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)

    # -- from the event loop ------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=30)

    def submit(self, tag: str, prompt_ids: list[int], sampling: SamplingParams) -> Ticket:
        if self.draining:
            raise Draining("the server is shutting down")
        ticket = Ticket(tag, prompt_ids, sampling, asyncio.get_running_loop())
        self._send(("add", ticket))
        return ticket

    def submit_choices(self, tag: str, prompt_ids: list[int], sampling: SamplingParams, *, n: int,
                       best_of: int | None = None) -> list[Ticket]:
        """One ticket per sequence (`best_of`, or `n`), in choice order; each `admitted()` raises the same.
        A RequestError at once for `n` or `best_of` out of range."""
        if self.draining:
            raise Draining("the server is shutting down")
        loop = asyncio.get_running_loop()
        count = check_choices(n, best_of)
        tickets = [Ticket(f"{tag}-{i}" if count > 1 else tag, prompt_ids, sampling, loop) for i in range(count)]
        # One sequence is a plain request (`Engine.add_request`): what every engine, stand-ins too, takes.
        self._send(("add", tickets[0]) if count == 1 else ("add_choices", (tickets, n, best_of)))
        return tickets

    def cancel(self, ticket: Ticket) -> None:
        if not ticket.ended:
            self._send(("cancel", ticket))

    def call(self, fn: Callable[[], object]) -> concurrent.futures.Future:
        """A future of `fn()`, run on the engine's thread between two steps (`Draining` once draining)."""
        if self.draining:
            raise Draining("the server is shutting down")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._send(("call", (fn, future)))
        return future

    def drain(self) -> None:
        """New requests are refused from now on."""
        self.draining = True

    def cancel_all(self) -> None:
        self._send(("cancel_all", None))

    @property
    def busy(self) -> bool:
        """Requests are queued, waiting or running."""
        return bool(self._tickets) or not self._commands.empty()

    def _send(self, command) -> None:
        self._commands.put(command)
        self._wake.set()

    # -- on the engine's thread ---------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop:
            try:
                self._take_commands()
                if not self.engine.has_unfinished():
                    self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                self._publish(self.engine.step())
            except Exception as err:  # noqa: BLE001: the server stays up; these requests end with a 500
                self._failed_step(err)

    def _take_commands(self) -> None:
        while True:
            try:
                command, ticket = self._commands.get_nowait()
            except queue.Empty:
                return
            if command == "add":
                self._add(ticket)
            elif command == "add_choices":
                self._add_choices(*ticket)
            elif command == "cancel" and ticket.request is not None:
                self.engine.cancel(ticket.request)
            elif command == "call":
                self._call(*ticket)
            elif command == "cancel_all":
                for held in list(self._tickets.values()):
                    self.engine.cancel(held.request)

    @staticmethod
    def _call(fn: Callable[[], object], future: concurrent.futures.Future) -> None:
        try:
            future.set_result(fn())
        except Exception as err:  # noqa: BLE001: the caller's to answer (a ValueError a 400, the rest a 500)
            future.set_exception(err)

    def _add(self, ticket: Ticket) -> None:
        if self.draining:
            ticket._admitted.set_exception(Draining("the server is shutting down"))
            return
        try:
            ticket.request = self.engine.add_request(ticket.prompt_ids, ticket.sampling)
        except Exception as err:  # noqa: BLE001: RequestError a 400, QueueFull a 429, anything else a 500
            ticket._admitted.set_exception(err)
            return
        self._tickets[ticket.request.id] = ticket
        ticket._admitted.set_result(None)

    def _add_choices(self, tickets: list[Ticket], n: int, best_of: int | None) -> None:
        first = tickets[0]
        try:
            if self.draining:
                raise Draining("the server is shutting down")
            requests = self.engine.add_choices(first.prompt_ids, first.sampling, n=n, best_of=best_of)
            if len(requests) != len(tickets):
                raise ValueError(f"{len(tickets)} tickets for {len(requests)} sequences")
        except Exception as err:  # noqa: BLE001: as `_add`: every ticket of the request is refused alike
            for ticket in tickets:
                ticket._admitted.set_exception(err)
            return
        for ticket, request in zip(tickets, requests):
            ticket.request = request
            self._tickets[request.id] = ticket
            ticket._admitted.set_result(None)

    def _publish(self, touched: list[Request]) -> None:
        ended = []
        for request in touched:
            ticket = self._tickets.get(request.id)
            if ticket is None:
                continue
            tokens, text = request.take_new()
            if self.on_tokens is not None and tokens:
                self.on_tokens(request, len(request.output_ids) - len(tokens))
            ticket._put(Update(tokens, text, request.finish_reason, error=request.error,
                               **_logprobs(ticket, request, len(tokens))))
            if request.finished:
                ended.append(request)
                del self._tickets[request.id]
        if self.on_step is not None:
            self.on_step(self.engine, ended)

    def _failed_step(self, err: Exception) -> None:
        held = [t.tag for t in self._tickets.values()]
        log.exception("a step failed (requests %s): %s", ", ".join(held) or "none", err)
        message = f"internal error in the step holding this request ({type(err).__name__})"
        for ticket in list(self._tickets.values()):
            self.engine.cancel(ticket.request)
            ticket._put(Update([], "", "error", error=message))
        self._tickets.clear()
        time.sleep(0.05)  # a step that fails at once again must not spin the thread


def _logprobs(ticket: Ticket, request: Request, new: int) -> dict:
    """An update's log-probabilities (on the engine's thread): the `new` tokens' when the request asks,
    and the prompt's once it is computed (a token drawn, or the request ended)."""
    out = {}
    if request.sampling.logprobs is not None:
        start = len(request.output_ids) - new
        out["logprobs"] = list(zip(request.output_logprobs[start:], request.output_top_logprobs[start:]))
    if request.sampling.prompt_logprobs is not None and not ticket.prompt_scored and (new or request.finished):
        ticket.prompt_scored = True
        out["prompt_logprobs"] = list(zip(request.prompt_logprobs, request.prompt_top_logprobs))
    return out
