"""The OpenAI API's shapes: request bodies in, answers, stream chunks and errors out.

Requests are parsed by pydantic models that take the fields `/v1/completions` and
`/v1/chat/completions` define, into their types only, ignore fields that change nothing here
(`user`, `metadata`, `store`, ...), and refuse with a 400 naming the parameter what would change the
answer and is not supported (`logprobs`, `tools`, `response_format` other than text; `best_of` other
than `n` when streaming, as vLLM refuses it). `top_k` (0 or -1 = off), `min_p`, `repetition_penalty`
and `ignore_eos` are extensions, as in vLLM; `logit_bias` is OpenAI's (token ids as strings -> bias).
`n` choices (and `best_of` sequences on completions) are checked by the engine. Whether the values are in range, and fit the model, is `jaxattn.serving.validation`'s to say (its `RequestError`
names the engine's parameter; `openai_param` names the endpoint's).

Errors are `APIError`s, answered as OpenAI answers them, `{"error": {"message", "type", "param",
"code"}}` with the HTTP status the `openai` client maps to its exception classes.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field

from jaxattn.serving import SamplingParams


class APIError(Exception):
    """An answer other than 200: its HTTP status and OpenAI's error fields."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
             500: "internal_server_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


# -- requests -----------------------------------------------------------------------------------

class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Sampled(BaseModel):
    """The fields both endpoints share. Unknown fields are ignored; unsupported ones are refused."""

    model_config = ConfigDict(extra="ignore", strict=False)

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    logprobs: Any = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # an extension (vLLM's, transformers' definition)
    min_p: float | None = None  # an extension (vLLM's)
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False  # an extension (vLLM's): the end-of-sequence token does not end the answer

    def check_supported(self) -> None:
        """A 400 naming the first field that asks for something this server does not do."""
        if self.logprobs not in (None, False, 0):
            raise bad_request("logprobs are not supported", "logprobs")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed with stream: true", "stream_options")

    def sampling(self, max_tokens: int | None, stop_token_ids: tuple[int, ...]) -> SamplingParams:
        """The engine's settings (`RequestError` for a value out of range): OpenAI's defaults (temperature
        1, top_p 1) where a field is absent, top_k -1 as 0 (off), `max_tokens` None up to the context."""
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k in (None, -1) else self.top_k, seed=self.seed, max_tokens=max_tokens,
            stop_token_ids=() if self.ignore_eos else stop_token_ids,
            stop=tuple([self.stop] if isinstance(self.stop, str) else self.stop or ()),
            presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            min_p=self.min_p or 0.0, logit_bias=self.token_bias())

    def token_bias(self) -> tuple[tuple[int, float], ...]:
        """`logit_bias` with its keys (token ids written as strings, OpenAI's shape) as ints; a 400 otherwise."""
        pairs = []
        for key, bias in (self.logit_bias or {}).items():
            if not key.strip().lstrip("-").isdigit():
                raise bad_request(f"logit_bias's keys must be token ids, got {key!r}", "logit_bias")
            pairs.append((int(key), bias))
        return tuple(pairs)

    @property
    def choices(self) -> tuple[int, int | None]:
        """`(n, best_of)`: the choices answered and the sequences drawn (None: n)."""
        return (1 if self.n is None else self.n), None

    def openai_param(self, param: str | None) -> str | None:
        """The field of this endpoint that an engine's parameter (`RequestError.param`) came from."""
        return param

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampled):
    """`POST /v1/completions`: a prompt as text or token ids (one prompt; a list of one is taken)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise bad_request("echo is not supported", "echo")
        n = 1 if self.n is None else self.n
        if self.stream and self.best_of is not None and self.best_of != n:
            raise bad_request(f"best_of must equal n ({n}) when streaming, got {self.best_of}", "best_of")
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix")

    @property
    def choices(self) -> tuple[int, int | None]:
        return (1 if self.n is None else self.n), self.best_of

    def single_prompt(self) -> str | list[int]:
        """The one prompt: text or ids (a list of one taken); a 400 for several."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise bad_request(f"one prompt per request, got a list of {len(prompt)}", "prompt")
            prompt = prompt[0]
        return prompt

    @property
    def asked_tokens(self) -> int:
        """max_tokens, 16 where absent (OpenAI's default for completions)."""
        return 16 if self.max_tokens is None else self.max_tokens


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict] | None = None


class ChatRequest(_Sampled):
    """`POST /v1/chat/completions`: messages rendered with the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    tools: list | None = None
    response_format: dict | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.tools:
            raise bad_request("tools are not supported", "tools")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise bad_request("response_format must be text", "response_format")

    @property
    def asked_tokens(self) -> int | None:
        """max_completion_tokens, else max_tokens; None (both absent): up to the context."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def openai_param(self, param: str | None) -> str | None:
        """The engine's prompt is this endpoint's messages; its max_tokens the field that was given."""
        if param == "prompt":
            return "messages"
        if param == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return param

    def plain_messages(self) -> list[dict]:
        return [{k: v for k, v in m.model_dump().items() if v is not None} for m in self.messages]


def parse(model: type[BaseModel], body: Any):
    """`model` validated from a JSON value; a 400 naming the first bad field."""
    if not isinstance(body, dict):
        raise bad_request(f"the body must be a JSON object, got {type(body).__name__}")
    try:
        request = model.model_validate(body)
    except pydantic.ValidationError as err:
        first = err.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise bad_request(f"{param}: {first['msg']}" if param else first["msg"], param) from None
    request.check_supported()
    return request


# -- answers ------------------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


Kind = Literal["completion", "chat"]


class Answer:
    """The answer to one request, whole or as stream chunks, in its endpoint's shapes."""

    def __init__(self, kind: Kind, model: str):
        self.kind, self.model = kind, model
        self.id = new_id("cmpl" if kind == "completion" else "chatcmpl")
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(self, choices: list[tuple[str, str]], use: dict) -> dict:
        """The whole answer: `choices` (text, finish reason) in index order."""
        if self.kind == "completion":
            listed = [{"index": i, "text": text, "logprobs": None, "finish_reason": finish_reason}
                      for i, (text, finish_reason) in enumerate(choices)]
            return {**self._head("text_completion"), "choices": listed, "usage": use}
        listed = [{"index": i, "message": {"role": "assistant", "content": text}, "logprobs": None,
                   "finish_reason": finish_reason} for i, (text, finish_reason) in enumerate(choices)]
        return {**self._head("chat.completion"), "choices": listed, "usage": use}

    def chunk(self, text: str | None, finish_reason: str | None = None, *, role: bool = False, index: int = 0) -> dict:
        """One stream chunk of choice `index`: new text, or its last one's finish reason (chat: its first
        carries the role)."""
        if self.kind == "completion":
            choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
            return {**self._head("text_completion"), "choices": [choice]}
        delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return {**self._head("chat.completion.chunk"), "choices": [choice]}

    def usage_chunk(self, use: dict) -> dict:
        obj = "text_completion" if self.kind == "completion" else "chat.completion.chunk"
        return {**self._head(obj), "choices": [], "usage": use}
