"""`POST /v1/embeddings` in OpenAI's shapes, over the served decoder's `ServedModel.embed`
(`jaxattn.serving.embedding.Embedder`: the last layer's state after the final norm, last-token pooled
as vLLM pools a decoder, L2-normalised).

`input` is a string, a list of strings, a list of ids or a list of lists of ids (texts are encoded
with the tokenizer's own special tokens unless `add_special_tokens` is false, as vLLM does);
`encoding_format` is "float" (lists of numbers) or "base64" (each vector's float32 little-endian
bytes, what the `openai` client asks for by default and decodes). `dimensions` other than the
model's width is refused (the model is not trained to be cut). `normalize: false` (an extension)
gives the pooled state as it is. Each text runs on the engine's thread between two steps
(`EngineRunner.call`), one at a time, so the steps and the embeddings never use the device at once.
An empty input, an empty text, or a text longer than the model's context: a 400 naming `input`.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Literal

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, StrictInt

from jaxattn.serving.api import protocol
from jaxattn.serving.api.handlers import check_model, encode, read_json, state_of
from jaxattn.serving.api.protocol import APIError, bad_request
from jaxattn.serving.api.runner import Draining


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    input: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = None
    add_special_tokens: bool = True  # an extension (vLLM's)
    normalize: bool = True  # an extension: false gives the pooled state as it is

    def check_supported(self) -> None:
        if isinstance(self.input, list) and not self.input:
            raise bad_request("input must not be empty", "input")


def texts_ids(state, body: EmbeddingRequest) -> list[list[int]]:
    """Each input's ids; a 400 naming `input` for an empty one or one past the context."""
    given = body.input
    items = [given] if isinstance(given, str) or (given and isinstance(given[0], int)) else given
    out = []
    for item in items:
        ids = encode(state, item, special=body.add_special_tokens, param="input") if isinstance(item, str) else item
        if not ids:
            raise bad_request("input: an empty text has nothing to embed", "input")
        if len(ids) > state.served.max_model_len:
            raise bad_request(f"input: {len(ids)} tokens, more than this model's context of "
                              f"{state.served.max_model_len}", "input", code="context_length_exceeded")
        out.append(list(ids))
    return out


async def embeddings(request: Request) -> Response:
    state = state_of(request)
    body = protocol.parse(EmbeddingRequest, await read_json(request, state.limits.max_body_bytes))
    check_model(state, body.model)
    served = state.served
    if served.embed is None:
        raise APIError(404, "this server does not serve embeddings", code="not_found")
    inputs = texts_ids(state, body)
    data = []
    for index, ids in enumerate(inputs):
        try:
            vector = await asyncio.wrap_future(state.runner.call(lambda ids=ids: served.embed(ids, body.normalize)))
        except ValueError as err:
            raise bad_request(f"input: {err}", "input") from None
        except Draining as err:
            raise APIError(503, str(err), code="draining") from None
        if body.dimensions is not None and body.dimensions != vector.shape[-1]:
            raise bad_request(f"dimensions must be this model's width, {vector.shape[-1]} (it cannot be cut), "
                              f"got {body.dimensions}", "dimensions")
        data.append({"object": "embedding", "index": index, "embedding": encoded(vector, body.encoding_format)})
    count = sum(len(ids) for ids in inputs)
    return JSONResponse({"object": "list", "data": data, "model": served.name,
                         "usage": {"prompt_tokens": count, "total_tokens": count}})


def encoded(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    vector = np.asarray(vector, dtype="<f4")
    if encoding_format == "base64":
        return base64.b64encode(vector.tobytes()).decode("ascii")
    return [float(x) for x in vector]


ROUTES = (("POST", "/v1/embeddings", embeddings),)
