"""The routes: plain functions over the `ApiState` the application holds (`app.state.api`).

A completion or a chat is parsed (`protocol`), its text encoded, and handed to the engine's runner as
ids and `SamplingParams`, one ticket per sequence of its `n` choices (`best_of` on completions);
whether the request is acceptable is decided once, by `jaxattn.serving.validation` (a `RequestError`,
here a 400 with its parameter and code) and the engine's scheduler (`QueueFull`, here a 429), before a
stream starts. Then the answer is streamed or collected: n choices stream their chunks with their
`index` as they come; best_of > n answers the n sequences of highest cumulative log-probability. Each
choice carries its tokens' log-probabilities where asked (`jaxattn.serving.api.logprobs` writes them;
a completion's `echo` puts the prompt's text, and its tokens' log-probabilities, first). A client that
goes away, while its request waits or while it streams, has its requests cancelled: their rows and
pages are free at the engine's next step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path
from typing import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse

from jaxattn.hf.chat_template import ChatTemplateError
from jaxattn.serving import Engine, validation
from jaxattn.serving.api import protocol, tools
from jaxattn.serving.api.logprobs import LogprobsWriter
from jaxattn.serving.api.metrics import CONTENT_TYPE
from jaxattn.serving.api.answers import Answer, usage
from jaxattn.serving.api.protocol import APIError, bad_request
from jaxattn.serving.api.runner import Draining, Ticket, Update
from jaxattn.serving.api.state import ApiState
from jaxattn.serving.guides import Guide
from jaxattn.serving.loras import UnknownLora
from jaxattn.serving.scheduler import GUIDE_DEAD_END, QueueFull

CHAT_PAGE = Path(__file__).with_name("chat.html")


def state_of(request: Request) -> ApiState:
    return request.app.state.api


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


def internal_error(tag: str) -> JSONResponse:
    """The 500 of a request that failed in the server (its traceback in the log, not the answer)."""
    return error_response(APIError(500, f"internal error (request {tag}); the server logged it"))


# -- the small routes ---------------------------------------------------------------------------

async def health(request: Request) -> Response:
    if state_of(request).runner.draining:
        return error_response(APIError(503, "the server is shutting down", code="draining"))
    return JSONResponse({"status": "ok"})


async def metrics(request: Request) -> Response:
    return Response(state_of(request).metrics.text(), media_type=CONTENT_TYPE)


async def chat_page(request: Request) -> Response:
    return HTMLResponse(CHAT_PAGE.read_text(encoding="utf-8"))


async def models(request: Request) -> Response:
    """The base and each LoRA adapter the engine holds, an adapter's `parent` the base's id (as vLLM)."""
    state = state_of(request)
    served = state.served
    card = {"id": served.name, "object": "model", "created": 0, "owned_by": "jaxattn",
            "max_model_len": served.max_model_len, "chat": served.chat_template is not None}
    adapters = [{**card, "id": name, "parent": served.name} for name in state.runner.engine.lora_names]
    return JSONResponse({"object": "list", "data": [{**card, "parent": None}, *adapters]})


# -- completions and chat -----------------------------------------------------------------------

async def completions(request: Request) -> Response:
    state = state_of(request)
    body = protocol.parse(protocol.CompletionRequest, await read_json(request, state.limits.max_body_bytes))
    check_model(state, body.model, adapters=True)
    prompt = body.single_prompt()
    echo = None
    if isinstance(prompt, str):
        validation.check_text(prompt, "prompt")
        echo = prompt
        prompt = encode(state, prompt, special=True, param="prompt")
    if body.echo and echo is None:  # the ids' text (the engine checks the ids first)
        echo = ""
    return await answer(request, Answer("completion", body.model), body, prompt, body.asked_tokens,
                        echo if body.echo else None)


async def chat(request: Request) -> Response:
    state = state_of(request)
    body = protocol.parse(protocol.ChatRequest, await read_json(request, state.limits.max_body_bytes))
    check_model(state, body.model, adapters=True)
    text, tool_plan = render_chat(state, body)
    ids = encode(state, text, special=False, param="messages")
    return await answer(request, Answer("chat", body.model, tool_plan.parse), body, ids, body.asked_tokens,
                        guide=tool_plan.guide)


# What a chat's rendering may take (a template given a client's messages once rendered 200 MB in 3.7 s):
# more characters than any prompt that fits the context could be, or more time than a render ever needs.
RENDER_CHARS, RENDER_CHARS_PER_TOKEN, RENDER_SECONDS = 2**20, 32, 5.0


def render_chat(state: ApiState, body, *, add_generation_prompt: bool = True) -> tuple[str, tools.ToolPlan]:
    """The messages (and tools) rendered by the model's chat template, and what the tools ask; a 400 where
    the model has no template, or the template or the tools refuse the request."""
    served = state.served
    if served.chat_template is None:
        raise bad_request(f"the model {served.name!r} has no chat template (chat_template.jinja, or "
                          "tokenizer_config.json's chat_template; --chat-template FILE gives one): use "
                          "/v1/completions", "messages", code="no_chat_template")
    tool_plan = tools.plan(body, served.chat_template)
    try:
        text = served.chat_template.render(tools.messages(body), add_generation_prompt=add_generation_prompt,
                                           max_chars=max(RENDER_CHARS, RENDER_CHARS_PER_TOKEN * served.max_model_len),
                                           max_seconds=RENDER_SECONDS, **tool_plan.render)
    except ChatTemplateError as err:
        raise bad_request(str(err), "messages") from None
    return text, tool_plan


ROUTES: tuple[tuple[str, str, Callable], ...] = (
    ("GET", "/health", health), ("GET", "/metrics", metrics), ("GET", "/", chat_page),
    ("GET", "/v1/models", models), ("POST", "/v1/completions", completions), ("POST", "/v1/chat/completions", chat))


def check_model(state: ApiState, name: str, *, adapters: bool = False) -> None:
    """A 404 unless `name` is the served model's, or (with `adapters`) a LoRA adapter's the engine holds."""
    if name == state.served.name or (adapters and name in state.runner.engine.lora_names):
        return
    held = (state.served.name, *state.runner.engine.lora_names) if adapters else (state.served.name,)
    raise APIError(404, f"the model {name!r} does not exist; this server serves {', '.join(map(repr, held))}",
                   param="model", code="model_not_found")


def encode(state: ApiState, text: str, *, special: bool, param: str) -> list[int]:
    """The text's ids; a 400 where the tokenizer cannot encode it (the ids are checked by the engine)."""
    try:
        return list(state.served.encode(text, special))
    except ValueError as err:
        raise bad_request(f"{param} cannot be encoded: {err}", param) from None


