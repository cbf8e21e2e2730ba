"""Qwen2 / Qwen2.5 (`Qwen2ForCausalLM`): Llama with q/k/v biases (none on o_proj), windows per `layer_types`.

A sliding window applies (when `use_sliding_window`) to the layers `layer_types`
marks `sliding_attention`, by default those from `max_window_layers` on; the
others attend to the whole context (`ModelConfig.layer_pattern`, docs/theory.md §21).
"""

from __future__ import annotations

from typing import Any

from jaxattn.config import ModelConfig
from jaxattn.hf.families import common
from jaxattn.hf.family import Biases, Family, Problem, features, layers
from jaxattn.hf.fields import Fields
from jaxattn.hf.weights import Entry

ARCH = "Qwen2ForCausalLM"
BIASES = Biases(qkv=True)


def read(hf: Fields) -> dict[str, Any]:
    return dict(common.llama_fields(hf, ARCH, max_positions=32768), **common.qwen_layers(hf, ARCH))


def write(c: ModelConfig) -> dict[str, Any]:
    return dict(common.llama_config(c), **common.qwen_layers_config(c))


def refusal(c: ModelConfig) -> list[Problem]:
    return features(c, ARCH) + layers(c, ARCH, windows="any")


def layout(c: ModelConfig) -> list[Entry]:
    return common.decoder_layout(c, BIASES, common.llama_block, embed="model.embed_tokens.weight", final="model.norm")


FAMILY = Family("qwen2", ARCH, read, write, refusal, layout, BIASES)
