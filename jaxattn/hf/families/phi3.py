"""Phi-3 (`Phi3ForCausalLM`): Llama with fused `qkv_proj` and `gate_up_proj`, partial rotary, one window.

`qkv_proj` rows are `[q (N*H); k (K*H); v (K*H)]` and `gate_up_proj` rows
`[gate (F); up (F)]`, the column order of jaxattn's fused `qkv` and `gate_up`
kernels. `partial_rotary_factor` f rotates the first int(H * f) dims of each
head (`rotary_fraction`, docs/theory.md §19); `sliding_window`, when set, is
every layer's window (the query and the W - 1 tokens before it). Phi-3's
long-context scaling (`longrope`, also what its config makes of `su` and
`yarn`) is refused. No biases.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxattn.config import ModelConfig
from jaxattn.hf import weights as w
from jaxattn.hf.families import common
from jaxattn.hf.family import Biases, Family, Problem, features, layers
from jaxattn.hf.fields import Fields
from jaxattn.hf.rope_params import rope_dict, rope_type
from jaxattn.hf.weights import Entry

ARCH = "Phi3ForCausalLM"
BIASES = Biases()


def read(hf: Fields) -> dict[str, Any]:
    kind = rope_type(rope_dict(hf))
    if kind != "default":
        common.reject(ARCH, "rope_parameters.rope_type", kind, "Phi-3's longrope scaling (which its config also "
                      "makes of 'su' and 'yarn') is not computed by jaxattn; rope_type 'default' is")
    return dict(common.llama_fields(hf, ARCH, max_positions=4096, eps=1e-5, partial=True), fused_qkv=True,
                sliding_window=hf.integer("sliding_window", None, null=None))


def write(c: ModelConfig) -> dict[str, Any]:
    return dict(common.sizes(c), num_key_value_heads=c.num_kv_heads, hidden_act=common.gated_act(c),
                rms_norm_eps=c.norm_eps, rope_parameters=common.rope_parameters(c, partial=True),
                sliding_window=c.sliding_window, original_max_position_embeddings=c.max_seq_len, resid_pdrop=0.0,
                embd_pdrop=0.0)


def refusal(c: ModelConfig) -> list[Problem]:
    problems = features(c, ARCH, rotary_fraction=common.EVEN_ROTARY) + layers(c, ARCH, windows="uniform")
    if c.head_dim * c.num_heads != c.d_model:
        problems.append(Problem("head_dim", c.head_dim, f"{ARCH} has head_dim = d_model / num_heads"))
    return problems


def block(c: ModelConfig, i: int, b: dict[str, bool]) -> list[Entry]:
    D, F, N, K, H, h = c.d_model, c.mlp_hidden, c.num_heads, c.num_kv_heads, c.head_dim, f"model.layers.{i}"
    q_cols, k_cols = common.rope_columns(c, N), common.rope_columns(c, K)
    columns = None if q_cols is None else np.concatenate([q_cols, N * H + k_cols, np.arange((N + K) * H,
                                                                                            (N + 2 * K) * H)])
    attn, mlp = (f"blocks_{i}", "attn"), (f"blocks_{i}", "mlp")
    return (common.norm(c, i, "attn_norm", f"{h}.input_layernorm")
            + w.linear(attn + ("qkv",), f"{h}.self_attn.qkv_proj", D, (N + 2 * K) * H, bias=False, columns=columns)
            + w.linear(attn + ("out",), f"{h}.self_attn.o_proj", N * H, D, bias=False)
            + common.norm(c, i, "mlp_norm", f"{h}.post_attention_layernorm")
            + w.linear(mlp + ("gate_up",), f"{h}.mlp.gate_up_proj", D, 2 * F, bias=False)
            + w.linear(mlp + ("down",), f"{h}.mlp.down_proj", F, D, bias=False))


def layout(c: ModelConfig) -> list[Entry]:
    return common.decoder_layout(c, BIASES, block, embed="model.embed_tokens.weight", final="model.norm")


FAMILY = Family("phi3", ARCH, read, write, refusal, layout, BIASES, fused_qkv=True)
