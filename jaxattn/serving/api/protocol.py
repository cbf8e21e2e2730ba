"""The OpenAI API's requests and errors: request bodies in (the answers are `jaxattn.serving.api.answers`'), errors out.

Requests are parsed by pydantic models that take the fields `/v1/completions` and
`/v1/chat/completions` define, into their types only, ignore fields that change nothing here
(`user`, `metadata`, `store`, ...), and refuse with a 400 naming the parameter what would change the
answer and is not supported (`best_of` other than `n` when streaming, as vLLM refuses it). `top_k` (0
or -1 = off), `min_p`, `repetition_penalty` and `ignore_eos` are extensions, as in vLLM; `logit_bias`
is OpenAI's (token ids as strings -> bias). `n` choices (and `best_of` sequences on completions) are
checked by the engine. Log-probabilities: a completion's `logprobs: k` and `echo` (the prompt's text
first and, with `logprobs`, its tokens' log-probabilities: the engine's `prompt_logprobs`; with
`max_tokens: 0` only scored), a chat's `logprobs: true` with `top_logprobs: k` (`top_logprobs` alone is
a 400, as OpenAI answers); their shapes are `jaxattn.serving.api.logprobs`'. Structured outputs, on
both endpoints as in vLLM: `response_format` (json_object, json_schema) and vLLM's `guided_json`,
`guided_regex`, `guided_choice` and `guided_grammar` (Lark or GBNF) become `SamplingParams.guide`
(`guide_of`); a guide that does not compile is the engine's 400, named by the field it came from.
`tools` are read by `jaxattn.serving.api.tools`, and an answer's tool calls written by
`jaxattn.serving.api.answers`. Whether the values are in range, and fit the model, is
`jaxattn.serving.validation`'s to say (its `RequestError` names the engine's parameter;
`openai_param` names the endpoint's).

Errors are `APIError`s, answered as OpenAI answers them, `{"error": {"message", "type", "param",
"code"}}` with the HTTP status the `openai` client maps to its exception classes.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pydantic
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from jaxattn.serving import Guide, SamplingParams


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

    # Counts are StrictInt: a JSON true or 2.0 is not a count (pydantic's lax mode would read them as 1 and 2).
    model: str
    max_tokens: StrictInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: StrictInt | None = None
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: StrictInt | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # an extension (vLLM's, transformers' definition)
    min_p: float | None = None  # an extension (vLLM's)
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False  # an extension (vLLM's): the end-of-sequence token does not end the answer
    # Structured outputs: OpenAI's response_format, or one of vLLM's extensions (`structured.guide_of`).
    response_format: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def check_supported(self) -> None:
        """A 400 naming the first field that asks for something this server does not do."""
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed with stream: true", "stream_options")
        guide_of(self)  # a 400 now for a guide field of the wrong shape

    def sampling(self, max_tokens: int | None, stop_token_ids: tuple[int, ...]) -> SamplingParams:
        """The engine's settings (`RequestError` for a value out of range): OpenAI's defaults (temperature
        1, top_p 1) where a field is absent, top_k -1 as 0 (off), `max_tokens` None up to the context."""
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k in (None, -1) else self.top_k, seed=self.seed, max_tokens=max_tokens,
            stop_token_ids=() if self.ignore_eos else stop_token_ids,
            stop=tuple([self.stop] if isinstance(self.stop, str) else self.stop or ()), guide=guide_of(self)[1],
            presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            min_p=self.min_p or 0.0, logit_bias=self.token_bias(), **self.logprob_settings(max_tokens))

    def logprob_settings(self, max_tokens: int | None) -> dict:
        """The engine's `logprobs` and `prompt_logprobs` this request asks for."""
        return {}

    @property
    def wants_logprobs(self) -> bool:
        """The answer carries log-probabilities."""
        return False

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
        return guide_of(self)[0] if param == "guide" else param

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampled):
    """`POST /v1/completions`: a prompt as text or token ids (one prompt; a list of one is taken)."""

    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    echo: bool = False
    logprobs: StrictInt | None = None
    best_of: StrictInt | None = None
    suffix: str | None = None

    def logprob_settings(self, max_tokens: int | None) -> dict:
        """`logprobs` k: the drawn tokens' top k; with `echo`, the prompt's too (and with `max_tokens` 0 and no
        `logprobs`, the prompt is only scored, so that the engine draws nothing)."""
        prompt = self.logprobs if self.echo else None
        if self.echo and prompt is None and max_tokens == 0:
            prompt = 0
        return {"logprobs": self.logprobs, "prompt_logprobs": prompt}

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None

    def check_supported(self) -> None:
        super().check_supported()
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
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    functions: list | None = None  # OpenAI's deprecated form of tools: refused, naming tools
    function_call: str | dict | None = None

    def logprob_settings(self, max_tokens: int | None) -> dict:
        return {"logprobs": (self.top_logprobs or 0) if self.logprobs else None}

    @property
    def wants_logprobs(self) -> bool:
        return bool(self.logprobs)

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        for name in ("functions", "function_call"):
            if getattr(self, name) is not None:
                raise bad_request(f"{name} is OpenAI's deprecated form of tools: send tools and tool_choice", name)

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
        if param == "logprobs":  # the engine's top k is this endpoint's top_logprobs
            return "top_logprobs"
        if param == "guide" and guide_of(self)[0] is None and self.tools:
            return "tool_choice"  # the guide of a forced call (`jaxattn.serving.api.tools`)
        return super().openai_param(param)

    def plain_messages(self) -> list[dict]:
        return [{k: v for k, v in m.model_dump().items() if v is not None} for m in self.messages]


