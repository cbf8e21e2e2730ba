"""llama.cpp's `llama`: Llama 1/2/3, SmolLM, and the Mistral 7B files, as `LlamaForCausalLM`.

llama.cpp writes Mistral 7B as `llama` too; like transformers, a file whose `general.name` is
exactly "mistral" is read as `MistralForCausalLM` (with that class's default window), any other
as Llama. llama.cpp's converter permutes the rows of attn_q and attn_k (`permute_qk`). Llama
3.1's RoPE scaling, which llama.cpp writes as the tensor `rope_freqs.weight`, is read back into
config.json's `rope_scaling` (`jaxattn.gguf.hf_config.llama3_scaling`); transformers' loader drops it.
`rope.dimension_count` is the head size, as transformers reads it for this architecture.
"""

from __future__ import annotations

from typing import Any, Mapping

from jaxattn.gguf.architecture import GLOBALS, LLAMA3_ROPE, LLAMA_BLOCK, LLAMA_KEYS, Architecture


def model_type(metadata: Mapping[str, Any]) -> str:
    return "mistral" if metadata.get("general.name") == "mistral" else "llama"


ARCHITECTURE = Architecture("llama", model_type, config={**LLAMA_KEYS, "rope.dimension_count": "head_dim"},
                            globals_=GLOBALS, block=LLAMA_BLOCK, permute_qk=True, config_tensors=(LLAMA3_ROPE,))
