"""The HTTP side: an OpenAI-compatible API over an `EngineRunner`, on FastAPI.

Every answer other than 200 is an OpenAI error body (`protocol.APIError`), unknown routes and
methods included; an exception no handler expected is logged with the request's id and answered
with a 500, and the server goes on. A client that goes away, while its request waits or while it
streams, has its request cancelled: its row and pages are free at the engine's next step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
from pathlib import Path
from typing import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxattn.hf.chat_template import ChatTemplate, ChatTemplateError
from train.server import protocol
from train.server.metrics import CONTENT_TYPE, ServerMetrics
from train.server.protocol import Answer, APIError, bad_request
from train.server.runner import Draining, EngineRunner, QueueFull, Ticket, Update

log = logging.getLogger("train.serve")
CHAT_PAGE = Path(__file__).with_name("chat.html")


@dataclasses.dataclass
class ServedModel:
    """What the API serves: the engine's model under a name, its text codec and its chat template.

    Attributes:
      name: the model id clients send (`--served-model-name`).
      encode: text -> ids; `encode(text, special)` adds the tokenizer's own special tokens (a BOS)
        when `special` (a completion's prompt), not for a rendered chat, whose template writes them.
      vocab_size: ids a prompt may hold.
      max_model_len: the longest prompt + output.
      stop_token_ids: the end-of-sequence ids that end every request.
      chat_template: None: chat is refused with a 400 (completions still work).
    """

    name: str
    encode: Callable[[str, bool], list[int]]
    vocab_size: int
    max_model_len: int
    stop_token_ids: tuple[int, ...] = ()
    chat_template: ChatTemplate | None = None


@dataclasses.dataclass
class Limits:
    api_key: str | None = None
    max_body_bytes: int = 4 * 2**20


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


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


async def client_gone(request: Request) -> None:
    """Returns when the client has hung up (ASGI's "http.disconnect", which the server sends when the
    connection closes); the request's body must have been read."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def create_app(runner: EngineRunner, served: ServedModel, metrics: ServerMetrics, limits: Limits = Limits()
               ) -> FastAPI:
    """The FastAPI application (routes in the module docstring of train.serve)."""
    app = FastAPI(title="jaxattn", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.ready = True

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError):
        return error_response(err)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException):
        if err.status_code == 404:
            return error_response(APIError(404, f"no route {request.method} {request.url.path}", code="not_found"))
        return error_response(APIError(err.status_code, str(err.detail)))

    @app.exception_handler(Exception)
    async def _internal(request: Request, err: Exception):  # outside KeyAndTag, which answers the rest
        tag = getattr(request.state, "tag", "-")
        log.exception("request %s failed: %s", tag, err)
        return internal_error(tag)

    app.add_middleware(KeyAndTag, api_key=limits.api_key)

    @app.get("/health")
    async def health():
        if runner.draining:
            return error_response(APIError(503, "the server is shutting down", code="draining"))
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def _metrics():
        return Response(metrics.text(), media_type=CONTENT_TYPE)

    @app.get("/")
    async def chat_page():
        return HTMLResponse(CHAT_PAGE.read_text(encoding="utf-8"))

    @app.get("/v1/models")
    async def models():
        card = {"id": served.name, "object": "model", "created": 0, "owned_by": "jaxattn",
                "max_model_len": served.max_model_len, "chat": served.chat_template is not None}
        return JSONResponse({"object": "list", "data": [card]})

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = protocol.parse(protocol.CompletionRequest, await read_json(request, limits.max_body_bytes))
        check_model(body.model)
        prompt = body.single_prompt()
        ids = encode(prompt, special=True, param="prompt") if isinstance(prompt, str) else check_ids(prompt)
        return await answer(request, Answer("completion", served.name), body, ids, body.max_tokens or 16)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = protocol.parse(protocol.ChatRequest, await read_json(request, limits.max_body_bytes))
        check_model(body.model)
        if served.chat_template is None:
            raise bad_request(f"the model {served.name!r} has no chat template (chat_template.jinja, or "
                              "tokenizer_config.json's chat_template; --chat-template FILE gives one): use "
                              "/v1/completions", "messages", code="no_chat_template")
        try:
            text = served.chat_template.render(body.plain_messages(), add_generation_prompt=True)
        except ChatTemplateError as err:
            raise bad_request(str(err), "messages") from None
        ids = encode(text, special=False, param="messages")
        return await answer(request, Answer("chat", served.name), body, ids, body.asked_tokens)

    def check_model(name: str) -> None:
        if name != served.name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {served.name!r}",
                           param="model", code="model_not_found")

    def encode(text: str, *, special: bool, param: str) -> list[int]:
        try:
            ids = list(served.encode(text, special))
        except ValueError as err:
            raise bad_request(f"{param} cannot be encoded: {err}", param) from None
        if not ids:
            raise bad_request(f"{param} encodes to no tokens", param)
        return ids

    def check_ids(ids: list[int]) -> list[int]:
        bad = [t for t in ids if not 0 <= t < served.vocab_size]
        if bad:
            raise bad_request(f"prompt token ids must be in [0, {served.vocab_size}), got {bad[:5]}", "prompt")
        return ids

    async def answer(request: Request, shape: Answer, body, ids: list[int], asked: int | None):
        room = served.max_model_len - len(ids)
        if asked is None:  # chat without max_tokens: up to the context
            if room < 1:
                raise bad_request(f"the prompt is {len(ids)} tokens; the context is {served.max_model_len}",
                                  "messages", code="context_length_exceeded")
            asked = room
        elif len(ids) + asked > served.max_model_len:
            raise bad_request(f"the prompt ({len(ids)} tokens) plus max_tokens ({asked}) is more than the "
                              f"context, {served.max_model_len} tokens", "max_tokens", code="context_length_exceeded")
        try:
            sampling = body.sampling(asked, served.stop_token_ids)
            ticket = runner.submit(request.state.tag, ids, sampling)
        except Draining as err:
            raise APIError(503, str(err), code="draining") from None
        except ValueError as err:
            raise bad_request(str(err)) from None
        try:
            await ticket.admitted()
        except QueueFull as err:
            raise APIError(429, str(err), code="queue_full") from None
        except Draining as err:
            raise APIError(503, str(err), code="draining") from None
        except ValueError as err:
            raise bad_request(str(err)) from None
        if body.stream:
            return CancellingStream(stream(ticket, shape, len(ids), body.include_usage), lambda: runner.cancel(ticket),
                                    media_type="text/event-stream",
                                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await whole(request, ticket, shape, len(ids))

    async def whole(request: Request, ticket: Ticket, shape: Answer, prompt_tokens: int) -> JSONResponse:
        text, count = [], 0
        gone = asyncio.ensure_future(client_gone(request))  # a client that hangs up is seen at once
        try:
            while True:
                next_update = asyncio.ensure_future(ticket.next())
                await asyncio.wait({next_update, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not next_update.done():  # the client went away first
                    next_update.cancel()
                    runner.cancel(ticket)
                    return Response(status_code=499)  # nobody reads it
                update = next_update.result()
                text.append(update.text)
                count += len(update.tokens)
                if update.finish_reason is not None:
                    break
        except asyncio.CancelledError:
            runner.cancel(ticket)
            raise
        finally:
            gone.cancel()
        ended(update, ticket)
        return JSONResponse(shape.whole("".join(text), update.finish_reason, protocol.usage(prompt_tokens, count)))

    def ended(update: Update, ticket: Ticket) -> None:
        """A 500 or 503 for a request that did not finish ("error", or "cancelled" by a drain)."""
        if update.finish_reason == "error":
            raise APIError(500, update.error or f"request {ticket.tag}: the model's logits were not finite")
        if update.finish_reason == "cancelled":
            raise APIError(503, "the server shut down before this request finished", code="draining")

    async def stream(ticket: Ticket, shape: Answer, prompt_tokens: int, include_usage: bool) -> AsyncIterator[str]:
        count = 0
        try:
            if shape.kind == "chat":
                yield sse(shape.chunk(None, role=True))
            while True:
                update = await ticket.next()
                count += len(update.tokens)
                if update.text:
                    yield sse(shape.chunk(update.text))
                if update.finish_reason is not None:
                    break
            try:
                ended(update, ticket)
            except APIError as err:
                yield sse(err.body())
                yield "data: [DONE]\n\n"
                return
            yield sse(shape.chunk(None, update.finish_reason))
            if include_usage:
                yield sse(shape.usage_chunk(protocol.usage(prompt_tokens, count)))
            yield "data: [DONE]\n\n"
        finally:  # the client went away (the task is cancelled), or the stream ended
            runner.cancel(ticket)

    return app


class CancellingStream(StreamingResponse):
    """A stream that cancels its request however the response ends: a client gone before the first
    chunk leaves a generator that never started, whose own `finally` would never run."""

    def __init__(self, content, on_close: Callable[[], None], **kwargs):
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


class KeyAndTag:
    """ASGI middleware: a request id (`request.state.tag`, named in logs and 500s) for every request,
    and with an API key, a 401 for a `/v1/` request without it (`/health`, `/metrics` and the page
    stay open). Plain ASGI, not `BaseHTTPMiddleware`, so that streams and disconnects pass through.

    An exception no handler took becomes the 500 here, and goes no further: Starlette's outermost
    middleware would send the same 500 and then raise again, and uvicorn then closes the connection,
    which a client that keeps connections (the openai client, retrying a 500 on the same connection)
    may find reset. Once a response has begun (a stream) nothing can be answered: it is raised."""

    def __init__(self, app, api_key: str | None):
        self.app, self.api_key = app, api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope.setdefault("state", {})["tag"] = protocol.new_id("req")
        if self.api_key is not None and scope["path"].startswith("/v1/") and not self._allowed(scope):
            err = APIError(401, "a missing or wrong API key (Authorization: Bearer KEY)", code="invalid_api_key")
            return await error_response(err)(scope, receive, send)
        started = False

        async def watched(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)
        try:
            return await self.app(scope, receive, watched)
        except Exception as err:  # noqa: BLE001: every failure is answered, and logged with its traceback
            if started:
                raise
            tag = scope["state"]["tag"]
            log.exception("request %s failed: %s", tag, err)
            return await internal_error(tag)(scope, receive, send)

    def _allowed(self, scope) -> bool:
        given = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        scheme, _, key = given.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(key.strip().encode(), self.api_key.encode())


def internal_error(tag: str):
    """The 500 of a request that failed in the server (its traceback in the log, not the answer)."""
    return error_response(APIError(500, f"internal error (request {tag}); the server logged it"))


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
