"""What the structured-output tests share: a small byte-level BPE tokenizer trained here, whose tokens
span several characters (`bpe_tokenizer`), and JSON schemas drawn (seeded) from a fixed list of shapes
(`draw_schema`), each bounded so that a random model's answer ends well within its `max_tokens`.
"""

from __future__ import annotations

import json

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS = "<eos>"  # id 0
# JSON, numbers and words: the merges give tokens such as '": "', '{"', 'name', '123'.
TEXT = [json.dumps({"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["math", "poet"],
                    "active": True, "score": -12.75, "id": "AB-123", "items": [{"x": 1}, {"x": 22}], "z": None}),
        "the quick brown fox jumps over the lazy dog 0123456789 yes no maybe red green blue",
        "ROMEO: But soft, what light through yonder window breaks? It is the east."]


def bpe_tokenizer(vocab_size: int = 320) -> Tokenizer:
    """A byte-level BPE (GPT-2's alphabet, so any text encodes) of at most `vocab_size` ids, `<eos>` = 0."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(TEXT * 20, trainer)
    return tokenizer


def _name(rng) -> str:
    return str(rng.choice(["name", "id", "age", "email", "tags", "kind", "size", "note", "x", "y", "level"]))


def _string(rng) -> dict:
    return {"type": "string", "minLength": int(rng.integers(0, 3)), "maxLength": int(rng.integers(3, 9))}


def _integer(rng) -> dict:
    low = int(rng.integers(-50, 50))
    return {"type": "integer", "minimum": low, "maximum": low + int(rng.integers(1, 1000))}


def _number(rng) -> dict:
    # A step, so that the fraction ends (a random model would otherwise draw digits for ever); one exact in
    # binary, as jsonschema checks 4.1 against 0.1 in floats and finds a remainder.
    return {"type": "number", "minimum": float(rng.integers(-20, 0)), "maximum": float(rng.integers(1, 30)),
            "multipleOf": float(rng.choice([0.5, 0.25, 0.125]))}


def _enum(rng) -> dict:
    return {"enum": [str(v) for v in rng.choice(["red", "green", "blue", "yes", "no", "maybe"], 3, replace=False)]}


def _pattern(rng) -> dict:
    return {"type": "string", "pattern": str(rng.choice([r"^[A-Z]{2}-[0-9]{3}$", r"^[a-z]{1,6}@example\.org$",
                                                          r"^(yes|no)$", r"^[0-9]{4}-[0-9]{2}$"]))}


def _array(rng, depth: int) -> dict:
    low = int(rng.integers(0, 2))
    return {"type": "array", "items": _value(rng, depth + 1), "minItems": low, "maxItems": low + int(rng.integers(1, 3))}


def _object(rng, depth: int) -> dict:
    names = sorted({_name(rng) for _ in range(int(rng.integers(1, 4)))})
    properties = {n: _value(rng, depth + 1) for n in names}
    required = [n for n in names if rng.random() < 0.7]
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def _value(rng, depth: int) -> dict:
    leaves = [_string, _integer, _number, _enum, _pattern, lambda r: {"type": "boolean"},
              lambda r: {"anyOf": [_integer(r), {"type": "null"}]}]
    if depth < 2 and rng.random() < 0.4:
        return (_object if rng.random() < 0.5 else _array)(rng, depth)
    return leaves[int(rng.integers(len(leaves)))](rng)


def draw_schema(rng: np.random.Generator) -> dict:
    """A schema whose top is an object: nested objects, arrays, enums, bounded numbers, strings with
    patterns or lengths, optional properties, nullable values."""
    return _object(rng, 0)


def draw_schemas(count: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [draw_schema(rng) for _ in range(count)]
