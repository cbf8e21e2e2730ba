"""Character- and byte-level tokenizers; both serialise to JSON for checkpoints.

`to_hf_tokenizer` gives either one as a Hugging Face `tokenizers.Tokenizer` with the same
ids, encoding and decoding (what `python -m train.export` writes as tokenizer.json).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np


class CharTokenizer:
    """Ids are positions in the sorted set of characters of a corpus (nanoGPT's shakespeare_char)."""

    kind = "char"

    def __init__(self, chars: str):
        if not chars:
            raise ValueError("CharTokenizer needs at least one character")
        if len(set(chars)) != len(chars):
            raise ValueError("CharTokenizer characters must be unique")
        self.chars = "".join(sorted(chars))
        self._ids = {c: i for i, c in enumerate(self.chars)}
        self._lookup = np.array(list(self.chars))

    @classmethod
    def from_text(cls, text: str) -> "CharTokenizer":
        return cls("".join(sorted(set(text))))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> np.ndarray:
        """str -> int32 ids [len(text)]; unknown characters raise ValueError."""
        try:
            return np.fromiter((self._ids[c] for c in text), dtype=np.int32, count=len(text))
        except KeyError:
            unknown = sorted(set(text) - set(self._ids))
            raise ValueError(
                f"characters {unknown!r} are not in this tokenizer's vocabulary of "
                f"{self.vocab_size} characters; use a byte tokenizer for arbitrary text") from None

    def decode(self, ids) -> str:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise ValueError(f"token ids must be in [0, {self.vocab_size}), got {ids.min()}..{ids.max()}")
        return "".join(self._lookup[ids])

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "chars": self.chars}

    def __eq__(self, other) -> bool:
        return isinstance(other, CharTokenizer) and other.chars == self.chars


class ByteTokenizer:
    """Ids are the UTF-8 bytes of the text (vocab 256); decoding replaces broken sequences."""

    kind = "byte"
    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() > 255):
            raise ValueError(f"byte token ids must be in [0, 256), got {ids.min()}..{ids.max()}")
        return ids.astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind}

    def __eq__(self, other) -> bool:
        return isinstance(other, ByteTokenizer)


Tokenizer = CharTokenizer | ByteTokenizer


def build_tokenizer(kind: str, text: str) -> Tokenizer:
    """The tokenizer of `kind` ('char' or 'byte') for a corpus."""
    if kind == "char":
        return CharTokenizer.from_text(text)
    if kind == "byte":
        return ByteTokenizer()
    raise ValueError(f"tokenizer kind must be 'char' or 'byte', got {kind!r}")


def to_json(tokenizer: Tokenizer) -> str:
    return json.dumps(tokenizer.to_dict(), ensure_ascii=False)


def from_dict(values: dict[str, Any]) -> Tokenizer:
    kind = values.get("kind")
    if kind == "char":
        return CharTokenizer(values["chars"])
    if kind == "byte":
        return ByteTokenizer()
    raise ValueError(f"unknown tokenizer kind {kind!r} in {values!r}")


def from_json(text: str) -> Tokenizer:
    return from_dict(json.loads(text))


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table: the alphabet of `tokenizers`' ByteLevel."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(others)}}


def to_hf_tokenizer(tokenizer: Tokenizer):
    """A `tokenizers.Tokenizer` with exactly the ids, encoding and decoding of `tokenizer`.

    char: a word-level vocabulary of single characters, the text split into characters
    (newlines and spaces included) and a decoder that concatenates them; an unknown character
    is an encoding error, as with `CharTokenizer`. byte: GPT-2's byte-level alphabet with
    id = byte value and no merges; decoding replaces broken UTF-8 as `ByteTokenizer` does.
    No special tokens (neither tokenizer has an end of sequence). ImportError without
    the `tokenizers` package; ValueError for any other tokenizer.
    """
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    if isinstance(tokenizer, CharTokenizer):
        hf = HFTokenizer(models.WordLevel({c: i for i, c in enumerate(tokenizer.chars)}, unk_token=None))
        hf.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # one piece per character
        hf.decoder = decoders.Fuse()  # join without spaces
        return hf
    if isinstance(tokenizer, ByteTokenizer):
        hf = HFTokenizer(models.BPE({c: b for b, c in _bytes_to_unicode().items()}, [], unk_token=None))
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        hf.decoder = decoders.ByteLevel()
        return hf
    kind = getattr(tokenizer, "kind", type(tokenizer).__name__)
    raise ValueError(f"no Hugging Face tokenizer for a tokenizer of kind {kind!r}")
