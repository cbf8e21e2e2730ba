"""GPT-NeoX and Pythia (`GPTNeoXForCausalLM`): RoPE on `rotary_pct` of each head, LayerNorm, plain GELU MLP.

`use_parallel_residual` (Pythia: true) adds attention and MLP of the same input,
x + attn(ln_1(x)) + mlp(ln_2(x)) (`ModelConfig.residual="parallel"`, docs/theory.md §20);
false is the sequential block. `rotary_pct` (default 0.25) rotates the first
int(head_dim * pct) dims of each head, half-split (`rotary_fraction`, §19).
q, k and v are fused per head (rows `[N, 3, H]`, `jaxattn.hf.weights.neox_qkv`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxattn.config import ModelConfig
from jaxattn.hf import weights as w
from jaxattn.hf.families import common
from jaxattn.hf.family import ROTARY_BUFFER, Biases, Family, Problem, Switch, features, layers, one_of
from jaxattn.hf.fields import Fields
from jaxattn.hf.rope_params import read_rope
from jaxattn.hf.weights import Entry

ARCH = "GPTNeoXForCausalLM"
# One `attention_bias` switch for q/k/v and the output; MLP and LayerNorm biases always (zeros if absent).
BIASES = Biases(qkv=Switch("attention_bias", True), out=Switch("attention_bias", True), mlp=True, norm=True)


def read(hf: Fields) -> dict[str, Any]:
    d, n = hf.integer("hidden_size"), hf.integer("num_attention_heads")
    rope = read_rope(hf, default_theta=hf.number("rotary_emb_base", 10000.0),
                     default_partial=hf.number("rotary_pct", 0.25))
    return dict(**common.vocab(hf, max_positions=2048, tie=False),
                **common.rope_fields(ARCH, rope, d // n, partial=True), d_model=d,
                num_layers=hf.integer("num_hidden_layers"), num_heads=n, norm="layernorm",
                norm_eps=hf.number("layer_norm_eps", 1e-5), mlp="gelu",
                gelu_approximate=common.gelu_approximate(hf, ARCH, "hidden_act", "gelu"),
                mlp_hidden=hf.integer("intermediate_size", 4 * d), fused_qkv=True,
                residual="parallel" if hf.flag("use_parallel_residual", True) else "sequential")


def write(c: ModelConfig) -> dict[str, Any]:
    return dict(**common.sizes(c), hidden_act=common.gelu_name(c), layer_norm_eps=c.norm_eps,
                use_parallel_residual=c.residual == "parallel", rope_parameters=common.rope_parameters(c, partial=True),
                hidden_dropout=0.0)


def refusal(c: ModelConfig) -> list[Problem]:
    return (features(c, ARCH, norm="layernorm", mlp="gelu", residual=one_of("sequential", "parallel"),
                     rotary_fraction=common.EVEN_ROTARY) + layers(c, ARCH) + common.mha(c, ARCH))


def block(c: ModelConfig, i: int, b: dict[str, bool]) -> list[Entry]:
    D, F, N, H, p, h = c.d_model, c.mlp_hidden, c.num_heads, c.head_dim, (f"blocks_{i}",), f"gpt_neox.layers.{i}"
    columns = common.rope_columns(c, 2 * N)  # q and k columns of the fused [3, N, H] kernel
    if columns is not None:
        columns = np.concatenate([columns, np.arange(2 * N * H, 3 * N * H)])
    qkv = [Entry(p + ("attn", "qkv", "kernel"), (f"{h}.attention.query_key_value.weight",), ((3 * D, D),),
                 w.permuted(w.neox_qkv(N, H, bias=False), columns))]
    if b["qkv"]:
        qkv.append(Entry(p + ("attn", "qkv", "bias"), (f"{h}.attention.query_key_value.bias",), ((3 * D,),),
                         w.permuted(w.neox_qkv(N, H, bias=True), columns), True))
    return (w.norm(p + ("attn_norm",), f"{h}.input_layernorm", D, bias=True) + qkv
            + w.linear(p + ("attn", "out"), f"{h}.attention.dense", D, D, bias=b["out"])
            + w.norm(p + ("mlp_norm",), f"{h}.post_attention_layernorm", D, bias=True)
            + w.linear(p + ("mlp", "c_fc"), f"{h}.mlp.dense_h_to_4h", D, F, bias=True)
            + w.linear(p + ("mlp", "c_proj"), f"{h}.mlp.dense_4h_to_h", F, D, bias=True))


def layout(c: ModelConfig) -> list[Entry]:
    return common.decoder_layout(c, BIASES, block, embed="gpt_neox.embed_in.weight",
                                 final="gpt_neox.final_layer_norm")


FAMILY = Family("gpt_neox", ARCH, read, write, refusal, layout, BIASES, prefix="gpt_neox.",
                ignore=(r"\.attention\.(masked_)?bias$", ROTARY_BUFFER),
                aliases=(("embed_out.weight", "lm_head.weight"),), fused_qkv=True)
