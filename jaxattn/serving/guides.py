"""What a request's output must match: the constraint a grammar engine compiles into a token mask per step.

A `Guide` is plain, hashable data (it is part of `SamplingParams`, and equal guides share one compiled
grammar). The HTTP layer makes one from OpenAI's `response_format` ({"type": "json_object"} or
{"type": "json_schema", ...}), from vLLM's extensions (`guided_regex`, `guided_choice`,
`guided_grammar`) and from `tool_choice` ("required" or a named function: the call's arguments
constrained by the function's JSON schema). The engine compiles it (`jaxattn.serving.structured`),
masks each drawn row's logits to the tokens the guide allows, and advances the guide by each token
drawn, so the answer always matches.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

GuideKind = Literal["json_object", "json_schema", "regex", "choice", "lark", "gbnf"]
KINDS: tuple[str, ...] = ("json_object", "json_schema", "regex", "choice", "lark", "gbnf")


@dataclasses.dataclass(frozen=True)
class Guide:
    """One constraint on a request's output.

    Attributes:
      kind: "json_object" (any JSON object; `spec` ignored), "json_schema" (`spec` the schema as JSON
        text), "regex" (`spec` the pattern), "choice" (`spec` a JSON list of the allowed strings),
        "lark" (`spec` a Lark grammar, llguidance's dialect) or "gbnf" (`spec` a llama.cpp GBNF grammar).
      spec: the constraint's text (see `kind`).
    """

    kind: GuideKind
    spec: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Guide.kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.spec, str):
            raise TypeError(f"Guide.spec must be a str, got {type(self.spec).__name__}")
