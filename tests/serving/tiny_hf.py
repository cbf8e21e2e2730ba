"""A tiny random model saved as a transformers directory with a tokenizer, for the tests that serve it
and load it elsewhere too (lm-evaluation-harness's `hf` backend).

The tokenizer has one token per character of printable ASCII and the newline, and an end-of-sequence
token `</s>`; it adds nothing to a text (no BOS), and decodes by joining its tokens, so a text is its
characters one by one, and every program that reads tokenizer.json encodes it the same way.
"""

from __future__ import annotations

from pathlib import Path

import tokenizers
from tokenizers import Regex, decoders, models, pre_tokenizers

from jaxattn import hf
from jaxattn.config import ModelConfig
from tiny_models import drawn_params

CHARS = "\n" + "".join(chr(c) for c in range(32, 127))
EOS = "</s>"


def char_tokenizer() -> tokenizers.Tokenizer:
    vocab = {c: i for i, c in enumerate(CHARS)} | {EOS: len(CHARS)}
    tokenizer = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token=EOS))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # each character
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens([EOS])
    return tokenizer


def write_tiny_hf(directory: Path) -> tuple[ModelConfig, dict, tokenizers.Tokenizer]:
    """Saves a Llama-shaped random model (GQA, RoPE, RMSNorm, SwiGLU) and its tokenizer in `directory`:
    `(config, params, tokenizer)`."""
    tokenizer = char_tokenizer()
    config = ModelConfig(vocab_size=tokenizer.get_vocab_size(), d_model=32, num_layers=2, num_heads=4,
                         num_kv_heads=2, positions="rope", max_seq_len=256, norm="rmsnorm", mlp="swiglu",
                         mlp_hidden=64)
    params = drawn_params(config, seed=0, std=0.3)
    hf.save_pretrained(directory, config, params, tokenizer, eos_token_id=tokenizer.token_to_id(EOS))
    return config, params, tokenizer
