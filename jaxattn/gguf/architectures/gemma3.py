"""llama.cpp's `gemma3`: Gemma 3's text model, as `Gemma3ForCausalLM` (model_type gemma3_text).

As `gemma2`, plus per-head q/k norms (stored as 1 + w like the others). An integer
`attention.sliding_window_pattern` (every N-th layer global) is read as config.json's
`sliding_window_pattern` (`extra_config`; transformers' loader keeps the default, 6). The local
layers' RoPE base is not in the file: the class default (10000) applies, as in transformers.
"""

from __future__ import annotations

from jaxattn.gguf.architecture import GEMMA_BLOCK, GLOBALS, QK_NORMS, Architecture
from jaxattn.gguf.architectures.gemma2 import KEYS

ARCHITECTURE = Architecture("gemma3", "gemma3_text", config=KEYS, globals_=GLOBALS, block={**GEMMA_BLOCK, **QK_NORMS},
                            extra_config={"attention.sliding_window_pattern": "sliding_window_pattern"},
                            norm_offset=True, sentencepiece="gemma")
