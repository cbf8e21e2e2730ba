"""DeepSeek-V2 (`DeepseekV2ForCausalLM`) with dense MLPs: MLA, RoPE pairs always interleaved, optional MLP biases.

See `jaxattn.hf.families.mla`.
"""

from __future__ import annotations

from typing import Any

from jaxattn.config import ModelConfig
from jaxattn.hf.families import mla
from jaxattn.hf.family import Biases, Family, Problem, Switch
from jaxattn.hf.fields import Fields
from jaxattn.hf.weights import Entry

ARCH = "DeepseekV2ForCausalLM"
BIASES = Biases(qkv=Switch("attention_bias"), out=Switch("attention_bias"), mlp=Switch("mlp_bias"))


def read(hf: Fields) -> dict[str, Any]:
    return dict(mla.read(hf, ARCH, max_positions=2048), rope_interleaved=True)


def write(c: ModelConfig) -> dict[str, Any]:
    return mla.write(c)


def refusal(c: ModelConfig) -> list[Problem]:
    problems = mla.refusal(c, ARCH)
    if c.positions == "rope" and not c.rope_interleaved:
        problems.append(Problem("rope_interleaved", False, f"{ARCH} pairs RoPE dims interleaved only"))
    return problems


def layout(c: ModelConfig) -> list[Entry]:
    return mla.layout(c, BIASES)


FAMILY = Family("deepseek_v2", ARCH, read, write, refusal, layout, BIASES,
                experts=lambda hf: mla.experts(hf, first_dense=0, count=64))
