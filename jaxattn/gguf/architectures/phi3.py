"""llama.cpp's `phi3`: Phi-3 (4k context), as `Phi3ForCausalLM`.

llama.cpp keeps Phi-3's fused tensors: `attn_qkv` is `qkv_proj`, and `ffn_up` holds the gate and
up projections together (`gate_up_proj`). The long-context files (`rope_factors_long` and
`rope_factors_short`: longrope) are refused; transformers' loader drops those tensors. The
SentencePiece vocabulary gets transformers' Phi-3 tokenizer (`sentencepiece="phi3"`).
"""

from __future__ import annotations

from jaxattn.gguf.architecture import GLOBALS, LLAMA_KEYS, LONGROPE, Architecture

BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_up": "mlp.gate_up_proj",
    "ffn_down": "mlp.down_proj",
}

ARCHITECTURE = Architecture("phi3", "phi3", config=LLAMA_KEYS, globals_=GLOBALS, block=BLOCK, refused=LONGROPE,
                            sentencepiece="phi3")
