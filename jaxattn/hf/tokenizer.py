"""A checkpoint's tokenizer.json (the `tokenizers` library, no transformers) and its end-of-sequence id.

The end-of-sequence id is what generation stops on (`jaxattn.generate`'s
`stop_token`). It is looked up where transformers keeps it, first found wins:
generation_config.json, config.json, tokenizer_config.json's `eos_token`,
then the tokenizer's special tokens with a conventional end-of-text name. A
list of ids (several stop tokens) gives its first.

Every file is checked as it is read: a tokenizer.json the `tokenizers`
library cannot read, a JSON file that is not an object, or an id or token of
the wrong JSON type raises `InvalidCheckpoint` naming the file and key.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
from tokenizers import Tokenizer

from jaxattn._validate import is_int
from jaxattn.hf.errors import InvalidCheckpoint
from jaxattn.hf.fields import Fields, read_json_object, read_text

MAX_CHARS_TRIED = 256  # distinct characters tried one by one to name those a text cannot be encoded for


def check_unicode(text: str, what: str = "the text") -> None:
    """ValueError naming the first lone surrogate of `text` (a code point U+D800-U+DFFF alone, which JSON's
    escapes can carry): it is not a Unicode character, and no tokenizer encodes it."""
    try:
        text.encode("utf-8")  # at C speed; UTF-8 has no encoding for a surrogate
    except UnicodeEncodeError as err:
        raise ValueError(f"{what} holds a lone surrogate, U+{ord(text[err.start]):04X} at character {err.start}: it "
                         "is not a Unicode character (a pair of them escapes one in JSON); no tokenizer encodes it") \
            from None


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")  # what `tokenizer_files` writes
# Conventional end-of-text special tokens (GPT-2, Llama 1/2, Llama 3, Gemma, Qwen, DeepSeek).
EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>", "<｜end▁of▁sentence｜>")


class HFTokenizer:
    """Text <-> token ids through a `tokenizers.Tokenizer`, with the checkpoint's end-of-sequence id.

    Attributes:
      tokenizer: the wrapped `tokenizers.Tokenizer`.
      eos_token_id: the end-of-sequence id, or None when the checkpoint names none.
      vocab_size: ids the tokenizer can produce (added tokens included).
    """

    def __init__(self, tokenizer: Tokenizer, eos_token_id: int | None = None):
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text` (with the tokenizer's own special tokens, e.g. a BOS, unless asked not to).

        ValueError (naming the characters the vocabulary lacks) where the tokenizer cannot encode it.
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        check_unicode(text)
        try:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        except Exception as err:  # `tokenizers` raises a bare Exception (e.g. "Missing [UNK] token")
            # A character is unknown when it does not encode alone (a byte-level vocabulary spells "\n" as "Ċ":
            # looking characters up in the vocabulary would name every newline).
            unknown = [c for c in sorted(set(text))[:MAX_CHARS_TRIED] if not self._encodes(c)]
            known = f"characters {unknown!r} are not in its vocabulary; " if unknown else ""
            raise ValueError(f"the tokenizer cannot encode the text: {known}{err}") from None

    def _encodes(self, char: str) -> bool:
        try:
            self.tokenizer.encode(char, add_special_tokens=False)
        except Exception:  # noqa: BLE001 - the same bare Exception
            return False
        return True

    def decode(self, ids: Sequence[int] | np.ndarray, skip_special_tokens: bool = True) -> str:
        """Text of a 1-D sequence of ids (a list, numpy or JAX array)."""
        ids = np.asarray(ids)
        if ids.ndim != 1:
            raise ValueError(f"ids must be 1-D, got shape {ids.shape}")
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def __repr__(self) -> str:
        return f"HFTokenizer(vocab_size={self.vocab_size}, eos_token_id={self.eos_token_id})"


def _json(path: Path) -> Fields:
    """The JSON object of an optional file (empty when absent); InvalidCheckpoint if it is no JSON object."""
    return Fields(read_json_object(path) if path.exists() else {}, path)


def _first_id(fields: Fields, key: str) -> int | None:
    """An id, or the first of a list of ids (several stop tokens); None when absent."""
    value = fields.get(key)
    ids = value if isinstance(value, list) else [value]
    if not all(is_int(i, numpy=False) and i >= 0 for i in ids if i is not None):
        raise fields.invalid(key, f"expected a token id (an integer >= 0) or a list of them, got {value!r}")
    return ids[0] if ids else None


def _eos_token(fields: Fields) -> str | None:
    """tokenizer_config.json's `eos_token`: a string, or an AddedToken object with its `content`."""
    token = fields.get("eos_token")
    token = token.get("content") if isinstance(token, dict) else token
    if token is not None and not isinstance(token, str):
        raise fields.invalid("eos_token", f"expected a token (a string or {{\"content\": string}}), got {token!r}")
    return token


