"""DeepSeek-V3 (`DeepseekV3ForCausalLM`) with dense MLPs: MLA, RoPE pairs interleaved or half-split (`rope_interleave`).

See `jaxattn.hf.families.mla`. Multi-token-prediction layers stored after the
model's (`num_nextn_predict_layers`) are not part of it and are ignored.
"""

from __future__ import annotations

from typing import Any

from jaxattn.config import ModelConfig
from jaxattn.hf.families import mla
from jaxattn.hf.family import Biases, Family, Problem, Switch
from jaxattn.hf.fields import Fields
from jaxattn.hf.weights import Entry

ARCH = "DeepseekV3ForCausalLM"
BIASES = Biases(qkv=Switch("attention_bias"), out=Switch("attention_bias"))


def read(hf: Fields) -> dict[str, Any]:
    return dict(mla.read(hf, ARCH, max_positions=4096), rope_interleaved=hf.flag("rope_interleave", True))


def write(c: ModelConfig) -> dict[str, Any]:
    return dict(mla.write(c), rope_interleave=c.rope_interleaved, num_nextn_predict_layers=0)


def refusal(c: ModelConfig) -> list[Problem]:
    return mla.refusal(c, ARCH)


def layout(c: ModelConfig) -> list[Entry]:
    return mla.layout(c, BIASES)


FAMILY = Family("deepseek_v3", ARCH, read, write, refusal, layout, BIASES,
                experts=lambda hf: mla.experts(hf, first_dense=3, count=256),
                extra_layers=lambda hf: hf.integer("num_nextn_predict_layers", 0, minimum=0))
