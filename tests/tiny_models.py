"""Tiny DecoderLM configs and params shared by the model tests (and adapters made visible: `with_random_b`)."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.traverse_util import flatten_dict, unflatten_dict

from jaxattn.config import MLAConfig, ModelConfig
from jaxattn.kernels import Kernels
from jaxattn.lora import combine_lora, split_lora
from jaxattn.model import abstract_params

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
    """`drawn_params` at the scale of the model's own initialisation (std 0.02)."""
    return drawn_params(config, seed=1, std=0.02)


def params_for(config):
    """Every position scheme runs the learned scheme's params minus `wpe`: the same weights
    under each scheme."""
    params = dict(learned_params(config.replace(positions="learned")))
    if config.positions != "learned":
        del params["wpe"]
    return params


def drawn_params(config, seed=0, std=0.1):
    """Params of `DecoderLM(config)` drawn with numpy from their shapes, so nothing is compiled (`init`
    compiles a program per config, or a kernel per parameter shape when run eagerly): norm scales
    1 + N(0, std) (N(0, std) under `norm_unit_offset`, whose norms scale by 1 + w), every other leaf,
    biases included, N(0, std), so that no term hides at 0 or 1."""
    rng, center = np.random.default_rng(seed), 0.0 if config.norm_unit_offset else 1.0
    shapes = flatten_dict(nn.unbox(abstract_params(config)))
    return unflatten_dict({path: jnp.asarray((center * (path[-1] == "scale") + std * rng.standard_normal(leaf.shape))
                                             .astype(leaf.dtype)) for path, leaf in shapes.items()})


def with_random_b(params, seed=0, std=0.2):
    """Every adapter's b redrawn N(0, std): the delta is then visible in the logits."""
    adapters, frozen = split_lora(params)
    rng = np.random.default_rng(seed)
    adapters = jax.tree_util.tree_map_with_path(
        lambda path, x: jnp.asarray(rng.normal(size=x.shape) * std, x.dtype) if path[-1].key == "b" else x, adapters)
    return combine_lora(frozen, adapters)
