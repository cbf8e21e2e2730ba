"""Llama 1/2/3 and SmolLM 1/2 (`LlamaForCausalLM`): RoPE (default, linear, llama3, yarn), RMSNorm, gated MLP, GQA."""

from __future__ import annotations

from typing import Any

from jaxattn.config import ModelConfig
from jaxattn.hf.families import common
from jaxattn.hf.family import Biases, Family, Problem, Switch, features, layers
from jaxattn.hf.fields import Fields
from jaxattn.hf.weights import Entry

ARCH = "LlamaForCausalLM"
BIASES = Biases(qkv=Switch("attention_bias"), out=Switch("attention_bias"), mlp=Switch("mlp_bias"))


def read(hf: Fields) -> dict[str, Any]:
    return common.llama_fields(hf, ARCH, max_positions=2048)


def write(c: ModelConfig) -> dict[str, Any]:
    return common.llama_config(c)


def refusal(c: ModelConfig) -> list[Problem]:
    return features(c, ARCH) + layers(c, ARCH)


def layout(c: ModelConfig) -> list[Entry]:
    return common.decoder_layout(c, BIASES, common.llama_block, embed="model.embed_tokens.weight", final="model.norm")


FAMILY = Family("llama", ARCH, read, write, refusal, layout, BIASES)
