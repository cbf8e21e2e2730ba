"""`POST /tokenize` and `POST /detokenize`, vLLM's extensions, in vLLM's shapes.

`/tokenize` takes a `prompt` (encoded with the tokenizer's own special tokens unless
`add_special_tokens` is false) or chat `messages` (rendered by the chat template, with `tools` if
given, and encoded without added special tokens unless asked: the template writes them) and answers
`{"count", "max_model_len", "tokens", "token_strs"}` (`token_strs`, each id's own text, only with
`return_token_strs`). `/detokenize` takes `tokens` and answers `{"prompt"}`, special tokens kept.
`model` may be left out; when given it must be the served one. An id outside the vocabulary, a text
the tokenizer cannot encode or messages the template refuses: a 400 naming the field.
"""

from __future__ import annotations

from typing import Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from jaxattn.serving.api import protocol
from jaxattn.serving.api.handlers import check_model, encode, read_json, render_chat, state_of
from jaxattn.serving.api.protocol import APIError, ChatMessage, bad_request


class _Tokenize(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    return_token_strs: bool = False

    def check_supported(self) -> None:
        pass


class TokenizeCompletionRequest(_Tokenize):
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(_Tokenize):
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None

    def plain_messages(self) -> list[dict]:
        return [{k: v for k, v in m.model_dump().items() if v is not None} for m in self.messages]


class DetokenizeRequest(_Tokenize):
    tokens: list[int]


async def tokenize(request: Request) -> Response:
    state = state_of(request)
    raw = await read_json(request, state.limits.max_body_bytes)
    chat = isinstance(raw, dict) and "messages" in raw
    body = protocol.parse(TokenizeChatRequest if chat else TokenizeCompletionRequest, raw)
    if body.model is not None:
        check_model(state, body.model, adapters=True)
    if chat:
        text, _ = render_chat(state, body, add_generation_prompt=body.add_generation_prompt)
    else:
        text = body.prompt
    ids = encode(state, text, special=body.add_special_tokens, param="messages" if chat else "prompt")
    strs = [token_text(state.served.decode, i) for i in ids] if body.return_token_strs else None
    return JSONResponse({"count": len(ids), "max_model_len": state.served.max_model_len, "tokens": ids,
                         "token_strs": strs})


async def detokenize(request: Request) -> Response:
    state = state_of(request)
    body = protocol.parse(DetokenizeRequest, await read_json(request, state.limits.max_body_bytes))
    if body.model is not None:
        check_model(state, body.model, adapters=True)
    served = state.served
    if served.decode is None:
        raise APIError(404, "this server cannot decode ids (its model came without a decoder)")
    vocab = served.vocab_size
    bad = [t for t in body.tokens if t < 0 or (vocab is not None and t >= vocab)]
    if bad:
        raise bad_request(f"tokens: ids must be in [0, {vocab}), got {bad[0]}", "tokens")
    try:
        return JSONResponse({"prompt": served.decode(body.tokens)})
    except ValueError as err:
        raise bad_request(f"tokens: {err}", "tokens") from None


def token_text(decode: Callable[[list[int]], str] | None, token: int) -> str | None:
    return None if decode is None else decode([token])


ROUTES = (("POST", "/tokenize", tokenize), ("POST", "/detokenize", detokenize))
