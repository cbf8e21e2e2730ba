"""llama.cpp's `qwen2`: Qwen2 and Qwen2.5, as `Qwen2ForCausalLM` (q/k/v biases as `attn_*.bias`).

Its rows are stored as transformers stores them (no permutation). llama.cpp writes no sliding
window for these files, and transformers' loader reads none: every layer attends to the whole
context, as Qwen2's config.json defaults (`use_sliding_window` false) say.
"""

from __future__ import annotations

from jaxattn.gguf.architecture import GLOBALS, LLAMA_BLOCK, LLAMA_KEYS, ROPE_FREQS, Architecture

ARCHITECTURE = Architecture("qwen2", "qwen2", config=LLAMA_KEYS, globals_=GLOBALS, block=LLAMA_BLOCK,
                            refused=ROPE_FREQS)
