"""Mistral (`MistralForCausalLM`): Llama without biases, with one `sliding_window` W for every layer.

W: each query sees itself and the W - 1 tokens before it (`ModelConfig.sliding_window`).
transformers' Mistral ignores `layer_types`; a config.json mixing full and sliding
layers there is refused rather than read one way or the other.
"""

from __future__ import annotations

from typing import Any

from jaxattn.config import ModelConfig
from jaxattn.hf.families import common
from jaxattn.hf.family import Biases, Family, Problem, features, layers
from jaxattn.hf.fields import Fields
from jaxattn.hf.weights import Entry

ARCH = "MistralForCausalLM"
BIASES = Biases()


def read(hf: Fields) -> dict[str, Any]:
    kinds = hf.texts("layer_types", None)
    if kinds and len(set(kinds)) > 1:
        common.reject(ARCH, "layer_types", kinds, "a mix of full and sliding-window layers, which transformers' "
                      "Mistral ignores")
    return dict(common.llama_fields(hf, ARCH, max_positions=131072),
                sliding_window=hf.integer("sliding_window", 4096, null=None))


def write(c: ModelConfig) -> dict[str, Any]:
    return dict(common.llama_config(c), sliding_window=c.sliding_window)


def refusal(c: ModelConfig) -> list[Problem]:
    return features(c, ARCH) + layers(c, ARCH, windows="uniform")


def layout(c: ModelConfig) -> list[Entry]:
    return common.decoder_layout(c, BIASES, common.llama_block, embed="model.embed_tokens.weight", final="model.norm")


FAMILY = Family("mistral", ARCH, read, write, refusal, layout, BIASES)
