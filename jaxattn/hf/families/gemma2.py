"""Gemma 2 (`Gemma2ForCausalLM`): see `jaxattn.hf.families.gemma`, plus attention-logit soft-capping.

`attn_logit_softcapping` c: attention logits become c * tanh(logits / c) after the
scale, before the mask (`attn_logits_soft_cap`, docs/theory.md §17); layers
alternate local and global (`layer_types`; by default even layers local).
"""

from __future__ import annotations

from typing import Any

from jaxattn.config import ModelConfig
from jaxattn.hf.families import gemma
from jaxattn.hf.family import ANY, Biases, Family, Problem, Switch, layers
from jaxattn.hf.fields import Fields
from jaxattn.hf.weights import Entry

ARCH = "Gemma2ForCausalLM"
BIASES = Biases(qkv=Switch("attention_bias"), out=Switch("attention_bias"))


def read(hf: Fields) -> dict[str, Any]:
    return dict(gemma.read(hf, ARCH, max_positions=8192, pattern=2, final_cap=30.0),
                attn_logits_soft_cap=hf.number("attn_logit_softcapping", 50.0, null=None))


def write(c: ModelConfig) -> dict[str, Any]:
    return dict(gemma.write(c), attn_logit_softcapping=c.attn_logits_soft_cap)


def refusal(c: ModelConfig) -> list[Problem]:
    return gemma.refusal(c, ARCH, attn_logits_soft_cap=ANY) + layers(c, ARCH, windows="any")


def layout(c: ModelConfig) -> list[Entry]:
    return gemma.layout(c, BIASES)


FAMILY = Family("gemma2", ARCH, read, write, refusal, layout, BIASES)