def _eos_from_tokenizer(directory: Path, tokenizer: Tokenizer) -> int | None:
    token = _eos_token(_json(directory / "tokenizer_config.json"))
    if token is not None and tokenizer.token_to_id(token) is not None:
        return tokenizer.token_to_id(token)
    special = {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    return next((special[name] for name in EOS_NAMES if name in special), None)


def find_eos(directory: Path, tokenizer: Tokenizer) -> int | None:
    """The end-of-sequence id of a checkpoint directory (see the module docstring for the order)."""
    for name in ("generation_config.json", "config.json"):
        found = _first_id(_json(directory / name), "eos_token_id")
        if found is not None:
            return found
    return _eos_from_tokenizer(directory, tokenizer)


def read_tokenizer(file: Path) -> Tokenizer:
    """The `tokenizers.Tokenizer` of a tokenizer.json; InvalidCheckpoint naming it if it cannot be read."""
    text = read_text(file, " (only the `tokenizers` format, tokenizer.json, is read)")
    try:
        return Tokenizer.from_str(text)
    except Exception as err:  # noqa: BLE001 (`tokenizers` raises a bare Exception, e.g. "Model missing.")
        raise InvalidCheckpoint(file, None, f"is not a tokenizer the tokenizers library reads ({err})") from None


def load_tokenizer(path) -> HFTokenizer:
    """The tokenizer of a checkpoint directory (its tokenizer.json), or of a tokenizer.json file.

    InvalidCheckpoint (naming the file, and the key) for a missing or
    unreadable tokenizer.json, or a generation_config.json, config.json or
    tokenizer_config.json beside it that is no JSON object or holds an
    end-of-sequence id or token of the wrong type.
    """
    path = Path(path)
    file = path if path.is_file() else path / "tokenizer.json"
    tokenizer = read_tokenizer(file)
    return HFTokenizer(tokenizer, find_eos(file.parent, tokenizer))


def as_tokenizer(tokenizer) -> Tokenizer:
    """The `tokenizers.Tokenizer` of a Tokenizer or an `HFTokenizer` (TypeError for anything else)."""
    tokenizer = tokenizer.tokenizer if isinstance(tokenizer, HFTokenizer) else tokenizer
    if not isinstance(tokenizer, Tokenizer):
        raise TypeError(f"tokenizer must be a tokenizers.Tokenizer or HFTokenizer, got {type(tokenizer).__name__}")
    return tokenizer


def tokenizer_files(tokenizer, eos_token_id: int | None = None) -> dict[str, Callable[[Path], None]]:
    """`{file name: write(path)}` of tokenizer.json and a tokenizer_config.json that transformers' AutoTokenizer reads."""
    tokenizer = as_tokenizer(tokenizer)
    settings: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
    if eos_token_id is not None and tokenizer.id_to_token(eos_token_id) is not None:
        settings["eos_token"] = tokenizer.id_to_token(eos_token_id)
    return {"tokenizer.json": lambda path: tokenizer.save(str(path)),
            "tokenizer_config.json": lambda path: path.write_text(json.dumps(settings, indent=2) + "\n")}