GUIDE_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar")


def guide_of(body: _Sampled) -> tuple[str | None, Guide | None]:
    """(the field that asked, the `Guide` it asks for), or (None, None); a 400 naming the field for a
    shape other than OpenAI's or vLLM's, or for two fields at once. `guided_grammar` is GBNF when a
    line defines a rule with "::=" (llama.cpp's form), else Lark."""
    given = [name for name in GUIDE_FIELDS if getattr(body, name) is not None
             and not (name == "response_format" and body.response_format.get("type", "text") == "text")]
    if len(given) > 1:
        raise bad_request(f"one of {', '.join(given)} may be given, not several", given[1])
    if not given:
        return None, None
    name = given[0]
    value = getattr(body, name)
    if name == "response_format":
        return name, _response_format(value)
    if name == "guided_json":
        schema = json.loads(value) if isinstance(value, str) and _is_json(value) else value
        if not isinstance(schema, dict):
            raise bad_request("guided_json must be a JSON schema (an object, or its JSON text)", name)
        return name, Guide("json_schema", json.dumps(schema))
    if name == "guided_choice":
        return name, Guide("choice", json.dumps(value))
    if name == "guided_grammar":
        return name, Guide("gbnf" if re.search(r"^\s*[\w.-]+\s*::=", value, re.M) else "lark", value)
    return name, Guide("regex", value)


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _response_format(value: dict) -> Guide:
    """OpenAI's `{"type": "json_object"}` or `{"type": "json_schema", "json_schema": {"name", "schema",
    "strict"}}` as a guide; a 400 for anything else ("text" is no guide and never reaches here)."""
    kind = value.get("type")
    if kind == "json_object":
        return Guide("json_object")
    if kind != "json_schema":
        raise bad_request(f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                          "response_format")
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise bad_request("response_format.json_schema must be an object with a schema (a JSON object)",
                          "response_format")
    return Guide("json_schema", json.dumps(spec["schema"]))


def _union_member(part) -> bool:
    """A part of a pydantic error's location that names which member of a union was tried ("str",
    "list[int]"), not a field."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "dict", "list") or "[" in part)


def parse(model: type[BaseModel], body: Any):
    """`model` validated from a JSON value; a 400 naming the first bad field."""
    if not isinstance(body, dict):
        raise bad_request(f"the body must be a JSON object, got {type(body).__name__}")
    try:
        request = model.model_validate(body)
    except pydantic.ValidationError as err:
        first = err.errors()[0]
        param = ".".join(str(p) for p in first["loc"] if not _union_member(p)) or None
        forms = sum(1 for e in err.errors() if e["loc"][:1] == first["loc"][:1])
        detail = f"none of its {forms} accepted forms matches ({first['msg']})" if forms > 1 else first["msg"]
        raise bad_request(f"{param}: {detail}" if param else detail, param) from None
    request.check_supported()
    return request
