"""`POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` (vLLM's): LoRA adapters loaded into a running server.

A request whose `model` is an adapter's name runs with it (`jaxattn.serving.api.handlers.check_model`);
`/v1/models` lists each with `parent` the base's id. Both routes are under `/v1/`, so behind the API key.

* load `{"lora_name", "lora_path"}`: the PEFT directory is read by `ServedModel.load_adapter` on a thread
  of its own (the engine steps meanwhile), then added on the engine's thread between two steps
  (`Engine.add_lora`): into a free slot, else kept on the host until a request needs it; nothing is
  compiled. 400: a bad body, a server without slots (`--max-loras`), a name already served (the base's
  or an adapter's), an adapter that cannot be read or does not fit the slots.
* unload `{"lora_name"}`: `Engine.remove_lora`. 404: a name not loaded; 409: requests running or waiting
  still name it (the engine refuses rather than waits: `jaxattn.serving.loras`); retry once they end.
"""

from __future__ import annotations

import asyncio
from typing import Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, StrictStr

from jaxattn.serving.api import protocol
from jaxattn.serving.api.handlers import read_json, state_of
from jaxattn.serving.api.protocol import APIError, bad_request
from jaxattn.serving.api.runner import Draining
from jaxattn.serving.loras import LoraExists, LoraInUse, UnknownLora


class UnloadLora(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: StrictStr

    def check_supported(self) -> None:
        """Nothing beyond the fields' types (`protocol.parse` asks every body)."""


class LoadLora(UnloadLora):
    lora_path: StrictStr


async def on_engine(request: Request, fn: Callable[[], object]) -> object:
    """`fn()` on the engine's thread between two steps; a 503 while the server drains."""
    try:
        return await asyncio.wrap_future(state_of(request).runner.call(fn))
    except Draining as err:
        raise APIError(503, str(err), code="draining") from None


async def load_lora_adapter(request: Request) -> Response:
    state = state_of(request)
    body = protocol.parse(LoadLora, await read_json(request, state.limits.max_body_bytes))
    engine, name = state.runner.engine, body.lora_name
    if state.served.load_adapter is None or engine.loras is None:
        raise bad_request("this server holds no LoRA adapters: start it with --max-loras N", code="lora_disabled")
    if not name or name == state.served.name or name in engine.lora_names:
        raise bad_request(f"lora_name {name!r} is already served (or empty): unload it first, or choose another",
                          "lora_name", code="lora_exists")
    try:
        params = await asyncio.to_thread(state.served.load_adapter, body.lora_path)
    except ValueError as err:
        raise bad_request(f"lora_path {body.lora_path}: {err}", "lora_path") from None
    try:
        await on_engine(request, lambda: engine.add_lora(name, params))
    except LoraExists as err:  # loaded meanwhile by another request
        raise bad_request(str(err), "lora_name", code="lora_exists") from None
    except ValueError as err:  # it does not fit the slots
        raise bad_request(f"lora_path {body.lora_path}: {err}", "lora_path") from None
    return JSONResponse({"status": "ok", "message": f"LoRA adapter {name!r} added"})


async def unload_lora_adapter(request: Request) -> Response:
    state = state_of(request)
    body = protocol.parse(UnloadLora, await read_json(request, state.limits.max_body_bytes))
    engine, name = state.runner.engine, body.lora_name
    if engine.loras is None:
        raise bad_request("this server holds no LoRA adapters: start it with --max-loras N", code="lora_disabled")
    try:
        await on_engine(request, lambda: engine.remove_lora(name))
    except UnknownLora as err:
        raise APIError(404, str(err), param="lora_name", code="model_not_found") from None
    except LoraInUse as err:
        raise APIError(409, str(err), param="lora_name", code="lora_in_use") from None
    return JSONResponse({"status": "ok", "message": f"LoRA adapter {name!r} removed"})


ROUTES: tuple[tuple[str, str, Callable], ...] = (
    ("POST", "/v1/load_lora_adapter", load_lora_adapter), ("POST", "/v1/unload_lora_adapter", unload_lora_adapter))
