"""Tiny DecoderLM configs and params shared by the model and cache tests."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxattn.config import MLAConfig, ModelConfig
from jaxattn.kernels import Kernels
from jaxattn.model import DecoderLM

VOCAB, T, MAX_LEN = 13, 8, 12
TINY_MLA = MLAConfig(kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4)
KINDS = {
    "mha": dict(),
    "gqa": dict(num_kv_heads=2),
    "mqa": dict(num_kv_heads=1),
    "mla_naive": dict(mla=TINY_MLA),
    "mla_absorb": dict(mla=TINY_MLA.replace(q_lora_rank=8)),
}
POSITIONS = ("learned", "sinusoidal", "rope", "none")
# The kernels that make each kind run the path its name says; every other kind runs the reference.
KIND_KERNELS = {"mla_absorb": Kernels(mla="absorb")}
# Every non-reference implementation at once: what a CPU training run resolves to (bfloat16
# matmuls as on a CPU with AMX-BF16).
FAST_KERNELS = Kernels(attention="custom_vjp", decode="xla_cpu", matmul="bfloat16_cpu")


def tiny_config(kind="mha", positions="learned", **changes):
    base = dict(vocab_size=VOCAB, d_model=16, num_layers=2, num_heads=4, max_seq_len=MAX_LEN,
                positions=positions, mlp_hidden=32)
    return ModelConfig(**{**base, **KINDS[kind], **changes})


def tiny_kernels(kind="mha"):
    return KIND_KERNELS.get(kind, Kernels())


@functools.lru_cache(maxsize=None)
def learned_params(config):
    return nn.unbox(DecoderLM(config).init(jax.random.PRNGKey(1), jnp.zeros((1, 2), jnp.int32))["params"])


def params_for(config):
    """Initialisation is the slow part of these tests (one kernel compile per parameter
    shape), so every position scheme reuses the learned scheme's params minus `wpe`."""
    params = dict(learned_params(config.replace(positions="learned")))
    if config.positions != "learned":
        del params["wpe"]
    return params
