"""A fine-tuning run's documents: (ids, weights) pairs, a loss weight per token, and plain text split
into such documents (`text_documents`, every weight 1). Chats make them too (`train.data.chats`);
`train.data.packing` lays them into rows.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from train.data.errors import DataError
from train.data.tokenizer import Tokenizer

TEXT_SPLITS = ("paragraphs", "file")

Document = tuple[np.ndarray, np.ndarray]  # (ids int32 [L], weights float32 [L])


def read_utf8(path: Path) -> str:
    """The file's text; DataError naming it when it cannot be read or is not UTF-8."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: is not UTF-8 text (near byte {err.start}): {err.reason}") from None
    except OSError as err:
        raise DataError(f"{path}: cannot be read ({err.strerror or err})") from None


def text_documents(path: str | Path, tokenizer: Tokenizer, *, split: str = "paragraphs") -> list[Document]:
    """The documents of a UTF-8 text file, each (ids int32 [L], weights float32 [L] all 1).

    split="paragraphs": a document per run of non-blank lines (blank: nothing but whitespace),
    its lines joined by newlines; split="file": the whole file, one document. Newlines are made LF.
    Nothing is added between documents: `train.data.packing.pack` keeps them apart with segment ids.
    DataError naming the file when it cannot be read, is not UTF-8 or holds no text.
    """
    if split not in TEXT_SPLITS:
        raise ValueError(f"split must be one of {TEXT_SPLITS}, got {split!r}")
    path = Path(path)
    text = read_utf8(path)
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
