"""A model's chat template, rendered to the text transformers' `apply_chat_template(..., tokenize=False)` gives.

```python
from jaxattn.hf.chat_template import ChatTemplate
template = ChatTemplate.from_directory(path)          # None when the checkpoint has no chat template
prompt = template.render([{"role": "user", "content": "Hi"}])  # ends with the assistant's header
```

The template runs as transformers 5.23 runs it (`transformers.utils.chat_template_utils`): a
sandboxed, immutable Jinja environment with `trim_blocks` and `lstrip_blocks`, the `loopcontrols`
extension (`{% break %}`, `{% continue %}`), a `tojson` filter that keeps non-ASCII text and takes
`indent`, `separators` and `sort_keys`, and the globals `raise_exception(message)`,
`strftime_now(format)`, `dict` and `namespace`. `{% generation %}` blocks render their body (the
assistant-token masks transformers can compute from them are not). The template sees `messages`,
`add_generation_prompt`, `tools` and `documents` (None unless given), the tokenizer's named special
tokens (`bos_token`, `eos_token`, ...) and any further keyword given to `render`, which overrides
a special token of the same name.

Messages are checked before rendering (`ChatTemplate.render` says what a message must be), keys
whose value is None are dropped, and a message's reasoning is offered under all of
`reasoning_content`, `thinking` and `reasoning`, as transformers does. Everything the template sees
is rebuilt from plain JSON types (str, int, float, bool, None, dict, list, tuple); any other object
becomes a placeholder string naming its type, so no method of a caller's object reaches the sandbox.

Only jinja2 is needed (3.1.6 or later, the release transformers requires for its sandbox fixes),
not transformers.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.utils
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment

from jaxattn.hf.render_bounds import TemplateTooCostly, bounded, deadline_range, time_limit

TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"
# transformers' `SPECIAL_TOKENS_ATTRIBUTES`: the named special tokens a template sees.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# The names a message's reasoning goes by; transformers fills each from the first one present.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
MIN_JINJA = (3, 1, 6)


class ChatTemplateError(ValueError):
    """A chat template that cannot be found, parsed or rendered, or messages it cannot render.

    Raised for: a tokenizer_config.json that is not JSON or holds a chat template or special token
    of the wrong type (the message names the file and key); a template with a syntax error (the
    message gives the line and Jinja's message); a template that calls `raise_exception` or fails
    while rendering (the message gives the template's own message); messages of the wrong shape
    (the message names the index of the first bad message).
    """


class _TemplateRaised(jinja2.TemplateError):
    """What `raise_exception(message)` raises inside a template."""


def find_chat_template(directory: str | Path) -> str | None:
    """The chat template of a transformers tokenizer directory, or None when it has none.

    `chat_template.jinja` wins when present; else tokenizer_config.json's `chat_template`, which is
    a string, or a list of `{"name": ..., "template": ...}` objects of which the one named "default"
    is taken (as transformers takes it when no tools are given). ChatTemplateError for a
    tokenizer_config.json that is not a JSON object, or a `chat_template` of another shape, or a
    list with no "default" entry.
    """
    directory = _directory(directory)
    if (directory / TEMPLATE_FILE).is_file():
        return _read_text(directory / TEMPLATE_FILE)
    config = _read_config(directory)
    if config is None or config.get("chat_template") is None:
        return None
    return _config_template(directory / CONFIG_FILE, config["chat_template"])


def special_tokens(directory: str | Path) -> dict[str, str]:
    """The named special tokens of tokenizer_config.json, as strings: only those present and not null.

    The names are transformers' (`bos_token`, `eos_token`, `unk_token`, `sep_token`, `pad_token`,
    `cls_token`, `mask_token`) plus the keys of an `extra_special_tokens` object (a multimodal
    model's `image_token`, say). A value is a string or an AddedToken-style object whose `content`
    is the string. No tokenizer_config.json gives {}. Tokens that only a legacy
    special_tokens_map.json or a tokenizer class's defaults hold are not read.
    """
    path = _directory(directory) / CONFIG_FILE
    config = _read_config(path.parent)
    if config is None:
        return {}
    extra = config.get("extra_special_tokens")
    names = list(SPECIAL_TOKEN_NAMES) + (list(extra) if isinstance(extra, dict) else [])
    values = {**config, **(extra if isinstance(extra, dict) else {})}
    return {name: _token_text(path, name, values[name]) for name in names if values.get(name) is not None}


def _directory(directory: str | Path) -> Path:
    directory = Path(directory)
    if not directory.is_dir():
        raise ChatTemplateError(f"{directory}: is not a directory")
    return directory


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")  # newlines translated, as transformers' open() does
    except (OSError, UnicodeDecodeError) as err:
        raise ChatTemplateError(f"{path}: cannot be read ({err})") from None


def _read_config(directory: Path) -> dict[str, Any] | None:
    """tokenizer_config.json's object, or None when the directory has none."""
    path = directory / CONFIG_FILE
    if not path.is_file():
        return None
    try:
        config = json.loads(_read_text(path))
    except json.JSONDecodeError as err:
        raise ChatTemplateError(f"{path}: is not JSON ({err.msg} at line {err.lineno} column {err.colno})") from None
    if not isinstance(config, dict):
        raise ChatTemplateError(f"{path}: holds {type(config).__name__}, expected a JSON object")
    return config


def _config_template(path: Path, value: Any) -> str:
    """The template a tokenizer_config.json `chat_template` value names."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or not all(
            isinstance(entry, dict) and isinstance(entry.get("name"), str) and isinstance(entry.get("template"), str)
            for entry in value):
        raise ChatTemplateError(f"{path}: chat_template: expected a string or a list of "
                                f"{{\"name\": str, \"template\": str}} objects, got {type(value).__name__}")
    templates = {entry["name"]: entry["template"] for entry in value}
    if "default" not in templates:
        raise ChatTemplateError(f"{path}: chat_template: no template is named \"default\" "
                                f"(the names are {sorted(templates)})")
    return templates["default"]


def _token_text(path: Path, name: str, value: Any) -> str:
    """A special token's string: the value itself, or an AddedToken object's `content`."""
    if isinstance(value, dict):
        value = value.get("content")
    if not isinstance(value, str):
        raise ChatTemplateError(f"{path}: {name}: expected a string or an object with a string \"content\"")
    return value


class ChatTemplate:
    """A chat template compiled once, rendered with `render`.

    Args:
      source: the Jinja template text.
      special_tokens: the named special tokens the template sees (`bos_token` and the like; see
        `special_tokens`), None for none.

    ChatTemplateError when the source does not parse; TypeError when either argument has the wrong type.
    """

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None):
        if not isinstance(source, str):
            raise TypeError(f"source must be a str, got {type(source).__name__}")
        tokens = dict(special_tokens or {})
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in tokens.items()):
            raise TypeError(f"special_tokens must map str to str, got {tokens!r}")
        self.source = source
        self.special_tokens = tokens
        self._compiled = _compile(source)
        self._variables = jinja2.meta.find_undeclared_variables(_environment().parse(source))

    def reads(self, name: str) -> bool:
        """Whether the template reads the variable `name` (`tools`, `documents`, ...) from its caller."""
        return name in self._variables

    @classmethod
    def from_directory(cls, directory: str | Path) -> ChatTemplate | None:
        """The template of a transformers tokenizer directory with its special tokens; None when it has none.

        `find_chat_template` and `special_tokens` say what is read; ChatTemplateError as they and the
        constructor raise it.
        """
        source = find_chat_template(directory)
        return None if source is None else cls(source, special_tokens(directory))

    def render(self, messages: list[dict], *, add_generation_prompt: bool = True, max_chars: int | None = None,
               max_seconds: float | None = None, **extra: Any) -> str:
        """The text of `messages` in this template, as transformers renders it.

        `messages` is a non-empty list of dicts, each with a str `role` and a `content` that is a str,
        or a list of `{"type": "text", "text": str}` parts (the OpenAI API's form), which are joined
        with newlines into one string as OpenAI-compatible servers join them; other parts (images,
        audio) are refused. Other keys pass through (keys whose value is None are dropped).
        `add_generation_prompt` asks the template for the header that starts the assistant's reply.
        `extra` reaches the template as variables: `tools`, `documents`, `enable_thinking` and the like.
        `max_chars` and `max_seconds` bound what a server renders for a client: the text is rendered piece by
        piece (Jinja's `generate`), abandoned past either (None: unbounded; the time is checked between pieces
        and as `range` counts: `jaxattn.hf.render_bounds`).

        ChatTemplateError names the index of the first bad message, gives the template's own message
        when it calls `raise_exception` or fails while rendering, or says which bound it passed.
        """
        chat = _alias_reasoning(_plain(_checked_messages(messages)))
        variables = {"tools": None, "documents": None, **_plain({**self.special_tokens, **extra})}
        try:
            with time_limit(max_seconds):
                pieces = self._compiled.generate(**variables, messages=chat, add_generation_prompt=add_generation_prompt)
                return bounded(pieces, max_chars, max_seconds)
        except TemplateTooCostly as err:
            raise ChatTemplateError(str(err)) from None
        except ChatTemplateError:
            raise
        except _TemplateRaised as err:
            raise ChatTemplateError(f"the chat template raised an exception: {err.message}") from None
        except Exception as err:  # noqa: BLE001 - any failure of a model's template code is the template's
            raise ChatTemplateError(f"the chat template failed while rendering: {type(err).__name__}: {err}") \
                from None


def _compile(source: str) -> jinja2.Template:
    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as err:
        raise ChatTemplateError(f"the chat template does not parse: line {err.lineno}: {err.message}") from None


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    """transformers' environment for chat templates (one per process: it holds no per-render state)."""
    version = tuple(int(part) for part in jinja2.__version__.split(".")[:3] if part.isdigit())
    if version < MIN_JINJA:
        raise ImportError(f"chat templates need jinja2>=3.1.6 (its sandbox fixes), found {jinja2.__version__}")
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    env.globals["range"] = deadline_range  # a loop that yields nothing still meets the render's deadline
    return env


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: the body, rendered as it stands."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller: jinja2.runtime.Macro) -> str:
        return caller()


def _raise_exception(message: str):
    raise _TemplateRaised(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | str | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """transformers' `tojson`: plain `json.dumps` (Jinja's own escapes HTML characters)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` in a template: a plain dict, without the type's other attributes."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace(...)` in a template, refusing attribute names that start with an underscore."""

    def __init__(*args, **kwargs):  # Jinja's signature trick, so that `namespace(self=...)` works
        self, args = args[0], args[1:]
        attributes = dict(*args, **kwargs)
        for name in attributes:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attributes)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"a chat template cannot store an underscore-prefixed attribute on a namespace, got {name!r}")


# --- Messages ----------------------------------------------------------------------------------------


def _checked_messages(messages: Any) -> list[dict[str, Any]]:
    """Copies of the messages with None-valued keys dropped and list contents joined; ChatTemplateError if bad."""
    if not isinstance(messages, list):
        raise ChatTemplateError(f"messages must be a list of dicts, got {type(messages).__name__}")
    if not messages:
        raise ChatTemplateError("messages is empty: a chat needs at least one message")
    checked = []
    for index, message in enumerate(messages):
        try:
            checked.append(_checked_message(message))
        except (TypeError, ValueError) as err:
            raise ChatTemplateError(f"messages[{index}]: {err}") from None
    return checked


def _checked_message(message: Any) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise TypeError(f"expected a dict with 'role' and 'content', got {type(message).__name__}")
    message = {key: value for key, value in message.items() if value is not None}
    if not isinstance(message.get("role"), str):
        raise ValueError("'role' is missing" if "role" not in message
                         else f"'role' must be a str, got {type(message['role']).__name__}")
    if "content" not in message:
        raise ValueError("'content' is missing")
    return {**message, "content": _content_text(message["content"])}


def _content_text(content: Any) -> str:
    """A message's content as one string: itself, or its text parts joined with newlines."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise TypeError(f"'content' must be a str or a list of text parts, got {type(content).__name__}")
    texts = []
    for number, part in enumerate(content):
        if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"'content'[{number}] must be {{\"type\": \"text\", \"text\": str}}, got {kind!r}")
        texts.append(part["text"])
    return "\n".join(texts)


def _alias_reasoning(chat: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each message with reasoning under one of its names gets it under all of them (transformers' aliasing)."""
    aliased = []
    for message in chat:
        reasoning = next((message[key] for key in REASONING_FIELDS if message.get(key) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        aliased.append(message)
    return aliased


def _plain(value: Any) -> Any:
    """`value` rebuilt from plain JSON types; any other object becomes the string "<TypeName>"."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):  # subclasses (enums and the like) carry methods of their own
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    if isinstance(value, np.generic):
        return _plain(value.item())
    return f"<{type(value).__name__}>"
