"""One llama.cpp architecture, read as one transformers family: the record and the tables families share.

A GGUF file names its architecture in `general.architecture` ("llama", "qwen2", ...), keeps
what a transformers config.json says under `{architecture}.*` metadata keys, and names its
tensors llama.cpp's way (`token_embd.weight`, `blk.3.attn_q.weight`). An `Architecture` record
says, as data, how each of these becomes what `jaxattn.hf` reads: the config.json dict
(`config`, `model_type`), the transformers name of every tensor (`globals_`, `block`), and the
two value changes llama.cpp's converter makes to some families' tensors (`permute_qk`,
`norm_offset`). The tables follow transformers 5.23's own GGUF loader
(`GGUF_CONFIG_MAPPING` in `transformers.integrations.ggml`, the tensor processors of
`transformers.modeling_gguf_pytorch_utils`); where the file states something that loader leaves
to the class default, the record's `extra_config` reads it (each record says which).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

# The metadata keys (after "{architecture}.") transformers copies for every Llama-like family.
LLAMA_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "rope.freq_base": "rope_theta",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size",
}
# The tokenizer's ids, which transformers copies into config.json too.
TOKEN_ID_KEYS = {
    "tokenizer.ggml.bos_token_id": "bos_token_id",
    "tokenizer.ggml.eos_token_id": "eos_token_id",
    "tokenizer.ggml.unknown_token_id": "unk_token_id",
    "tokenizer.ggml.padding_token_id": "pad_token_id",
}

# Tensors outside the blocks: llama.cpp's name (without ".weight"/".bias") -> transformers'.
GLOBALS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# One block's tensors, "blk.{i}.NAME" -> "model.layers.{i}.NAME".
LLAMA_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# Gemma's sandwich norms: llama.cpp's ffn_norm is the norm *before* the MLP there.
GEMMA_BLOCK = {
    **LLAMA_BLOCK,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}

# Tensors llama.cpp writes that transformers' loader drops, changing the model: refused, with why.
ROPE_FREQS = {"rope_freqs": "per-frequency RoPE factors, which this architecture does not read"}
# Llama 3.1's 'llama3' RoPE scaling, which llama.cpp writes as its per-frequency factors.
LLAMA3_ROPE = "rope_freqs.weight"
LONGROPE = {name: "Phi-3's long-context RoPE factors (longrope), which jaxattn does not compute"
            for name in ("rope_factors_long", "rope_factors_short")}


@dataclasses.dataclass(frozen=True)
class Architecture:
    """How the GGUF files of one llama.cpp architecture become a transformers config.json and state dict.

    Attributes:
      name: llama.cpp's `general.architecture`, e.g. "llama".
      model_type: the config.json `model_type` the file is read as (a `jaxattn.hf` family), or a
        function of the metadata choosing it (llama's files hold Mistral 7B too).
      config: `{metadata key after "{name}.": config.json key}`, copied where the file has the key
        (transformers' `GGUF_CONFIG_MAPPING`); config.json's other keys keep the class defaults.
      extra_config: more such keys, for what the file states and transformers' loader leaves to the
        class default (read here so that a file unlike that default still loads as written); a
        value that is a list there is left to the default too.
      globals_: the tensors outside the blocks, llama.cpp's name -> transformers' (no suffix).
      block: one block's tensors, "blk.{i}.NAME" -> "model.layers.{i}.NAME" (no suffix).
      permute_qk: llama.cpp's converter reordered the rows of attn_q and attn_k within each head
        (it rotates adjacent pairs, transformers the two halves): undone on reading, exactly as
        transformers' `LlamaTensorProcessor` undoes it.
      norm_offset: the norms are stored as 1 + w (Gemma's RMSNorm scales by 1 + w): every
        "*norm.weight" tensor has 1 subtracted, as transformers' `Gemma2TensorProcessor` does.
      refused: tensors that may be in such a file and change the model beyond what is read:
        `{llama.cpp name: why}`; a file holding one is refused naming it.
      config_tensors: tensors read into config.json rather than the state dict (llama's
        `rope_freqs.weight`: Llama 3.1's RoPE scaling, `jaxattn.gguf.hf_config.llama3_scaling`).
      sentencepiece: the tokenizer transformers builds from this architecture's SentencePiece
        ("llama") vocabulary: "llama", "gemma" or "phi3" (`jaxattn.gguf.tokenizer`).
    """

    name: str
    model_type: str | Callable[[Mapping[str, Any]], str]
    config: Mapping[str, str]
    globals_: Mapping[str, str]
    block: Mapping[str, str]
    extra_config: Mapping[str, str] = dataclasses.field(default_factory=dict)
    permute_qk: bool = False
    norm_offset: bool = False
    refused: Mapping[str, str] = dataclasses.field(default_factory=dict)
    config_tensors: tuple[str, ...] = ()
    sentencepiece: str = "llama"

    def model_type_of(self, metadata: Mapping[str, Any]) -> str:
        """config.json's `model_type` for a file with this metadata."""
        return self.model_type(metadata) if callable(self.model_type) else self.model_type

    def hf_name(self, name: str) -> str | None:
        """The transformers name of llama.cpp tensor `name` ("blk.0.attn_q.weight" ->
        "model.layers.0.self_attn.q_proj.weight"), or None when this architecture has no such tensor."""
        stem, dot, suffix = name.rpartition(".")
        if not dot or suffix not in ("weight", "bias"):
            return None
        if stem in self.globals_:
            return f"{self.globals_[stem]}.{suffix}"
        parts = stem.split(".")
        if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in self.block:
            return f"model.layers.{int(parts[1])}.{self.block[parts[2]]}.{suffix}"
        return None

    def refusal(self, name: str) -> str | None:
        """Why tensor `name` is refused (see `refused`), or None."""
        stem = name.rpartition(".")[0]
        return self.refused.get(stem)
