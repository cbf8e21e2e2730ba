"""A run's tokenizer: characters, bytes, or a Hugging Face tokenizer.json; each serialises to JSON for checkpoints.

`CharTokenizer` and `ByteTokenizer` are this project's own; `JSONTokenizer` holds a `tokenizers`
tokenizer.json as text (kind "bpe": a byte-level BPE trained by `python -m train.prepare`; kind
"hf": one copied from a Hugging Face directory). All three have `kind`, `vocab_size`,
`encode(text) -> int32 ids`, `decode(ids) -> str`, `to_dict()` (read back by `from_dict`) and
compare equal when they give the same ids. `to_hf_tokenizer` gives any of them as a Hugging Face
`tokenizers.Tokenizer` with the same ids, encoding and decoding (what `python -m train.export`
writes as tokenizer.json). The `tokenizers` package is imported only by the functions that need it.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from jaxattn.hf.tokenizer import check_unicode

JSON_KINDS = ("bpe", "hf")  # the kinds a JSONTokenizer holds
MAX_NAMED = 5  # unencodable pieces named in an error


def canonical_json(value: str | dict[str, Any]) -> bytes:
    """A JSON text or object as sorted-key, space-free UTF-8 JSON: equal for equal JSON however it
    was indented (what `JSONTokenizer` equality and `train.data.shard_format.tokenizer_hash` are of)."""
    obj = json.loads(value) if isinstance(value, str) else value
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


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
        self._table = np.full(ord(self.chars[-1]) + 1, -1, np.int32)  # code point -> id (-1: not a character here)
        self._table[[ord(c) for c in self.chars]] = np.arange(len(self.chars))

    @classmethod
    def from_text(cls, text: str) -> "CharTokenizer":
        return cls("".join(sorted(set(text))))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> np.ndarray:
        """str -> int32 ids [len(text)]; unknown characters raise ValueError."""
        # One code point per character, looked up in a table (vectorised, unlike a dict lookup per character).
        points = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), np.uint32)
        ids = self._table[np.minimum(points, len(self._table) - 1)]
        if points.size == 0 or (int(points.max()) < len(self._table) and int(ids.min()) >= 0):
            return ids
        unknown = sorted(set(text) - set(self._ids))
        raise ValueError(f"characters {unknown!r} are not in this tokenizer's vocabulary of {self.vocab_size} "
                         "characters; use a byte tokenizer for arbitrary text")

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


class JSONTokenizer:
    """A Hugging Face `tokenizers` tokenizer.json, held as its text (`json`); kind "bpe" or "hf".

    Ids are the tokenizer's own, special tokens never added (as `train.prepare` encodes a corpus);
    `vocab_size` counts the added tokens too. Two are equal when they are of the same kind and
    their JSON is the same (`canonical_json`: indentation and key order aside). `eos_token_id` is
    None: a run's token stream holds no end-of-sequence token to stop on. ValueError for a `kind`
    other than bpe/hf or a text the `tokenizers` library cannot read; ImportError without it.
    """

    eos_token_id = None

    def __init__(self, kind: str, tokenizer_json: str):
        if kind not in JSON_KINDS:
            raise ValueError(f"JSONTokenizer kind must be one of {JSON_KINDS}, got {kind!r}")
        if not isinstance(tokenizer_json, str):
            raise TypeError(f"tokenizer_json must be the text of a tokenizer.json, got {type(tokenizer_json).__name__}")
        try:
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError as err:
            raise ImportError(f"a {kind} tokenizer needs the tokenizers package: pip install tokenizers") from err
        try:
            self._hf = HFTokenizer.from_str(tokenizer_json)
        except Exception as err:  # noqa: BLE001: `tokenizers` raises a bare Exception
            raise ValueError(f"tokenizer_json is not a tokenizer.json the tokenizers library reads: {err}") from None
        self.kind, self.json = kind, tokenizer_json
        self.vocab_size = self._hf.get_vocab_size(with_added_tokens=True)
        self._canonical = canonical_json(tokenizer_json)

    def encode(self, text: str) -> np.ndarray:
        """str -> int32 ids, without special tokens; ValueError naming the pieces of `text` the
        tokenizer cannot encode (a vocabulary without an unknown token lacks them)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        check_unicode(text)
        try:
            return np.asarray(self._hf.encode(text, add_special_tokens=False).ids, dtype=np.int32)
        except Exception as err:  # noqa: BLE001: `tokenizers` raises a bare Exception ("Missing [UNK] token")
            bad = self._unencodable(text)
            named = f"{bad!r} are not in its vocabulary of {self.vocab_size} ids; " if bad else ""
            raise ValueError(f"this {self.kind} tokenizer cannot encode the text: {named}{err}") from None

    def encode_with_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """(ids int32 [L], offsets int64 [L, 2]): `encode(text)` and, per token, the [start, end)
        character range of `text` it stands for, as the `tokenizers` library reports it (a character
        split over several byte-level tokens gives each of them its whole range)."""
        try:
            encoding = self._hf.encode(text, add_special_tokens=False)
        except Exception:  # noqa: BLE001: encode says what cannot be encoded
            self.encode(text)
            raise
        offsets = np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2)
        return np.asarray(encoding.ids, dtype=np.int32), offsets

    def _unencodable(self, text: str) -> list[str]:
        """The first MAX_NAMED distinct pieces of `text`, as the tokenizer's normalizer and
        pre-tokenizer cut it, that do not encode on their own."""
        hf = self._hf
        try:
            normalized = hf.normalizer.normalize_str(text) if hf.normalizer is not None else text
            spans = ([span for _, span in hf.pre_tokenizer.pre_tokenize_str(normalized)]
                     if hf.pre_tokenizer is not None else [(0, len(normalized))])
        except Exception:  # noqa: BLE001: only the error message is at stake
            return []
        bad: list[str] = []
        for piece in dict.fromkeys(normalized[start:end] for start, end in spans):
            try:
                hf.encode(piece, add_special_tokens=False)
            except Exception:  # noqa: BLE001
                bad.append(piece)
                if len(bad) == MAX_NAMED:
                    break
        return bad

    def decode(self, ids) -> str:
        """Text of 1-D ids (a list, numpy or JAX array); ValueError for ids outside [0, vocab_size)."""
        ids = np.asarray(ids)
        if ids.ndim != 1 or not (ids.size == 0 or np.issubdtype(ids.dtype, np.integer)):
            raise ValueError(f"ids must be a 1-D sequence of integers, got {ids.dtype} of shape {ids.shape}")
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise ValueError(f"token ids must be in [0, {self.vocab_size}), got {ids.min()}..{ids.max()}")
        # Special tokens are kept: decode(encode(text)) is the text even where it spells one.
        return self._hf.decode([int(i) for i in ids], skip_special_tokens=False)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "tokenizer_json": self.json}

    def __eq__(self, other) -> bool:
        return isinstance(other, JSONTokenizer) and other.kind == self.kind and other._canonical == self._canonical

    def __repr__(self) -> str:
        return f"JSONTokenizer(kind={self.kind!r}, vocab_size={self.vocab_size})"


Tokenizer = CharTokenizer | ByteTokenizer | JSONTokenizer


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
    """The tokenizer of a `to_dict()`; ValueError for an unknown kind or a bpe/hf one without its JSON."""
    kind = values.get("kind")
    if kind == "char":
        return CharTokenizer(values["chars"])
    if kind == "byte":
        return ByteTokenizer()
    if kind in JSON_KINDS:
        if not isinstance(values.get("tokenizer_json"), str):
            raise ValueError(f"a {kind} tokenizer needs its tokenizer.json text under 'tokenizer_json', got "
                             f"keys {sorted(values)}")
        return JSONTokenizer(kind, values["tokenizer_json"])
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
    No special tokens (neither tokenizer has an end of sequence). bpe/hf (`JSONTokenizer`): its
    tokenizer.json, read again (a new object each call). ImportError without the `tokenizers`
    package; ValueError for any other tokenizer.
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
    if isinstance(tokenizer, JSONTokenizer):
        return HFTokenizer.from_str(tokenizer.json)
    kind = getattr(tokenizer, "kind", type(tokenizer).__name__)
    raise ValueError(f"no Hugging Face tokenizer for a tokenizer of kind {kind!r}")
