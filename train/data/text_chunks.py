"""A corpus's text as a prepare reads it: the files of --data, and each file in chunks of at most
2 * CHUNK_CHARS characters, cut where a byte-level pre-tokenizer splits anyway (`_cut`), so a file is
never held whole, whatever its lines; newlines made LF as `train.data.corpus.read_text` makes them.
"""

from __future__ import annotations

import codecs
import io
import re
import stat
from pathlib import Path
from typing import Callable, Iterator

from train.data.errors import DataError

CHUNK_CHARS = 1 << 20  # text encoded at a time: at least this much, at most twice (`_cut`)
READ_BYTES = 1 << 20
# Unicode's White_Space but the newline (what the tokenizers' `\s` matches; Python's str.isspace also counts
# U+001C..U+001F), before a non-space character: the places of `_cut`'s rule 2.
_BEFORE_WORD = re.compile("[\t\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000](?=\\S)")


def special_kind(path: Path) -> str | None:
    """"a character device", "a block device", "a named pipe (FIFO)" or "a socket"; None for anything else."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return None
    for test, kind in ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return None


def input_files(data: str | Path) -> list[Path]:
    """The text files of --data: the file, or a directory's *.txt files by name; DataError if none, or
    when --data is neither a file nor a directory (a device, a named pipe, a socket)."""
    data = Path(data)
    if not data.exists():
        raise DataError(f"--data {data} does not exist")
    if data.is_file():
        return [data]
    if not data.is_dir():
        raise DataError(f"--data {data} is {special_kind(data) or 'not a regular file'}, not a text file or a "
                        "directory")
    files = sorted(p for p in data.glob("*.txt") if p.is_file())
    if not files:
        raise DataError(f"--data {data} is a directory with no *.txt files")
    return files


def _cut(text: str, final: bool) -> int:
    """Where the next chunk of `text` ends: between CHUNK_CHARS and 2 * CHUNK_CHARS characters (0: not
    known yet, wait for more text; the whole text when it is the file's last).

    A chunk is encoded on its own, so it ends where the tokenizer's pre-tokenization splits anyway.
    GPT-2's pre-tokenizer (a `bpe:` tokenizer's, and that of the byte-level `hf:` ones) cuts text into
    pieces that never hold whitespace except one leading space (" king") or whitespace alone, and a
    run of whitespace before a non-space character is split before its last character, which begins a
    piece of its own (a tab, a newline) or the next word's (a space). So a piece always ends before the
    last whitespace character of such a run, and after a newline that stands alone between two
    non-space characters, whatever comes before and after; the pieces, and the ids, of two chunks cut
    there are those of the whole text. The places, in order:

    1. after the first newline between two non-space characters at or after CHUNK_CHARS ("king\\nthe"
       -> "king\\n" | "the"), as earlier versions cut (their ids are kept where such a place lies
       within 2 * CHUNK_CHARS);
    2. else before the first whitespace character other than a newline that is followed by a non-space
       character, at or after CHUNK_CHARS ("king  the" -> "king " | " the"), so that text without
       newlines is never held whole. Before it, not after: pre-tokenizers like Llama 3's join a space
       or tab to the word after it (and punctuation to the newlines after it, hence rule 1's newline
       between non-space characters);
    3. else (2 * CHUNK_CHARS characters without either: one very long word, or text written without
       spaces) at 2 * CHUNK_CHARS, the only cut that may split a piece of the pre-tokenizer in two and
       give other ids than the whole text there.

    A non-space character is one that Python's `str.isspace` refuses (it counts every character the
    tokenizers' `\\s` does, and U+001C..U+001F besides); the whitespace a rule 2 place begins with is
    one of Unicode's White_Space characters, what `\\s` matches.
    """
    if final:
        return len(text)
    limit = 2 * CHUNK_CHARS
    pos = text.find("\n", max(CHUNK_CHARS - 1, 1), limit)  # 1: ends at pos + 1 in [CHUNK_CHARS, limit]
    while 0 < pos < len(text) - 1:
        if not text[pos - 1].isspace() and not text[pos + 1].isspace():
            return pos + 1
        pos = text.find("\n", pos + 1, limit)
    if len(text) <= limit:
        return 0  # a place of kind 1 may still come
    found = _BEFORE_WORD.search(text, max(CHUNK_CHARS, 1), limit + 2)  # 2: ends in [CHUNK_CHARS, limit]
    return found.start() if found else limit  # 3


def read_chunks(path: Path, progress: Callable[[int], None] = lambda n: None) -> Iterator[str]:
    """The UTF-8 text of `path` in chunks of CHUNK_CHARS to 2 * CHUNK_CHARS characters (`_cut`; the
    last may be shorter), newlines made LF.

    `progress(n)` is called with the bytes read. DataError naming the file and offset for bytes
    that are not UTF-8.
    """
    decoder = io.IncrementalNewlineDecoder(codecs.getincrementaldecoder("utf-8")(), translate=True)
    pending, offset = "", 0
    with open(path, "rb") as f:
        while True:
            block = f.read(READ_BYTES)
            try:
                pending += decoder.decode(block, final=not block)
            except UnicodeDecodeError as err:
                raise DataError(f"data file {path} is not UTF-8 text (near byte {offset + err.start}): "
                                f"{err.reason}") from None
            offset += len(block)
            progress(len(block))
            while len(pending) >= CHUNK_CHARS or (not block and pending):
                cut = _cut(pending, final=not block)
                if cut == 0:
                    break
                chunk, pending = pending[:cut], pending[cut:]
                yield chunk
            if not block:
                return

