"""Fine-tuning chats: read from a chat JSONL file and rendered with a model's chat template, each a
document of ids and loss weights (`train.data.documents.Document`), packed into rows by `train.data.packing`.

```text
template, tokenizer = load_chat_files("exports/baby")           # chat_template + tokenizer.json
documents = chat_documents("chats.jsonl", template, tokenizer)  # [(ids [L], weights [L]), ...]
```

**Chat JSONL** (`read_chat_jsonl`): one JSON object per line, `{"messages": [{"role": ..., "content":
...}, ...]}`, roles system, user, assistant or tool, each content a string, at least one assistant
message; other keys of a line or a message pass through to the template (a message's `name`,
`reasoning_content`, ...). Blank lines are skipped. A bad line is a `DataError` naming `file:line`.

**Which tokens count** (`render_conversation`): the conversation is rendered as transformers'
`apply_chat_template(messages, tokenize=False)` renders it (`add_generation_prompt=False`) and
tokenized whole, without added special tokens; those ids are the document. With
`train_on="assistant"` a token weighs 1 when it belongs to an assistant message's turn after its
header: the content, whatever the template writes around it there (a reasoning block), and the
end-of-turn token(s) that close it (`<|im_end|>`, `<|eot_id|>`, `<end_of_turn>`), but not the
whitespace the template writes after them (ChatML's and Gemma's newline); after the last message,
whatever the template closes the conversation with (an `eos_token`) counts too. The header
(`<|im_start|>assistant\\n`) and every other message weigh 0, as TRL's assistant-only loss and
axolotl's `train_on_inputs: false` count. `train_on="all"` weighs every token 1.

How the turns are found, for any template: for assistant message i, the header ends where
`render(messages[:i], add_generation_prompt=True)` and the full rendering part ways (their
longest common prefix), and the turn ends where `render(messages[:i+1])` and the full rendering
part ways, or further: where the longest start of the full text after the header that ends
`render(messages[:i+1])` ends (so a template that writes a turn differently once later turns follow,
like Qwen3 dropping the reasoning block of earlier turns, still has its turn found); trailing
whitespace is then left out. Character positions become token positions through the full text's
own tokenization: its offsets when the tokenizer gives them (`JSONTokenizer.encode_with_offsets`),
else the tokenization of the text up to each position, which must be a prefix of the full ids
(true of the char and byte tokenizers). A token that straddles the header's end counts; one that
straddles the turn's end does not.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from jaxattn.hf.chat_template import ChatTemplate, ChatTemplateError
from train.data.documents import Document, read_utf8
from train.data.errors import DataError
from train.data.tokenizer import JSONTokenizer, Tokenizer

ROLES = ("system", "user", "assistant", "tool")
TRAIN_ON = ("assistant", "all")


# --- Reading chats ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Conversation:
    """One line of a chat JSONL file: its messages (dicts with str `role` and `content`, other keys
    kept) and where it came from (`path`, 1-based `line`)."""

    messages: list[dict[str, Any]]
    path: str
    line: int

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def read_chat_jsonl(path: str | Path) -> list[Conversation]:
    """The conversations of a chat JSONL file, in file order; blank lines are skipped.

    DataError, one line starting `FILE:LINE:`, for a line that is not JSON, not an object, without
    a non-empty `messages` list, with a message that is not an object, lacks `role` or `content`,
    has a content that is not a string or a role outside `ROLES`, or has no assistant message;
    DataError naming the file when it cannot be read, is not UTF-8 or holds no conversation.
    """
    path = Path(path)
    text = read_utf8(path)
    conversations = []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            conversations.append(Conversation(_checked_line(line, f"{path}:{number}"), str(path), number))
    if not conversations:
        raise DataError(f"{path}: holds no conversations (one JSON object per line expected)")
    return conversations


def _checked_line(line: str, where: str) -> list[dict[str, Any]]:
    """The messages of one JSONL line; DataError starting with `where` when the line is bad."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise DataError(f"{where}: is not JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(record, dict):
        raise DataError(f"{where}: holds a JSON {type(record).__name__}, expected an object with \"messages\"")
    messages = record.get("messages")
    if messages is None:
        raise DataError(f"{where}: has no \"messages\" key")
    if not isinstance(messages, list) or not messages:
        what = "an empty list" if isinstance(messages, list) else f"a JSON {type(messages).__name__}"
        raise DataError(f"{where}: \"messages\" is {what}, expected a non-empty list of messages")
    for index, message in enumerate(messages):
        name = f"{where}: messages[{index}]"
        if not isinstance(message, dict):
            raise DataError(f"{name} is a JSON {type(message).__name__}, expected an object with "
                            "\"role\" and \"content\"")
        for key in ("role", "content"):
            if key not in message:
                raise DataError(f"{name} has no \"{key}\"")
        if not isinstance(message["content"], str):
            raise DataError(f"{name}: \"content\" is a JSON {type(message['content']).__name__}, expected a string")
        if message["role"] not in ROLES:
            raise DataError(f"{name}: unknown role {message['role']!r} (expected one of {', '.join(ROLES)})")
    if not any(message["role"] == "assistant" for message in messages):
        raise DataError(f"{where}: has no assistant message, so nothing to train on")
    return messages


# --- Rendering a conversation -------------------------------------------------------------------------