async def admitted(request: Request, body, ids: list[int], asked: int | None,
                   guide: Guide | None = None) -> list[Ticket]:
    """The request's sequences in the engine (one ticket each, `body.choices`), or the error it was refused
    with: RequestError a 400 naming the endpoint's field, QueueFull a 429, a drain a 503. `guide`: what a
    forced tool call must match."""
    state = state_of(request)
    n, best_of = body.choices
    lora = None if body.model == state.served.name else body.model  # an adapter's name (`check_model`)
    try:
        sampling = body.sampling(asked, state.served.stop_token_ids)
        if guide is not None:
            sampling = dataclasses.replace(sampling, guide=guide)
        sampling = dataclasses.replace(sampling, lora=lora)
        tickets = state.runner.submit_choices(request.state.tag, ids, sampling, n=n, best_of=best_of)
        for ticket in tickets:
            await ticket.admitted()
    except UnknownLora:  # unloaded since `check_model`
        raise APIError(404, f"the model {body.model!r} does not exist", param="model", code="model_not_found") from None
    except validation.RequestError as err:
        raise bad_request(str(err), body.openai_param(err.param), err.code) from None
    except QueueFull as err:
        raise APIError(429, str(err), code="queue_full") from None
    except Draining as err:
        raise APIError(503, str(err), code="draining") from None
    return tickets


