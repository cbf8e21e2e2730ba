"""OLMo 2 (`Olmo2ForCausalLM`): Llama with norms after attention and MLP only, and full-width q/k norms.

Blocks are x + post_attention_layernorm(attn(x)), then + post_feedforward_layernorm(mlp(.))
(`norm_placement="post"`, docs/theory.md §20); `q_norm` and `k_norm` are RMSNorms
over the whole N*H query and K*H key projection, before the head split and RoPE
(`qk_norm="full"`). `attention_bias` covers q, k, v and o.
"""

from __future__ import annotations

from typing import Any

from jaxattn.config import ModelConfig
from jaxattn.hf.families import common
from jaxattn.hf.family import Biases, Family, Problem, Switch, features, layers
from jaxattn.hf.fields import Fields
from jaxattn.hf.weights import Entry

ARCH = "Olmo2ForCausalLM"
BIASES = Biases(qkv=Switch("attention_bias"), out=Switch("attention_bias"))


def read(hf: Fields) -> dict[str, Any]:
    return dict(common.llama_fields(hf, ARCH, max_positions=2048, eps=1e-5), norm_placement="post", qk_norm="full")


def write(c: ModelConfig) -> dict[str, Any]:
    return common.llama_config(c)


def refusal(c: ModelConfig) -> list[Problem]:
    return features(c, ARCH, norm_placement="post", qk_norm="full") + layers(c, ARCH)


def block(c: ModelConfig, i: int, b: dict[str, bool]) -> list[Entry]:
    h = f"model.layers.{i}"
    return (common.attention(c, i, b, f"{h}.self_attn")
            + common.norm(c, i, "post_attn_norm", f"{h}.post_attention_layernorm")
            + common.w.gated_mlp((f"blocks_{i}", "mlp"), f"{h}.mlp", c, bias=b["mlp"])
            + common.norm(c, i, "post_mlp_norm", f"{h}.post_feedforward_layernorm"))


def layout(c: ModelConfig) -> list[Entry]:
    return common.decoder_layout(c, BIASES, block, embed="model.embed_tokens.weight", final="model.norm")


FAMILY = Family("olmo2", ARCH, read, write, refusal, layout, BIASES)
