"""Speculative decoding as one command-line value: `SpeculativeOptions` and `parse_speculative`.

    ngram                                  prompt lookup, k = 4, n-grams of 1 to 3 tokens
    ngram:k=4,n_min=1,n_max=3,adaptive=0   the same with its settings (any of them, in any order)
    draft:DIR                              a draft model read from DIR, k = 4
    draft:DIR,k=2,adaptive=1               the same with its settings

The method comes before the first ':', then comma-separated items: `key=value` settings and, for
`draft`, the draft's path (the one item that is not a setting; it may hold ':' but not ','). What DIR
names, and how it is loaded, is the caller's (`python -m train.sample` reads a run directory, a
transformers directory or a GGUF file). `adaptive=0` keeps k fixed
(`jaxattn.speculative.schedule.AdaptiveK`). Anything else is a `ValueError` naming the bad part and
showing the accepted forms.
"""

from __future__ import annotations

import dataclasses
import re

from jaxattn._validate import is_int
from jaxattn.speculative.draft import DraftProposer
from jaxattn.speculative.ngram import NgramProposer, NgramSettings

METHODS = ("ngram", "draft")
KEYS = {"ngram": ("k", "n_min", "n_max", "adaptive"), "draft": ("k", "adaptive")}
FORMS = "ngram, ngram:k=4,n_min=1,n_max=3,adaptive=1, draft:DIR or draft:DIR,k=4,adaptive=1"
BOOLEANS = {"1": True, "true": True, "0": False, "false": False}
SETTING = re.compile(r"([a-z_]+)=(.*)", flags=re.S)  # a path such as runs/lr=3e-4 is not a setting


@dataclasses.dataclass(frozen=True)
class SpeculativeOptions:
    """How to decode speculatively.

    Attributes:
      method: "ngram" (prompt lookup, `NgramProposer`) or "draft" (a small model, `DraftProposer`).
      k: the most tokens drafted per step (>= 1).
      n_min, n_max: with "ngram", the shortest and longest suffix looked up (1 <= n_min <= n_max).
      draft: with "draft", where the draft model comes from (a path, read by the caller); None with "ngram".
      adaptive: let k follow the acceptance (`speculative_generate(adaptive=...)`).
    """

    method: str
    k: int = 4
    n_min: int = 1
    n_max: int = 3
    draft: str | None = None
    adaptive: bool = True

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"SpeculativeOptions.method must be one of {METHODS}, got {self.method!r}")
        for name in ("k", "n_min", "n_max"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"SpeculativeOptions.{name} must be a positive int, got {value!r}")
        if self.n_max < self.n_min:
            raise ValueError(f"SpeculativeOptions.n_max must be >= n_min={self.n_min}, got {self.n_max}")
        if self.method == "draft" and not (isinstance(self.draft, str) and self.draft):
            raise ValueError(f"SpeculativeOptions.draft must name the draft model (a path) with method 'draft', "
                             f"got {self.draft!r}")
        if self.method == "ngram" and self.draft is not None:
            raise ValueError(f"SpeculativeOptions.draft goes with method 'draft', not 'ngram', got {self.draft!r}")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"SpeculativeOptions.adaptive must be a bool, got {self.adaptive!r}")

    def ngram_settings(self) -> NgramSettings:
        """Prompt lookup's settings: `NgramSettings(n_min, n_max, k)`."""
        return NgramSettings(n_min=self.n_min, n_max=self.n_max, k=self.k)

    def describe(self) -> str:
        """One line: the method and its settings, e.g. "ngram k=4 n=1..3" or "draft runs/small k=4"."""
        what = f"ngram k={self.k} n={self.n_min}..{self.n_max}" if self.method == "ngram" else \
            f"draft {self.draft} k={self.k}"
        return what + ("" if self.adaptive else " (k fixed)")


def make_proposer(options: SpeculativeOptions, draft=None, *, kernels=None):
    """The proposer `options` asks for: a `NgramProposer`, or with method "draft" a `DraftProposer` of
    `draft`, the loaded draft model as `(params, config)` (its vocabulary is checked against the target's by
    `speculative_generate`)."""
    if options.method == "ngram":
        return NgramProposer(options.ngram_settings())
    if draft is None:
        raise ValueError(f"method 'draft' needs the draft model loaded from {options.draft!r}: pass "
                         "draft=(params, config)")
    params, config = draft
    return DraftProposer(params, config, k=options.k, kernels=kernels)


def _bad(text: str, what: str) -> ValueError:
    return ValueError(f"speculative decoding {text!r}: {what} (accepted: {FORMS})")


def _value(text: str, key: str, value: str):
    """A setting's value: a positive int, or for `adaptive` 0 or 1."""
    if key == "adaptive":
        if value.lower() not in BOOLEANS:
            raise _bad(text, f"adaptive={value!r} must be 0 or 1")
        return BOOLEANS[value.lower()]
    if not (value.isascii() and value.isdigit()) or int(value) < 1:
        raise _bad(text, f"{key}={value!r} must be a positive integer")
    return int(value)


def parse_speculative(text: str) -> SpeculativeOptions:
    """The options of a command-line value (the forms in the module docstring); a ValueError naming the bad
    part and showing the accepted forms."""
    if not isinstance(text, str):
        raise TypeError(f"parse_speculative takes a str, got {type(text).__name__}")
    method, colon, rest = text.partition(":")
    if method not in METHODS:
        raise _bad(text, f"unknown method {method!r}, expected one of {', '.join(METHODS)}")
    if colon and not rest:
        raise _bad(text, "nothing after ':'")
    settings, paths = {}, []
    for item in rest.split(",") if rest else []:
        setting = SETTING.fullmatch(item)
        if not item:
            raise _bad(text, "an empty item between commas")
        if setting is None:
            paths.append(item)
            continue
        key, value = setting.groups()
        if key not in KEYS[method]:
            raise _bad(text, f"unknown key {key!r} for {method}, expected {', '.join(KEYS[method])}")
        if key in settings:
            raise _bad(text, f"{key} is given twice")
        settings[key] = _value(text, key, value)
    if method == "ngram" and paths:
        raise _bad(text, f"{paths[0]!r} is not a key=value setting (ngram takes no path)")
    if method == "draft" and len(paths) != 1:
        raise _bad(text, "draft needs the draft model's path, draft:DIR" if not paths else
                   f"one draft path, got {len(paths)}: {', '.join(map(repr, paths))}")
    try:
        return SpeculativeOptions(method, draft=paths[0] if paths else None, **settings)
    except ValueError as err:  # n_max below n_min
        raise _bad(text, str(err).removeprefix("SpeculativeOptions.")) from None
