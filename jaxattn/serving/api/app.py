"""The FastAPI application: the routes (`jaxattn.serving.api.handlers`) over one `ApiState`, its error
answers and its middleware.

Every answer other than 200 is an OpenAI error body (`protocol.APIError`), unknown routes and
methods included; an exception no handler expected is logged with the request's id and answered
with a 500, and the server goes on.
"""

from __future__ import annotations

import hmac
import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxattn.serving.api import adapters, answers, embeddings, handlers, protocol, tokens
from jaxattn.serving.api.handlers import error_response, internal_error
from jaxattn.serving.api.metrics import ServerMetrics
from jaxattn.serving.api.protocol import APIError
from jaxattn.serving.api.runner import EngineRunner
from jaxattn.serving.api.state import ApiState, Limits, ServedModel
from jaxattn.serving.validation import RequestError

__all__ = ["ApiState", "KeyAndTag", "Limits", "ServedModel", "create_app"]
log = logging.getLogger("jaxattn.serving.api")


async def api_error(request: Request, err: APIError) -> JSONResponse:
    return error_response(err)


async def request_error(request: Request, err: RequestError) -> JSONResponse:
    """A request `jaxattn.serving.validation` refused: a 400 with its parameter and code (handlers that
    know their endpoint's own field names rename the parameter first)."""
    return error_response(protocol.bad_request(str(err), err.param, err.code))


async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
    """Starlette's own errors (an unknown route, a method a route lacks) in OpenAI's shape."""
    if err.status_code == 404:
        return error_response(APIError(404, f"no route {request.method} {request.url.path}", code="not_found"))
    return error_response(APIError(err.status_code, str(err.detail)))


async def unexpected(request: Request, err: Exception) -> JSONResponse:
    """A failure no handler expected, outside `KeyAndTag` (which answers the rest): logged, a 500."""
    tag = getattr(request.state, "tag", "-")
    log.exception("request %s failed: %s", tag, err)
    return internal_error(tag)


def create_app(runner: EngineRunner, served: ServedModel, metrics: ServerMetrics, limits: Limits = Limits()
               ) -> FastAPI:
    """The FastAPI application: `handlers.ROUTES` over one `ApiState` (routes in train.serve's docstring)."""
    app = FastAPI(title="jaxattn", docs_url=None, redoc_url=None, openapi_url=None)  # no pages of its own
    app.state.ready = True
    app.state.api = ApiState(runner, served, metrics, limits)
    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestError, request_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)
    app.add_middleware(KeyAndTag, api_key=limits.api_key)
    for method, path, handler in handlers.ROUTES + tokens.ROUTES + embeddings.ROUTES + adapters.ROUTES:
        app.add_api_route(path, handler, methods=[method], response_model=None)
    return app


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
        scope.setdefault("state", {})["tag"] = answers.new_id("req")
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
