"""Tiny DecoderLM configs and params shared by the model and cache tests."""

import functools

import jax
import jax.numpy as jnp

from jaxattn.config import ModelConfig
from jaxattn.model import DecoderLM

VOCAB, T, MAX_LEN = 13, 8, 12
KINDS = {
    "mha": dict(),
    "gqa": dict(num_kv_heads=2),
    "mqa": dict(num_kv_heads=1),
    "mla_naive": dict(attention="mla", mla_path="naive"),
    "mla_absorb": dict(attention="mla", mla_path="absorb", q_lora_rank=8),
}
POSITIONS = ("learned", "sinusoidal", "rope", "none")


def tiny_config(kind="mha", positions="learned", **changes):
    base = dict(vocab_size=VOCAB, d_model=16, num_layers=2, num_heads=4, max_seq_len=MAX_LEN,
                positions=positions, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4,
                v_head_dim=4, mlp_hidden=32)
    return ModelConfig(**{**base, **KINDS[kind], **changes})


@functools.lru_cache(maxsize=None)
def learned_params(config):
    return DecoderLM(config).init(jax.random.PRNGKey(1), jnp.zeros((1, 2), jnp.int32))["params"]


def params_for(config):
    """Initialisation is the slow part of these tests (one kernel compile per parameter
    shape), so every position scheme reuses the learned scheme's params minus `wpe`."""
    params = dict(learned_params(config.replace(positions="learned")))
    if config.positions != "learned":
        del params["wpe"]
    return params
