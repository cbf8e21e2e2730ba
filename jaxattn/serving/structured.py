"""Structured outputs: a `Guide` compiled by llguidance into a matcher per request, and its token masks.

    compiler = GuideCompiler(tokenizer.to_str(), vocab_size=config.vocab_size, eos_token_ids=(eos,))
    state = compiler.start(Guide("json_schema", schema_text))  # RequestError (param "guide") if bad
    compiler.fill_masks([(state, row)], bitmask)  # bitmask [M, ceil(V/32)] int32, filled in Rust
    state.advance(token)  # None, or why the request ends ("stop": the guide is complete)

llguidance (what vLLM and SGLang use, and llama.cpp can) compiles JSON schemas, regexes, choices, Lark
and GBNF grammars lazily against the tokenizer's byte trie; it was picked over xgrammar by
`bench/grammar.py` (docs/serving.md has the figures' summary). A compiled guide is kept once per
`Guide` (a pristine matcher, deep-copied for each request), so equal guides compile once.

JSON is constrained to one compact form, `{"key": value, "k2": [1, 2]}` (", " and ": " between items, no
other whitespace): whitespace anywhere would let a model spend its tokens on blanks, and the answer is
the JSON the schema describes whatever its indentation.

A mask is one bit per token id (bit `i % 32` of word `i // 32`; set: allowed), `V` bits a row, padded
ids past the tokenizer's vocabulary refused. `fill_masks` fills every constrained row of a step in one
call to llguidance's parallel executor, which releases the GIL and loops over the vocabulary in Rust.
"""

from __future__ import annotations

import json
import threading
from typing import Callable, Iterable, Sequence

import llguidance
import llguidance.numpy
import numpy as np

from jaxattn.serving.guides import Guide
from jaxattn.serving.validation import RequestError

# Compact JSON: no free whitespace, Python's json.dumps separators.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_LIMIT = 256  # compiled guides kept (oldest dropped first)


def mask_words(vocab_size: int) -> int:
    """W, the int32 words of one row's mask: ceil(V / 32)."""
    return -(-vocab_size // 32)


def grammar_text(guide: Guide) -> str:
    """The guide as an llguidance grammar (not yet checked against a tokenizer). RequestError (param
    "guide") for a spec that is not what its kind says (a schema that is no JSON object, a choice that is
    no list of strings, a GBNF grammar that does not convert)."""
    try:
        if guide.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
        if guide.kind == "json_schema":
            schema = json.loads(guide.spec)
            if not isinstance(schema, dict):
                raise ValueError(f"a JSON schema is a JSON object, got {type(schema).__name__}")
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
        if guide.kind == "choice":
            choices = json.loads(guide.spec)
            if not (isinstance(choices, list) and choices and all(isinstance(c, str) and c for c in choices)):
                raise ValueError(f"a choice is a non-empty list of non-empty strings, got {guide.spec!r}")
            return llguidance.grammar_from("choice", guide.spec)
        return llguidance.grammar_from(guide.kind, guide.spec)  # regex, lark, gbnf
    except ValueError as err:  # json.JSONDecodeError is one
        raise RequestError(f"the {guide.kind} guide cannot be compiled: {err}", param="guide") from None


class GuideState:
    """One request's place in its guide: the mask of the next token, and each token drawn consumed."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self.matcher = matcher

    def advance(self, token: int) -> str | None:
        """Consumes a drawn token -> None (go on), "stop" (the guide is complete: nothing may follow) or
        "error" (the guide refused the token: a row drawn from an empty mask, never a masked draw)."""
        if not self.matcher.consume_token(int(token)):
            return "error"
        return "stop" if self.matcher.is_stopped() else None

    @property
    def accepting(self) -> bool:
        """The output so far matches the guide whole (it may still go on)."""
        return self.matcher.is_accepting()


class GuideCompiler:
    """Compiles guides for one tokenizer and fills the masks of the rows they constrain.

    Args:
      tokenizer: the tokenizer's tokenizer.json text (`tokenizers.Tokenizer.to_str()`; llguidance reads
        each token's bytes from it), or an `llguidance.TokenizerWrapper` (`from_token_bytes`).
      vocab_size: V, the model's logits per row (at least the tokenizer's ids; ids past them are refused).
      eos_token_ids: the end-of-sequence ids a complete answer may end with (the first is llguidance's).
      threads: llguidance's mask threads (None: its default, most of the cores).
    """

    def __init__(self, tokenizer: str | llguidance.TokenizerWrapper, vocab_size: int,
                 eos_token_ids: Sequence[int] = (), *, threads: int | None = None):
        eos = [int(t) for t in eos_token_ids]
        self.tokenizer = llguidance.LLTokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos or None)
        self.vocab_size, self.words = vocab_size, mask_words(vocab_size)
        self._executor = llguidance.LLExecutor(threads)
        self._compiled: dict[Guide, llguidance.LLMatcher] = {}
        self._lock = threading.Lock()  # the HTTP threads may compile while the engine's thread starts

    @classmethod
    def from_token_bytes(cls, tokens: Sequence[bytes], encode: Callable[[str], list[int]], vocab_size: int,
                         eos_token_ids: Sequence[int] = (), **kwargs) -> "GuideCompiler":
        """For a tokenizer that has no tokenizer.json llguidance reads (one token per character): each
        id's bytes (`tokens[id]`) and its text -> ids."""
        eos = [int(t) for t in eos_token_ids]
        tokens = list(tokens) + [b""] * (vocab_size - len(tokens))  # ids past the tokenizer's: no bytes, never allowed
        wrapped = _TokenBytes(tokens, encode, eos[0] if eos else None)
        return cls(llguidance.TokenizerWrapper(wrapped), vocab_size, eos, **kwargs)

    def start(self, guide: Guide) -> GuideState:
        """A fresh state of `guide` for one request (compiled once per equal guide). RequestError (param
        "guide") for a guide llguidance cannot compile: a bad schema, regex or grammar."""
        with self._lock:
            pristine = self._compiled.get(guide)
        if pristine is None:
            pristine = self._compile(guide)
            with self._lock:
                if len(self._compiled) >= CACHE_LIMIT:
                    self._compiled.pop(next(iter(self._compiled)))
                self._compiled[guide] = pristine
        return GuideState(pristine.deep_copy())

    def _compile(self, guide: Guide) -> llguidance.LLMatcher:
        grammar = grammar_text(guide)
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise RequestError(f"the {guide.kind} guide cannot be compiled: {error.strip()}", param="guide")
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise RequestError(f"the {guide.kind} guide cannot be compiled: {matcher.get_error()}", param="guide")
        return matcher

    def fill_masks(self, rows: Iterable[tuple[GuideState, int]], bitmask: np.ndarray) -> None:
        """Writes each state's mask of allowed next tokens into `bitmask[row]` ([M, W] int32, C order),
        every row in one parallel call; rows not named are left as they are."""
        pairs = [(state.matcher, row) for state, row in rows]
        if pairs:
            llguidance.numpy.fill_next_token_bitmask_par(self._executor, pairs, bitmask)


class _TokenBytes:
    """What `llguidance.TokenizerWrapper` reads of a tokenizer: its tokens' bytes, its ids of a text."""

    def __init__(self, tokens: list[bytes], encode: Callable[[str], list[int]], eos_token_id: int | None):
        self.tokens, self._encode = tokens, encode
        self.eos_token_id, self.bos_token_id = eos_token_id, None

    def __call__(self, text: str) -> list[int]:
        return [int(t) for t in self._encode(text)]
