"""Fine-tuning data: chats rendered with a model's chat template, loss weights, documents packed into rows.

```text
template, tokenizer = load_chat_files("exports/baby")           # chat_template + tokenizer.json
documents = chat_documents("chats.jsonl", template, tokenizer)  # [(ids [L], weights [L]), ...]
packed = pack(documents, row_len=512, pad_id=0, seed=0)         # inputs, targets, weights [R, 512], ...
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

**Plain text** (`text_documents`): documents split at blank lines, or one per file; weights all 1.

**Packing** (`pack`): documents laid back to back into rows of `row_len + 1` tokens (best-fit
decreasing), a row's inputs its first `row_len` tokens and its targets its last `row_len`; weights
are 0 where the target is padding or another document's first token; segment ids and positions
let attention keep to one document. A document longer than a row is split into pieces that
overlap by one token, so each of its predictions is made exactly once. `Packed` says the rest.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jaxattn.hf.chat_template import ChatTemplate, ChatTemplateError
from train.data.errors import DataError
from train.data.tokenizer import JSONTokenizer, Tokenizer

ROLES = ("system", "user", "assistant", "tool")
TRAIN_ON = ("assistant", "all")
TEXT_SPLITS = ("paragraphs", "file")

Document = tuple[np.ndarray, np.ndarray]  # (ids int32 [L], weights float32 [L])


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


def _read_utf8(path: Path) -> str:
    """The file's text; DataError naming it when it cannot be read or is not UTF-8."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: is not UTF-8 text (near byte {err.start}): {err.reason}") from None
    except OSError as err:
        raise DataError(f"{path}: cannot be read ({err.strerror or err})") from None


def read_chat_jsonl(path: str | Path) -> list[Conversation]:
    """The conversations of a chat JSONL file, in file order; blank lines are skipped.

    DataError, one line starting `FILE:LINE:`, for a line that is not JSON, not an object, without
    a non-empty `messages` list, with a message that is not an object, lacks `role` or `content`,
    has a content that is not a string or a role outside `ROLES`, or has no assistant message;
    DataError naming the file when it cannot be read, is not UTF-8 or holds no conversation.
    """
    path = Path(path)
    text = _read_utf8(path)
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


def text_documents(path: str | Path, tokenizer: Tokenizer, *, split: str = "paragraphs") -> list[Document]:
    """The documents of a UTF-8 text file, each (ids int32 [L], weights float32 [L] all 1).

    split="paragraphs": a document per run of non-blank lines (blank: nothing but whitespace),
    its lines joined by newlines; split="file": the whole file, one document. Newlines are made LF.
    Nothing is added between documents: `pack` keeps them apart with segment ids. DataError naming
    the file when it cannot be read, is not UTF-8 or holds no text.
    """
    if split not in TEXT_SPLITS:
        raise ValueError(f"split must be one of {TEXT_SPLITS}, got {split!r}")
    path = Path(path)
    text = _read_utf8(path)
    if split == "file":
        texts = [text] if text.strip() else []
    else:
        texts, lines = [], []
        for line in [*text.splitlines(), ""]:  # the final "" closes the last paragraph
            if line.strip():
                lines.append(line)
            elif lines:
                texts.append("\n".join(lines))
                lines = []
    if not texts:
        raise DataError(f"{path}: holds no text")
    documents = []
    for piece in texts:
        ids = np.asarray(tokenizer.encode(piece), dtype=np.int32)
        documents.append((ids, np.ones(len(ids), np.float32)))
    return documents


# --- Packing ------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Packed:
    """Documents packed into R rows of T = row_len predictions.

    Row r holds a buffer of T + 1 tokens: documents back to back, then `pad_id`; `inputs[r]` is its
    first T tokens and `targets[r]` its last T (next-token targets).

    Attributes:
      inputs, targets: int32 [R, T].
      weights: float32 [R, T]: the weight of predicting `targets[r, t]`: the document's weight of that
        token when `inputs[r, t]` and `targets[r, t]` are of the same document, else 0 (a document's
        last token, whose next token is another document's, and padding).
      segment_ids: int32 [R, T]: the document of `inputs[r, t]` within its row, 1, 2, ...; 0 = padding.
        Attention that keeps to equal segment ids never looks across documents.
      positions: int32 [R, T]: the position of `inputs[r, t]` within its document (0 at its first
        token; 0 at padding).
      placements: int64 [P, 5]: each piece placed, as (row, offset in the row's buffer, document index,
        start of the piece in the document, length).
      skipped: documents of fewer than two tokens, left out (nothing to predict).
    """

    inputs: np.ndarray
    targets: np.ndarray
    weights: np.ndarray
    segment_ids: np.ndarray
    positions: np.ndarray
    placements: np.ndarray
    skipped: int = 0

    @property
    def efficiency(self) -> float:
        """The fraction of the R * T input slots that hold a document's token, not padding."""
        return float(np.mean(self.segment_ids > 0)) if self.segment_ids.size else 0.0


