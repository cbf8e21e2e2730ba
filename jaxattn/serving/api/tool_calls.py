"""A model's tool calls in its output text: the formats chat templates write them in, and a parser that
reads them as the text streams out.

A format is data (`ToolCallFormat`): the text around each call's JSON object, and the marker in a chat
template's source that says the template writes calls that way. Two families are known:

* Hermes / Qwen 2.5 (`HERMES`): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
  one block per call (several for parallel calls), text outside the blocks is the answer's content;
* a plain JSON object (`JSON`, `JSON_PARAMETERS`): the whole answer is `{"name": ..., "arguments":
  {...}}` (Llama 3.1's templates write `"parameters"`), or a JSON list of such objects.

`ToolCallParser.feed(text)` takes each new piece of text and returns what can be said of it now:
`Content` (text outside any call), `CallStart` (a call whose name is known: its index and name) and
`Arguments` (the next piece of its arguments' JSON text). `finish()` says the rest. The arguments'
text is the model's own, character for character, so the pieces joined are the whole answer's
`arguments` string; a whole answer is the same events collected (`collect`), so a streamed answer
and a whole one always agree. Whitespace right before a call, and whitespace left over after the
last call, is not content.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Union

ARGUMENT_KEYS = ("arguments", "parameters")


@dataclasses.dataclass(frozen=True)
class ToolCallFormat:
    """How a template writes a tool call.

    Attributes:
      name: the format's name (in errors and docs).
      open, close: the text around each call's JSON object ("" for a bare object).
      separator: what a constrained answer writes between parallel calls.
      arguments_key: the key a constrained call writes its arguments under (either key is read).
      marker: a template whose source holds this text writes calls in this format (None: the default).
    """

    name: str
    open: str
    close: str
    separator: str
    arguments_key: str
    marker: str | None


HERMES = ToolCallFormat("hermes", "<tool_call>\n", "\n</tool_call>", "\n", "arguments", "<tool_call>")
JSON_PARAMETERS = ToolCallFormat("json_parameters", "", "", "", "parameters", '"parameters"')
JSON = ToolCallFormat("json", "", "", "", "arguments", None)
FORMATS = (HERMES, JSON_PARAMETERS, JSON)  # the first whose marker the template holds; JSON by default


def format_of(template_source: str) -> ToolCallFormat:
    """The format a chat template writes tool calls in (see `FORMATS`)."""
    return next(f for f in FORMATS if f.marker is None or f.marker in template_source)


@dataclasses.dataclass(frozen=True)
class Content:
    text: str


@dataclasses.dataclass(frozen=True)
class CallStart:
    index: int
    name: str


@dataclasses.dataclass(frozen=True)
class Arguments:
    index: int
    text: str


Event = Union[Content, CallStart, Arguments]


@dataclasses.dataclass
class ToolCall:
    """One call of a whole answer: its name and its arguments as JSON text."""

    name: str
    arguments: str = ""


def collect(events: list[Event]) -> tuple[str, list[ToolCall]]:
    """A whole answer's content (the `Content` joined) and its calls."""
    content, calls = [], []
    for event in events:
        if isinstance(event, Content):
            content.append(event.text)
        elif isinstance(event, CallStart):
            calls.append(ToolCall(event.name))
        else:
            calls[event.index].arguments += event.text
    return "".join(content), calls


def parse_whole(fmt: ToolCallFormat, text: str) -> tuple[str, list[ToolCall]]:
    """The content and calls of a whole text (what streaming it through `ToolCallParser` gives)."""
    parser = ToolCallParser(fmt)
    return collect(parser.feed(text) + parser.finish())


