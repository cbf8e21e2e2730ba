"""The OpenAI API's answers: whole answers and their choices, stream chunks, usage, in each endpoint's shape.

`Answer` writes one request's answer: a completion's `choices[].text` or a chat's `choices[].message`
(with `tools`, the tool calls parsed out of the text: `message.tool_calls` and finish reason
"tool_calls" whole, `delta.tool_calls` chunks streamed, one parser per streamed choice), each choice's
`logprobs` as `jaxattn.serving.api.logprobs` wrote them, every stream chunk carrying its choice's `index`.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from jaxattn.serving.api import tool_calls
from jaxattn.serving.api.tool_calls import ToolCallFormat, ToolCallParser


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


Kind = Literal["completion", "chat"]


class Answer:
    """The answer to one request, whole or as stream chunks, in its endpoint's shapes; with `tools` (a chat
    whose tool calls are parsed, in that format) its calls as `tool_calls` and finish reason "tool_calls"."""

    def __init__(self, kind: Kind, model: str, tools: ToolCallFormat | None = None):
        self.kind, self.model, self.tools = kind, model, tools
        self.id = new_id("cmpl" if kind == "completion" else "chatcmpl")
        self.created = int(time.time())
        self._parsers: dict[int, ToolCallParser] = {}  # a streamed choice's tool-call parser, by index

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def choice(self, text: str, finish_reason: str, logprobs: dict | None = None, *, index: int = 0) -> dict:
        """One whole choice; `logprobs` its (`jaxattn.serving.api.logprobs`), or None; a chat's tool calls
        parsed out of its text (with `tools`)."""
        if self.kind == "completion":
            return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        message = {"role": "assistant", "content": text}
        if self.tools is not None:
            content, calls = tool_calls.parse_whole(self.tools, text)
            message["content"] = content or None
            if calls:
                message["tool_calls"] = [{"id": new_call_id(), "type": "function",
                                          "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
                finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}

    def whole(self, choices: list[dict], use: dict) -> dict:
        """The whole answer: its `choices` (`choice`) in index order."""
        obj = "text_completion" if self.kind == "completion" else "chat.completion"
        return {**self._head(obj), "choices": choices, "usage": use}

    def chunk(self, text: str | None, finish_reason: str | None = None, *, role: bool = False,
              logprobs: dict | None = None, index: int = 0) -> dict:
        """One stream chunk of choice `index`: new text (and its tokens' `logprobs`), or its last one's
        finish reason (chat: its first carries the role)."""
        if self.kind == "completion":
            choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
            return {**self._head("text_completion"), "choices": [choice]}
        delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
        return self._delta(delta, finish_reason, logprobs, index)

    def _delta(self, delta: dict, finish_reason: str | None = None, logprobs: dict | None = None,
               index: int = 0) -> dict:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return {**self._head("chat.completion.chunk"), "choices": [choice]}

    def _parser(self, index: int) -> ToolCallParser | None:
        if self.tools is None:
            return None
        return self._parsers.setdefault(index, ToolCallParser(self.tools))

    def text_chunks(self, text: str, logprobs: dict | None = None, *, index: int = 0) -> list[dict]:
        """The chunks of a piece of choice `index`'s streamed text: itself, or with tools the content and
        call deltas in it; its tokens' `logprobs` ride on the first (on an empty delta where the parser
        holds the text back)."""
        parser = self._parser(index)
        if parser is None:
            return [self.chunk(text, logprobs=logprobs, index=index)] if text or logprobs else []
        chunks = [self._event_chunk(e, index) for e in parser.feed(text)]
        if logprobs is not None:
            if not chunks:
                return [self._delta({}, None, logprobs, index)]
            chunks[0]["choices"][0]["logprobs"] = logprobs
        return chunks

    def last_chunks(self, finish_reason: str, *, index: int = 0) -> list[dict]:
        """The chunks that end choice `index`'s stream: what its tool-call parser held back, then the
        finish reason."""
        parser = self._parser(index)
        chunks = [] if parser is None else [self._event_chunk(e, index) for e in parser.finish()]
        if parser is not None and parser.calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        return chunks + [self.chunk(None, finish_reason, index=index)]

    def _event_chunk(self, event: tool_calls.Event, index: int) -> dict:
        if isinstance(event, tool_calls.Content):
            return self._delta({"content": event.text}, index=index)
        if isinstance(event, tool_calls.CallStart):
            call = {"index": event.index, "id": new_call_id(), "type": "function",
                    "function": {"name": event.name, "arguments": ""}}
        else:
            call = {"index": event.index, "function": {"arguments": event.text}}
        return self._delta({"tool_calls": [call]}, index=index)

    def usage_chunk(self, use: dict) -> dict:
        obj = "text_completion" if self.kind == "completion" else "chat.completion.chunk"
        return {**self._head(obj), "choices": [], "usage": use}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"