class Output:
    """What one choice writes beyond its text: its log-probabilities (`writer`, None where not asked; a
    writer per choice, as a completion's text offsets run on from chunk to chunk) and, with a
    completion's `echo`, the prompt's text (`echo`, else None), written once before the choice's own."""

    def __init__(self, body, runner, kind: str, ids: list[int], echo: str | None):
        detokenize = runner.engine.detokenize if body.wants_logprobs or echo is not None else None
        self.writer = LogprobsWriter(kind, detokenize) if body.wants_logprobs else None
        self.ids = ids
        self.echo = None if echo is None else (echo or (detokenize(ids) if detokenize is not None else ""))
        self._echo_due = self.echo is not None

    def entries(self, update: Update) -> list:
        """The (id, logprob, top) of the update's tokens: the prompt's first with `echo`."""
        prompt = []
        if self.echo is not None and update.prompt_logprobs is not None:
            prompt = [(token, *scored) for token, scored in zip(self.ids, update.prompt_logprobs)]
        return prompt + [(token, *scored) for token, scored in zip(update.tokens, update.logprobs or ())]

    def piece(self, update: Update) -> tuple[str, dict | None]:
        """A streamed update's text (the echo first, once) and its tokens' `logprobs` object (None when
        not asked, or when the update has neither text nor tokens)."""
        text = (self.echo if self._echo_due else "") + update.text
        self._echo_due = False
        entries = self.entries(update)
        return text, (self.writer(entries) if self.writer is not None and (entries or text) else None)