def render_conversation(template: ChatTemplate, tokenizer: Tokenizer, messages: list[dict[str, Any]], *,
                        train_on: str = "assistant") -> Document:
    """(ids int32 [L], weights float32 [L]) of a conversation as `template` renders it.

    The ids are `tokenizer.encode` of the whole rendering (`add_generation_prompt=False`); weights
    are 1 on the assistant turns' tokens (the module docstring says which) with
    `train_on="assistant"`, 1 everywhere with `train_on="all"`, else 0.

    ValueError for a `train_on` outside `TRAIN_ON`, for an assistant message at index 0 (its header
    cannot be told from what the template writes before any message), or when a tokenizer without
    offsets does not split the text where a turn begins or ends; ChatTemplateError as the template
    raises it.
    """
    if train_on not in TRAIN_ON:
        raise ValueError(f"train_on must be one of {TRAIN_ON}, got {train_on!r}")
    text = template.render(messages, add_generation_prompt=False)
    if train_on == "all":
        ids = np.asarray(tokenizer.encode(text), dtype=np.int32)
        return ids, np.ones(len(ids), np.float32)
    spans = assistant_spans(template, messages, text)
    ids, boundary = _token_boundaries(tokenizer, text)
    weights = np.zeros(len(ids), np.float32)
    for start, end in spans:
        weights[boundary(start, "start"):boundary(end, "end")] = 1.0
    return ids, weights


def assistant_spans(template: ChatTemplate, messages: list[dict[str, Any]], text: str) -> list[tuple[int, int]]:
    """[start, end) character spans of `text` (the full rendering) that the assistant turns' tokens
    cover, one per assistant message in order (the module docstring says how they are found)."""
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if index == 0:
            raise ValueError("messages[0] is an assistant message: its header cannot be told from what the "
                             "template writes before any message; open the conversation with a system or user message")
        start = _common_prefix(template.render(messages[:index], add_generation_prompt=True), text)
        through = template.render(messages[:index + 1], add_generation_prompt=False)
        end = _common_prefix(through, text)
        if end < len(through):  # the full rendering writes this turn otherwise: find where it ends
            turn = through[min(start, len(through)):]
            end = max(end, start + _prefix_that_ends(text[start:start + len(turn)], turn))
        while end > start and text[end - 1].isspace():
            end -= 1
        spans.append((start, end))
    return spans


def _common_prefix(a: str, b: str) -> int:
    """The length of the longest common prefix of two strings."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    low, high = 0, n  # a[:low] == b[:low], a[:high] != b[:high]: halve (slices compare in C)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if a[:middle] == b[:middle] else (low, middle)
    return low


def _prefix_that_ends(text: str, rendered: str) -> int:
    """The length of the longest start of `text` that `rendered` ends with (a prefix function: linear)."""
    joined = [*text, None, *rendered]  # None: matches no character, so no match runs across the join
    failure = [0] * len(joined)
    for i in range(1, len(joined)):
        k = failure[i - 1]
        while k and joined[i] != joined[k]:
            k = failure[k - 1]
        failure[i] = k + 1 if joined[i] == joined[k] else 0
    return failure[-1] if rendered else 0  # the longest border of text + None + rendered


def _token_boundaries(tokenizer: Tokenizer, text: str):
    """(ids int32 [L], boundary(position, side) -> token index) of `text` tokenized whole.

    boundary(p, "start") is the first token reaching past character p (a token straddling p
    counts from p on); boundary(p, "end") is the number of tokens that end by p.
    """
    if hasattr(tokenizer, "encode_with_offsets"):
        ids, offsets = tokenizer.encode_with_offsets(text)
        ends = np.maximum.accumulate(offsets[:, 1]) if len(ids) else offsets[:, 1]  # [L], made monotone

        def boundary(position: int, side: str) -> int:
            return int(np.searchsorted(ends, position, side="right"))

        return np.asarray(ids, np.int32), boundary
    ids = np.asarray(tokenizer.encode(text), dtype=np.int32)

    def prefix_boundary(position: int, side: str) -> int:
        head = np.asarray(tokenizer.encode(text[:position]), dtype=np.int32)
        if len(head) > len(ids) or not np.array_equal(head, ids[:len(head)]):
            raise ValueError(f"the tokenizer does not split the rendered chat at character {position} (the {side} "
                             f"of an assistant turn): {text[max(0, position - 20):position]!r} | "
                             f"{text[position:position + 20]!r}; its tokens there cannot be told apart")
        return len(head)

    return ids, prefix_boundary


def load_chat_files(directory: str | Path) -> tuple[ChatTemplate, JSONTokenizer]:
    """A transformers tokenizer directory's chat template and tokenizer.json (kind "hf").

    DataError naming the directory when it has no chat template or no readable tokenizer.json, or
    its template cannot be read.
    """
    directory = Path(directory)
    try:
        template = ChatTemplate.from_directory(directory)
    except ChatTemplateError as err:
        raise DataError(f"{directory}: {err}") from None
    if template is None:
        raise DataError(f"{directory}: has no chat template (chat_template.jinja or tokenizer_config.json's "
                        "chat_template)")
    path = directory / "tokenizer.json"
    try:
        return template, JSONTokenizer("hf", path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise DataError(f"{path}: cannot be read as a tokenizer.json ({err})") from None


def chat_documents(path: str | Path, template: ChatTemplate, tokenizer: Tokenizer, *,
                   train_on: str = "assistant") -> list[Document]:
    """`render_conversation` of every conversation of a chat JSONL file, in file order.

    DataError as `read_chat_jsonl` raises it, or naming `FILE:LINE` when a conversation cannot be
    rendered (the template refuses it, or its turns cannot be found).
    """
    documents = []
    for conversation in read_chat_jsonl(path):
        try:
            documents.append(render_conversation(template, tokenizer, conversation.messages, train_on=train_on))
        except (ChatTemplateError, ValueError) as err:
            raise DataError(f"{conversation.where}: {err}") from None
    return documents
