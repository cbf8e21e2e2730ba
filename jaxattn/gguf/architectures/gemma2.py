"""llama.cpp's `gemma2`: Gemma 2, as `Gemma2ForCausalLM`.

Norms are stored as 1 + w (`norm_offset`); `attention.key_length` is the head size and
`attention.sliding_window` the local layers' window, as transformers reads them. The two
soft-caps are read where the file states them (`extra_config`; transformers' loader keeps the
class defaults, 50 and 30, which the released models have). `query_pre_attn_scalar` is not in
the file: the class default (256) applies, as in transformers.
"""

from __future__ import annotations

from jaxattn.gguf.architecture import GEMMA_BLOCK, GLOBALS, LLAMA_KEYS, Architecture

KEYS = {**LLAMA_KEYS, "attention.key_length": "head_dim", "attention.sliding_window": "sliding_window"}

ARCHITECTURE = Architecture("gemma2", "gemma2", config=KEYS, globals_=GLOBALS, block=GEMMA_BLOCK,
                            extra_config={"attn_logit_softcapping": "attn_logit_softcapping",
                                          "final_logit_softcapping": "final_logit_softcapping"},
                            norm_offset=True, sentencepiece="gemma")
