"""GPT-2 (`GPT2LMHeadModel`): learned positions, LayerNorm, plain GELU MLP, biases everywhere, fused QKV.

Its `Conv1D` projections store `[in, out]`, the layout of jaxattn's kernels.
The checkpoint's causal-mask buffers (`attn.bias`, `attn.masked_bias`) are ignored.
"""

from __future__ import annotations

from typing import Any

from jaxattn.config import ModelConfig
from jaxattn.hf import weights as w
from jaxattn.hf.families import common
from jaxattn.hf.family import ROTARY_BUFFER, Biases, Family, Problem, features, layers
from jaxattn.hf.fields import Fields
from jaxattn.hf.weights import Entry

ARCH = "GPT2LMHeadModel"
BIASES = Biases(qkv=True, out=True, mlp=True, norm=True)  # zeros where a jaxattn config has none


def read(hf: Fields) -> dict[str, Any]:
    for field, ok in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                      ("reorder_and_upcast_attn", False), ("add_cross_attention", False)):
        if hf.flag(field, ok) != ok:
            common.reject(ARCH, field, hf[field], f"jaxattn computes GPT-2 with {field}={ok}")
    d = hf.integer("n_embd", 768)
    return dict(vocab_size=hf.integer("vocab_size"), d_model=d, num_layers=hf.integer("n_layer", 12),
                num_heads=hf.integer("n_head", 12), positions="learned", max_seq_len=hf.integer("n_positions", 1024),
                norm="layernorm", norm_eps=hf.number("layer_norm_epsilon", 1e-5), mlp="gelu",
                gelu_approximate=common.gelu_approximate(hf, ARCH, "activation_function", "gelu_new"),
                mlp_hidden=hf.integer("n_inner", 4 * d), fused_qkv=True,
                tie_embeddings=hf.flag("tie_word_embeddings", True))


def write(c: ModelConfig) -> dict[str, Any]:
    return dict(n_embd=c.d_model, n_layer=c.num_layers, n_head=c.num_heads, n_positions=c.max_seq_len,
                n_inner=c.mlp_hidden, activation_function="gelu_new" if c.gelu_approximate else "gelu",
                layer_norm_epsilon=c.norm_eps, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False)


def refusal(c: ModelConfig) -> list[Problem]:
    return (features(c, ARCH, positions="learned", norm="layernorm", mlp="gelu") + layers(c, ARCH)
            + common.mha(c, ARCH))


def block(c: ModelConfig, i: int, b: dict[str, bool]) -> list[Entry]:
    D, F, p, h = c.d_model, c.mlp_hidden, (f"blocks_{i}",), f"transformer.h.{i}"
    return (w.norm(p + ("attn_norm",), f"{h}.ln_1", D, bias=True)
            + w.linear(p + ("attn", "qkv"), f"{h}.attn.c_attn", D, 3 * D, bias=True, conv1d=True)
            + w.linear(p + ("attn", "out"), f"{h}.attn.c_proj", D, D, bias=True, conv1d=True)
            + w.norm(p + ("mlp_norm",), f"{h}.ln_2", D, bias=True)
            + w.linear(p + ("mlp", "c_fc"), f"{h}.mlp.c_fc", D, F, bias=True, conv1d=True)
            + w.linear(p + ("mlp", "c_proj"), f"{h}.mlp.c_proj", F, D, bias=True, conv1d=True))


def layout(c: ModelConfig) -> list[Entry]:
    return common.decoder_layout(c, BIASES, block, embed="transformer.wte.weight", final="transformer.ln_f",
                                 learned="transformer.wpe.weight")


FAMILY = Family("gpt2", ARCH, read, write, refusal, layout, BIASES, prefix="transformer.",
                ignore=(r"\.attn\.(masked_)?bias$", ROTARY_BUFFER), fused_qkv=True)
