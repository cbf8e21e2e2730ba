"""The model's caches, built from what each attention layer declares it keeps per token.

A layer kind declares its cache once (`cache_fields`, `cache_type`; `jaxattn.cache.containers`), and the
model's layer kind is `jaxattn.layers.kinds.attention_class(config)`. From that declaration:

* `init_cache`: the dense `DecodeCache`, `B` rows of `L` slots per layer (`generate`), in the
  model's layer order (`jaxattn.scan_plan`: a scanned period's layers stacked);
* `init_pools`: the paged cache, per layer a pool of `P` pages of `page_size` slots, shared by
  every sequence through block tables (`jaxattn.serving`);
* `cache_bytes_per_token`: what one token costs in either.

Each takes the cache dtype (`jaxattn.cache.containers.cache_dtype`): the compute dtype by default, or "int8",
each field as int8 values with a float32 scale per vector (`jaxattn.cache.int8`).

Nothing here asks which kind of attention a layer has.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from jaxattn._validate import is_int
from jaxattn.cache.containers import CacheField, DecodeCache, cache_dtype, zeros
from jaxattn.config import ModelConfig
from jaxattn.layers.kinds import attention_class
from jaxattn.scan_plan import plan_layers


def cache_fields(config: ModelConfig) -> dict[str, CacheField]:
    """What each layer of `config` keeps per token (every layer has the same kind)."""
    return attention_class(config).cache_fields(config)


def _positive(**values) -> None:
    for name, value in values.items():
        if not is_int(value, numpy=False) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def empty_layer(config: ModelConfig, shape_of, dtype):
    """One layer's empty cache container: each field of `cache_fields(config)` as zeros of
    `shape_of(field)` in `dtype` (a resolved `cache_dtype`; int8: a `QuantizedTokens`)."""
    container = attention_class(config).cache_type
    return container(**{name: zeros(shape_of(field), dtype) for name, field in cache_fields(config).items()})


def init_cache(config: ModelConfig, batch_size: int, max_len: int, dtype=None) -> DecodeCache:
    """An empty dense cache (all lengths 0) for `batch_size` rows of `max_len` slots.

    dtype: the cache dtype (`jaxattn.cache.containers.cache_dtype`): None or "auto" (the config's compute
    dtype), a float dtype, or "int8" (int8 values, a float32 scale per vector). ValueError otherwise.
    """
    _positive(batch_size=batch_size, max_len=max_len)
    dtype = cache_dtype(dtype, config.dtype)
    # One container per unrolled layer; one per position of a scanned period, its R repeats stacked
    # in front (`jaxattn.scan_plan`): the scan reads and writes each repeat's slice.
    layers = tuple(empty_layer(config, lambda field, lead=lead: lead + field.dense_shape(batch_size, max_len), dtype)
                   for lead in _unit_leads(config))
    return DecodeCache(layers=layers, lengths=jnp.zeros((batch_size,), jnp.int32), num_slots=max_len)


def _unit_leads(config: ModelConfig) -> list[tuple[int, ...]]:
    """Per cache unit of `config` (`LayerPlan.units`), the leading dims: () unrolled, (R,) scanned."""
    plan = plan_layers(config)
    return [() if kind == "layer" else (plan.repeats,) for kind, _ in plan.units]


def init_pools(config: ModelConfig, num_pages: int, page_size: int, dtype=None) -> tuple:
    """The paged cache: per layer a pool of `num_pages` pages of `page_size` slots (`[P, ps, ...]`
    per field), zeros. dtype as `init_cache`'s."""
    _positive(num_pages=num_pages, page_size=page_size)
    dtype = cache_dtype(dtype, config.dtype)
    return tuple(empty_layer(config, lambda field: field.paged_shape(num_pages, page_size), dtype)
                 for _ in range(config.num_layers))


def cache_bytes_per_token(config: ModelConfig, dtype=None) -> dict:
    """What one token costs in the cache.

    Returns a dict with `numbers_per_layer` (2*K*H for standard attention,
    kv_lora_rank + qk_rope_head_dim for MLA), `bytes_per_layer`, `num_layers`,
    `numbers` and `bytes` (all layers), for the cache dtype (`init_cache`'s; default: the
    config's compute dtype). For "int8" the bytes count one byte per number and the float32
    scales (one per vector: 2*K*H*1 + 2*K*4 bytes against float32's 2*K*H*4 for standard attention).
    The per-row `lengths` counter is not per token.
    """
    dtype = cache_dtype(dtype, config.dtype)
    fields = cache_fields(config).values()
    numbers = sum(math.prod(field.shape) for field in fields)
    per_layer = numbers * dtype.itemsize
    if dtype == jnp.int8:
        per_layer += sum(math.prod(field.scale_field().shape) for field in fields) * jnp.dtype(jnp.float32).itemsize
    return {
        "numbers_per_layer": numbers,
        "bytes_per_layer": per_layer,
        "num_layers": config.num_layers,
        "numbers": numbers * config.num_layers,
        "bytes": per_layer * config.num_layers,
    }
