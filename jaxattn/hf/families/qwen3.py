"""Qwen3 (`Qwen3ForCausalLM`): Qwen2's windows, `attention_bias` for q/k/v/o, RMSNorm of each query and key head.

The q/k norm (`ModelConfig.qk_norm="head"`) has its own scale per head dim, applied before RoPE.
"""

from __future__ import annotations

from typing import Any

from jaxattn.config import ModelConfig
from jaxattn.hf.families import common
from jaxattn.hf.family import Biases, Family, Problem, Switch, features, layers
from jaxattn.hf.fields import Fields
from jaxattn.hf.weights import Entry

ARCH = "Qwen3ForCausalLM"
BIASES = Biases(qkv=Switch("attention_bias"), out=Switch("attention_bias"))


def read(hf: Fields) -> dict[str, Any]:
    return dict(common.llama_fields(hf, ARCH, max_positions=32768, head_dim=128), **common.qwen_layers(hf, ARCH),
                qk_norm="head")


def write(c: ModelConfig) -> dict[str, Any]:
    return dict(common.llama_config(c), **common.qwen_layers_config(c))


def refusal(c: ModelConfig) -> list[Problem]:
    return features(c, ARCH, qk_norm="head") + layers(c, ARCH, windows="any")


def layout(c: ModelConfig) -> list[Entry]:
    return common.decoder_layout(c, BIASES, common.llama_block, embed="model.embed_tokens.weight", final="model.norm")


FAMILY = Family("qwen3", ARCH, read, write, refusal, layout, BIASES)