class ToolCallParser:
    """Reads tool calls out of streamed text in one format (see the module docstring)."""

    def __init__(self, fmt: ToolCallFormat):
        self.fmt = fmt
        self.calls = 0          # calls started so far
        self._pending = ""      # text not yet given out
        self._body: _CallBody | None = None  # the call being read (Hermes)
        self._bare_content: bool | None = None  # a bare format's answer: plain content (True), or maybe calls

    def feed(self, text: str) -> list[Event]:
        self._pending += text
        return self._bare_feed() if self.fmt.open == "" else self._tagged_feed(final=False)

    def finish(self) -> list[Event]:
        """The rest: a bare answer that did not turn out to be calls is content; so is the text of a call
        whose name never came."""
        if self.fmt.open == "":
            return self._bare_finish()
        events = self._tagged_feed(final=True)
        if self._body is not None and not self._body.started:
            events.append(Content(self.fmt.open.strip() + self._body.text))
        self._pending, self._body = "", None
        return events

    # -- calls between tags ------------------------------------------------------------------

    def _tagged_feed(self, final: bool) -> list[Event]:
        events: list[Event] = []
        opening, closing = self.fmt.open.strip(), self.fmt.close.strip()
        while self._pending:
            if self._body is None:
                at = self._pending.find(opening)
                if at < 0:
                    keep = 0 if final else _partial_suffix(self._pending, opening)
                    text = self._pending[:len(self._pending) - keep]
                    out = text if final and self.calls == 0 else text.rstrip()  # whitespace waits: a call may follow
                    if out:
                        events.append(Content(out))
                    self._pending = self._pending[len(out):]
                    return events
                if self._pending[:at].rstrip():
                    events.append(Content(self._pending[:at].rstrip()))
                self._pending, self._body = self._pending[at + len(opening):], _CallBody(self.calls)
            end = self._pending.find(closing)
            taken = self._pending if end < 0 else self._pending[:end]
            keep = 0 if end >= 0 or final else _partial_suffix(taken, closing)
            events += self._body.add(taken[:len(taken) - keep])
            self._pending = taken[len(taken) - keep:] if end < 0 else self._pending[end + len(closing):]
            if end < 0:
                return events
            self._close_body(events)
        return events

    def _close_body(self, events: list[Event]) -> None:
        if self._body.started:
            self.calls += 1
        else:  # a block that never named its function: its text is content
            events.append(Content(self.fmt.open.strip() + self._body.text + self.fmt.close.strip()))
        self._body = None

    # -- a bare JSON answer ------------------------------------------------------------------

    def _bare_feed(self) -> list[Event]:
        if self._bare_content is None:
            head = self._pending.lstrip()
            if not head:
                return []
            self._bare_content = head[0] not in "{["  # only a JSON object or list can be calls
        if self._bare_content:
            text, self._pending = self._pending, ""
            return [Content(text)]
        return []  # a bare call is judged whole, at the end (it may turn out to be plain JSON content)

    def _bare_finish(self) -> list[Event]:
        text, self._pending = self._pending, ""
        if self._bare_content is None or self._bare_content:
            return [Content(text)] if text else []
        calls = _bare_calls(text)
        if calls is None:
            return [Content(text)]
        events: list[Event] = []
        for index, (name, arguments) in enumerate(calls):
            events += [CallStart(index, name), Arguments(index, arguments)]
        self.calls = len(calls)
        return events


def _bare_calls(text: str) -> list[tuple[str, str]] | None:
    """The calls of a bare JSON answer (an object or a list of them), or None when it is not one."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    objects = value if isinstance(value, list) and value else [value]
    calls = []
    for item in objects:
        key = next((k for k in ARGUMENT_KEYS if isinstance(item, dict) and k in item), None)
        if key is None or not isinstance(item.get("name"), str) or set(item) != {"name", key}:
            return None
        calls.append((item["name"], json.dumps(item[key], ensure_ascii=False)))
    return calls


class _CallBody:
    """The JSON object of one call as it arrives: its name once whole, then its arguments' text."""

    def __init__(self, index: int):
        self.index, self.text = index, ""
        self.started = False
        self._sent = 0  # characters of the arguments' text given out

    def add(self, text: str) -> list[Event]:
        self.text += text
        name, start, end = scan_call(self.text)
        events: list[Event] = []
        if not self.started:
            if name is None or start is None:
                return events
            self.started = True
            events.append(CallStart(self.index, name))
        if start is not None:
            stop = len(self.text) if end is None else end
            piece = self.text[start + self._sent:stop]
            if end is None:
                piece = piece.rstrip()  # trailing whitespace may turn out to follow the value
            if piece:
                self._sent += len(piece)
                events.append(Arguments(self.index, piece))
        return events


def scan_call(text: str) -> tuple[str | None, int | None, int | None]:
    """Of a (possibly unfinished) JSON object `{"name": ..., "arguments": ...}`: the name (None until its
    string is whole), where the arguments' value starts (None until it has begun) and ends (None while open)."""
    decoder = json.JSONDecoder()
    at = _skip(text, 0)
    if at >= len(text) or text[at] != "{":
        return None, None, None
    name = start = end = None
    at += 1
    while True:
        at = _skip(text, at)
        if at >= len(text) or text[at] != '"':
            return name, start, end
        try:
            key, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return name, start, end
        at = _skip(text, at)
        if at >= len(text) or text[at] != ":":
            return name, start, end
        at = _skip(text, at + 1)
        if at >= len(text):
            return name, start, end
        value_end = _value_end(text, at)
        if key in ARGUMENT_KEYS:
            start, end = at, value_end
        elif key == "name" and value_end is not None:
            try:
                name = json.loads(text[at:value_end])
            except json.JSONDecodeError:
                return None, start, end
            name = name if isinstance(name, str) else None
        if value_end is None:
            return name, start, end
        at = _skip(text, value_end)
        if at >= len(text) or text[at] != ",":
            return name, start, end
        at += 1


def _skip(text: str, at: int) -> int:
    while at < len(text) and text[at] in " \t\r\n":
        at += 1
    return at


def _value_end(text: str, at: int) -> int | None:
    """Where the JSON value starting at `at` ends, or None when the text ends first."""
    depth, in_string, escaped = 0, False, False
    for i in range(at, len(text)):
        c = text[i]
        if in_string:
            escaped, in_string = (False, True) if escaped else (c == "\\", c != '"')
            if not in_string and depth == 0:
                return i + 1
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            if depth == 0:
                return i
            depth -= 1
            if depth == 0:
                return i + 1
        elif c in ", \t\r\n" and depth == 0:
            return i
    return None


def _partial_suffix(text: str, token: str) -> int:
    """The length of the longest tail of `text` that begins `token` (text that may yet become it)."""
    return max((k for k in range(1, len(token)) if text.endswith(token[:k])), default=0)
