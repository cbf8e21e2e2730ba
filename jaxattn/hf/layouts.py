"""Each supported family's checkpoint layout: tensor names, shapes and codecs for a `ModelConfig`.

`layout(family, config)` lists every tensor of a transformers checkpoint of
that family with the jaxattn parameter it holds (see `jaxattn.hf.weights`).
`bias_flags` says which biases the transformers model has for a config (the
same rule decides the layout and the exported config.json), and `FAMILIES`
holds what a reader needs besides: the base-model prefix, buffers that are
not parameters, and legacy names.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from jaxattn.config import ModelConfig
from jaxattn.hf import weights as w
from jaxattn.hf.weights import Entry


@dataclasses.dataclass(frozen=True)
class Family:
    """What loading needs to know about a family beyond its layout.

    Attributes:
      prefix: the base model's name prefix (hub checkpoints saved from the base
        model lack it; the reader adds it back).
      ignore: patterns of stored tensors that are buffers, not parameters.
      aliases: legacy tensor name -> current name.
    """

    prefix: str
    ignore: tuple[str, ...] = (r"rotary_emb\.inv_freq$",)
    aliases: tuple[tuple[str, str], ...] = ()


FAMILIES = {
    "gpt2": Family("transformer.", (r"\.attn\.(masked_)?bias$", r"rotary_emb\.inv_freq$")),
    "gpt_neox": Family("gpt_neox.", (r"\.attention\.(masked_)?bias$", r"rotary_emb\.inv_freq$"),
                       (("embed_out.weight", "lm_head.weight"),)),
    **{name: Family("model.") for name in ("llama", "mistral", "qwen2", "qwen3", "deepseek_v2", "deepseek_v3")},
}


def bias_flags(family: str, c: ModelConfig) -> dict[str, bool]:
    """Which biases the transformers model has: `qkv`, `out`, `mlp`, `norm` (zeros fill what c lacks)."""
    attention = c.qkv_bias or c.out_bias  # one `attention_bias` switch covers both groups
    return {"gpt2": dict(qkv=True, out=True, mlp=True, norm=True),
            "gpt_neox": dict(qkv=attention, out=attention, mlp=True, norm=True),
            "llama": dict(qkv=attention, out=attention, mlp=c.mlp_bias, norm=False),
            "mistral": dict(qkv=False, out=False, mlp=False, norm=False),
            "qwen2": dict(qkv=True, out=False, mlp=False, norm=False),
            "qwen3": dict(qkv=attention, out=attention, mlp=False, norm=False),
            "deepseek_v2": dict(qkv=attention, out=attention, mlp=c.mlp_bias, norm=False),
            "deepseek_v3": dict(qkv=attention, out=attention, mlp=False, norm=False)}[family]


def _rope_columns(c: ModelConfig, heads: int):
    """Interleaved RoPE exports to half-split architectures by renaming head dims (None: nothing to rename)."""
    if c.positions != "rope" or not c.rope_interleaved:
        return None
    return w.half_split_columns(heads, c.head_dim)


def gpt2_block(c: ModelConfig, i: int, b: dict[str, bool]) -> list[Entry]:
    D, F, p, h = c.d_model, c.mlp_hidden, (f"blocks_{i}",), f"transformer.h.{i}"
    return (w.norm(p + ("attn_norm",), f"{h}.ln_1", D, bias=True)
            + w.linear(p + ("attn", "qkv"), f"{h}.attn.c_attn", D, 3 * D, bias=True, conv1d=True)
            + w.linear(p + ("attn", "out"), f"{h}.attn.c_proj", D, D, bias=True, conv1d=True)
            + w.norm(p + ("mlp_norm",), f"{h}.ln_2", D, bias=True)
            + w.linear(p + ("mlp", "c_fc"), f"{h}.mlp.c_fc", D, F, bias=True, conv1d=True)
            + w.linear(p + ("mlp", "c_proj"), f"{h}.mlp.c_proj", F, D, bias=True, conv1d=True))


def neox_block(c: ModelConfig, i: int, b: dict[str, bool]) -> list[Entry]:
    D, F, N, H, p, h = c.d_model, c.mlp_hidden, c.num_heads, c.head_dim, (f"blocks_{i}",), f"gpt_neox.layers.{i}"
    columns = _rope_columns(c, 2 * N)  # q and k columns of the fused [3, N, H] kernel
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


def llama_block(c: ModelConfig, i: int, b: dict[str, bool]) -> list[Entry]:
    D, N, K, H, p, h = c.d_model, c.num_heads, c.num_kv_heads, c.head_dim, (f"blocks_{i}", "attn"), \
        f"model.layers.{i}"
    q_cols, k_cols, one_head = _rope_columns(c, N), _rope_columns(c, K), _rope_columns(c, 1)
    entries = (w.norm((f"blocks_{i}", "attn_norm"), f"{h}.input_layernorm", D)
               + w.linear(p + ("query",), f"{h}.self_attn.q_proj", D, N * H, bias=b["qkv"], columns=q_cols)
               + w.linear(p + ("key",), f"{h}.self_attn.k_proj", D, K * H, bias=b["qkv"], columns=k_cols)
               + w.linear(p + ("value",), f"{h}.self_attn.v_proj", D, K * H, bias=b["qkv"])
               + w.linear(p + ("out",), f"{h}.self_attn.o_proj", N * H, D, bias=b["out"]))
    if c.qk_norm:
        entries += (w.norm(p + ("q_norm",), f"{h}.self_attn.q_norm", H, columns=one_head)
                    + w.norm(p + ("k_norm",), f"{h}.self_attn.k_norm", H, columns=one_head))
    return (entries + w.norm((f"blocks_{i}", "mlp_norm"), f"{h}.post_attention_layernorm", D)
            + w.gated_mlp((f"blocks_{i}", "mlp"), f"{h}.mlp", c, bias=b["mlp"]))


def deepseek_block(c: ModelConfig, i: int, b: dict[str, bool]) -> list[Entry]:
    m, D, N, p, h = c.mla, c.d_model, c.num_heads, (f"blocks_{i}", "attn"), f"model.layers.{i}.self_attn"
    width = N * (m.qk_nope_head_dim + m.qk_rope_head_dim)
    R, E, PV = m.kv_lora_rank, m.qk_rope_head_dim, m.qk_nope_head_dim + m.v_head_dim
    if m.q_lora_rank is None:
        query = w.linear(p + ("wq",), f"{h}.q_proj", D, width, bias=False)
    else:
        query = (w.linear(p + ("wq_a",), f"{h}.q_a_proj", D, m.q_lora_rank, bias=b["qkv"])
                 + w.norm(p + ("q_norm",), f"{h}.q_a_layernorm", m.q_lora_rank)
                 + w.linear(p + ("wq_b",), f"{h}.q_b_proj", m.q_lora_rank, width, bias=False))
    kv = (w.linear(p + ("wkv_a",), f"{h}.kv_a_proj_with_mqa", D, R + E, bias=b["qkv"])
          + w.norm(p + ("kv_norm",), f"{h}.kv_a_layernorm", R)
          + [Entry(p + ("wkv_b",), (f"{h}.kv_b_proj.weight",), ((N * PV, R),), w.kv_b(R, N, PV))])
    layer = f"model.layers.{i}"
    return (w.norm((f"blocks_{i}", "attn_norm"), f"{layer}.input_layernorm", D) + query + kv
            + w.linear(p + ("wo",), f"{h}.o_proj", N * m.v_head_dim, D, bias=b["out"])
            + w.norm((f"blocks_{i}", "mlp_norm"), f"{layer}.post_attention_layernorm", D)
            + w.gated_mlp((f"blocks_{i}", "mlp"), f"{layer}.mlp", c, bias=b["mlp"]))


def layout(family: str, c: ModelConfig) -> list[Entry]:
    """Every tensor of a `family` checkpoint of config `c`, in model order."""
    b = bias_flags(family, c)
    if family == "gpt2":
        first, last = w.embeddings(c, "transformer.wte.weight")
        first += [Entry(("wpe", "embedding"), ("transformer.wpe.weight",), ((c.max_seq_len, c.d_model),))]
        block, final = gpt2_block, w.norm(("final_norm",), "transformer.ln_f", c.d_model, bias=True)
    elif family == "gpt_neox":
        first, last = w.embeddings(c, "gpt_neox.embed_in.weight")
        block, final = neox_block, w.norm(("final_norm",), "gpt_neox.final_layer_norm", c.d_model, bias=True)
    else:
        first, last = w.embeddings(c, "model.embed_tokens.weight")
        block = deepseek_block if family.startswith("deepseek") else llama_block
        final = w.norm(("final_norm",), "model.norm", c.d_model)
    blocks = [entry for i in range(c.num_layers) for entry in block(c, i, b)]
    return first + blocks + final + last


def is_ignored(family: str, name: str, c: ModelConfig, num_extra_layers: int = 0) -> bool:
    """A stored tensor that is not a parameter of the model: a buffer, the tied head's copy, MTP layers."""
    if any(re.search(pattern, name) for pattern in FAMILIES[family].ignore):
        return True
    if c.tie_embeddings and name == "lm_head.weight":  # transformers ties it to the embedding anyway
        return True
    extra = re.match(r"model\.layers\.(\d+)\.", name)  # DeepSeek-V3's multi-token-prediction layers
    return bool(extra) and c.num_layers <= int(extra.group(1)) < c.num_layers + num_extra_layers