def pack(documents: Sequence[Document], row_len: int, *, pad_id: int = 0, seed: int = 0) -> Packed:
    """Packs (ids [L], weights [L]) documents into rows of `row_len` next-token predictions.

    A document of L tokens makes L - 1 predictions (token j from tokens 0..j-1, weighted by
    weights[j]; weights[0] is never used). One of more than row_len + 1 tokens is split into pieces
    ids[k*T : k*T + T + 1] (T = row_len), overlapping by one token, so that each of its predictions
    is made exactly once; each piece is a document of its own in its row (its own segment id,
    positions from 0). The pieces are placed best-fit decreasing (longest first, each into the row
    with the least room that holds it, else a new row); equal lengths are ordered by a permutation
    drawn from `seed`, and the rows are shuffled with it: the result is a function of (documents,
    row_len, pad_id, seed). Documents of fewer than two tokens are left out (counted in `skipped`).

    ValueError for row_len < 1, a document whose ids and weights are not 1-D of one length, or no
    document of two tokens or more.
    """
    if row_len < 1:
        raise ValueError(f"row_len must be at least 1, got {row_len}")
    capacity = row_len + 1  # tokens in a row's buffer
    pieces = []  # (document index, start, length)
    skipped = 0
    for index, (ids, weights) in enumerate(documents):
        ids, weights = np.asarray(ids), np.asarray(weights)
        if ids.ndim != 1 or weights.shape != ids.shape:
            raise ValueError(f"document {index}: ids and weights must be 1-D and of one length, got shapes "
                             f"{ids.shape} and {weights.shape}")
        if len(ids) < 2:
            skipped += 1
            continue
        for start in range(0, len(ids) - 1, row_len):  # piece k predicts tokens k*T+1 .. k*T+T
            pieces.append((index, start, min(len(ids) - start, capacity)))
    if not pieces:
        raise ValueError("no document has two tokens or more: nothing to pack")

    rng = np.random.default_rng(seed)
    order = rng.permutation(len(pieces))
    order = order[np.argsort([-pieces[i][2] for i in order], kind="stable")]
    room: list[tuple[int, int]] = []  # (room left, row), sorted
    rows: list[list[tuple[int, int, int]]] = []
    for i in order:
        length = pieces[i][2]
        at = bisect.bisect_left(room, (length, -1))
        if at == len(room):
            row = len(rows)
            rows.append([])
            left = capacity
        else:
            left, row = room.pop(at)
        rows[row].append(pieces[i])
        if left - length > 0:
            bisect.insort(room, (left - length, row))
    shuffled = [rows[r] for r in rng.permutation(len(rows))]
    return _lay_out(documents, shuffled, row_len, pad_id, skipped)


def _lay_out(documents: Sequence[Document], rows: list[list[tuple[int, int, int]]], row_len: int,
             pad_id: int, skipped: int) -> Packed:
    """The arrays of `Packed` for rows of pieces (document index, start, length)."""
    n_rows, width = len(rows), row_len + 1
    tokens = np.full((n_rows, width), pad_id, np.int32)
    token_weights = np.zeros((n_rows, width), np.float32)
    segments = np.zeros((n_rows, width), np.int32)
    positions = np.zeros((n_rows, width), np.int32)
    placements = []
    for r, row in enumerate(rows):
        offset = 0
        for segment, (index, start, length) in enumerate(row, start=1):
            ids, weights = documents[index]
            span = slice(offset, offset + length)
            tokens[r, span] = np.asarray(ids)[start:start + length]
            token_weights[r, span] = np.asarray(weights)[start:start + length]
            segments[r, span] = segment
            positions[r, span] = np.arange(length)
            placements.append((r, offset, index, start, length))
            offset += length
    same_document = (segments[:, :-1] == segments[:, 1:]) & (segments[:, 1:] > 0)  # [R, T]
    return Packed(inputs=tokens[:, :-1], targets=tokens[:, 1:],
                  weights=np.where(same_document, token_weights[:, 1:], 0.0).astype(np.float32),
                  segment_ids=segments[:, :-1], positions=positions[:, :-1],
                  placements=np.asarray(placements, np.int64).reshape(-1, 5), skipped=skipped)
