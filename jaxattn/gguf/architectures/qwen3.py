"""llama.cpp's `qwen3`: Qwen3 (dense), as `Qwen3ForCausalLM`, with its per-head q/k RMSNorm.

`attention.key_length` is read as `head_dim` (`extra_config`): Qwen3's heads need not be
hidden_size / heads wide, and transformers' loader leaves `head_dim` to the class default (128,
which the released models have).
"""

from __future__ import annotations

from jaxattn.gguf.architecture import GLOBALS, LLAMA_BLOCK, LLAMA_KEYS, QK_NORMS, ROPE_FREQS, Architecture

ARCHITECTURE = Architecture("qwen3", "qwen3", config=LLAMA_KEYS, extra_config={"attention.key_length": "head_dim"},
                            globals_=GLOBALS, block={**LLAMA_BLOCK, **QK_NORMS}, refused=ROPE_FREQS)