async def answer(request: Request, shape: Answer, body, ids: list[int], asked: int | None,
                 echo: str | None = None, guide: Guide | None = None) -> Response:
    """Admits the request, then streams its answer or collects it whole (`echo`: the prompt's text, to
    write before each choice's; "" for the ids' own text; `guide`: a forced tool call's constraint)."""
    tickets = await admitted(request, body, ids, asked, guide)
    runner = state_of(request).runner
    outputs = [Output(body, runner, shape.kind, ids, echo) for _ in tickets]

    def cancel_all():
        for ticket in tickets:
            runner.cancel(ticket)

    if body.stream:
        return CancellingStream(stream(runner, tickets, shape, len(ids), body.include_usage, outputs), cancel_all,
                                media_type="text/event-stream",
                                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await whole(request, tickets, shape, len(ids), body.choices[0], outputs, cancel_all)


async def collected(ticket: Ticket, output: Output) -> tuple[str, int, Update, list]:
    """A sequence's whole text (its echo first), its token count, its last update and its logprob entries."""
    text, count, entries = [output.echo or ""], 0, []
    while True:
        update = await ticket.next()
        text.append(update.text)
        entries += output.entries(update)
        count += len(update.tokens)
        if update.finish_reason is not None:
            return "".join(text), count, update, entries


async def whole(request: Request, tickets: list[Ticket], shape: Answer, prompt_tokens: int, n: int,
                outputs: list[Output], cancel_all: Callable[[], None]) -> Response:
    """Every sequence collected, then the `n` best (all of them unless best_of > n: `Engine.best`)."""
    gone = asyncio.ensure_future(client_gone(request))  # a client that hangs up is seen at once
    collectors = [asyncio.ensure_future(collected(t, o)) for t, o in zip(tickets, outputs)]
    everything = asyncio.ensure_future(asyncio.wait(collectors))  # never raises: no gather's unretrieved error
    try:
        await asyncio.wait({everything, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not everything.done():  # the client went away first
            cancel_all()
            return Response(status_code=499)  # nobody reads it
        results = [(*c.result(), o) for c, o in zip(collectors, outputs)]
    except asyncio.CancelledError:
        cancel_all()
        raise
    finally:
        for future in (gone, everything, *collectors):
            future.cancel()  # a no-op once done; else they end with the handler
    for (_, _, update, _, _), ticket in zip(results, tickets):
        ended(update, ticket)
    if len(tickets) > n:  # best_of: the n of highest cumulative log-probability, highest first
        by_request = {t.request.id: result for t, result in zip(tickets, results)}
        results = [by_request[r.id] for r in Engine.best([t.request for t in tickets], n)]
    use = usage(prompt_tokens, sum(count for _, count, _, _, _ in results))
    choices = [shape.choice(text, update.finish_reason, None if out.writer is None else out.writer(entries), index=i)
               for i, (text, _, update, entries, out) in enumerate(results)]
    return JSONResponse(shape.whole(choices, use))


def ended(update: Update, ticket: Ticket) -> None:
    """An error for a request that did not finish: "error" (a 400 where its guide leaves the vocabulary nothing
    to write, a 500 otherwise), or a 503 when "cancelled" by a drain."""
    if update.finish_reason == "error":
        status = 400 if update.error == GUIDE_DEAD_END else 500
        raise APIError(status, f"request {ticket.tag}: {update.error or 'the model could not draw a token'}")
    if update.finish_reason == "cancelled":
        raise APIError(503, "the server shut down before this request finished", code="draining")


async def stream(runner, tickets: list[Ticket], shape: Answer, prompt_tokens: int, include_usage: bool,
                 outputs: list[Output]) -> AsyncIterator[str]:
    """The answer as server-sent events, each choice's chunks with its `index` as they come (with `echo`,
    a choice's first carries the prompt's text); an error after it began is an error event, then [DONE]."""
    count = 0
    pending: dict[asyncio.Future, int] = {}
    try:
        if shape.kind == "chat":
            for index in range(len(tickets)):
                yield sse(shape.chunk(None, role=True, index=index))
        pending = {asyncio.ensure_future(t.next()): i for i, t in enumerate(tickets)}
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in sorted(done, key=pending.get):
                index, update = pending.pop(future), future.result()
                count += len(update.tokens)
                text, logprobs = outputs[index].piece(update)
                for chunk in shape.text_chunks(text, logprobs, index=index):
                    yield sse(chunk)
                if update.finish_reason is None:
                    pending[asyncio.ensure_future(tickets[index].next())] = index
                    continue
                try:
                    ended(update, tickets[index])
                except APIError as err:
                    yield sse(err.body())
                    yield "data: [DONE]\n\n"
                    return
                for chunk in shape.last_chunks(update.finish_reason, index=index):
                    yield sse(chunk)
        if include_usage:
            yield sse(shape.usage_chunk(usage(prompt_tokens, count)))
        yield "data: [DONE]\n\n"
    finally:  # the client went away (the task is cancelled), or the stream ended
        for future in pending:
            future.cancel()
        for ticket in tickets:
            runner.cancel(ticket)


class CancellingStream(StreamingResponse):
    """A stream that cancels its request however the response ends (the client went away, the stream
    ended): a client gone before the first chunk leaves a generator that never started, whose own
    `finally` would never run, so the cancel is here."""

    def __init__(self, content, on_close: Callable[[], None], **kwargs):
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


# -- reading a request --------------------------------------------------------------------------

async def read_json(request: Request, limit: int):
    """The body as JSON; 413 past `limit` bytes (counted as it arrives), 400 when it is not JSON."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the body is {int(declared):,} bytes, more than the {limit:,} this server takes")
    body = bytearray()
    async for piece in request.stream():
        body += piece
        if len(body) > limit:
            raise APIError(413, f"the body is more than the {limit:,} bytes this server takes")
    try:
        return json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise bad_request(f"the body is not valid JSON: {err}") from None
    except RecursionError:  # the decoder recurses once per level of nesting
        raise bad_request("the body nests arrays or objects too deeply to read") from None


async def client_gone(request: Request) -> None:
    """Returns when the client has hung up (ASGI's "http.disconnect", which the server sends when the
    connection closes); the request's body must have been read."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
