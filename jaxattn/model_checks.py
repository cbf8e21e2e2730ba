"""The checks of `jaxattn.model.DecoderLM`'s inputs: each a ValueError or TypeError naming the argument.

Values (token ids, cache lengths, `num_new`) are checked when they are known, i.e. outside `jit`;
under `jit` they cannot be checked for free, and `check=True` adds `checkify` checks that run on the
device (inside `jax.experimental.checkify.checkify`, as `jaxattn.decoding.checked_extend` does).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import checkify

from jaxattn._validate import concrete_or_none
from jaxattn.cache.containers import DecodeCache, PagedBatch
from jaxattn.config import ModelConfig
from jaxattn.layers.kinds import attention_class
from jaxattn.scan_plan import plan_layers


def check_tokens(tokens) -> None:
    """`tokens` is an integer array `[B, T]`."""
    if not hasattr(tokens, "ndim") or tokens.ndim != 2:
        raise ValueError(f"tokens must be [B, T], got shape {getattr(tokens, 'shape', type(tokens))}")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise TypeError(f"tokens must be integer ids, got dtype {tokens.dtype}")


def check_token_range(tokens, vocab_size: int, check: bool) -> None:
    """Token ids in `[0, vocab_size)`: now when known, on the device with `check`."""
    V = vocab_size
    values = concrete_or_none(tokens)
    if values is not None and values.size and (values.min() < 0 or values.max() >= V):
        raise ValueError(f"token ids must be in [0, vocab_size={V}), got range [{values.min()}, {values.max()}]")
    if check:
        checkify.check(jnp.all((tokens >= 0) & (tokens < V)),
                       f"token ids must be in [0, vocab_size={V}), got range [{{}}, {{}}]", tokens.min(), tokens.max())


def check_capacity(T: int, cache: DecodeCache, num_new, check: bool) -> None:
    """Every row's cache takes T more tokens, and `0 <= num_new[b] <= T`: now when known, on the device
    with `check`."""
    lengths, new = concrete_or_none(cache.lengths), concrete_or_none(num_new)
    if lengths is not None and (lengths + T > cache.max_len).any():
        raise ValueError(f"the cache holds max_len={cache.max_len} tokens per row; rows of lengths "
                         f"{lengths.tolist()} cannot take {T} more")
    if new is not None and ((new < 0) | (new > T)).any():
        raise ValueError(f"num_new must be in [0, T={T}], got {new.tolist()}")
    if check:
        checkify.check(jnp.all(cache.lengths + T <= cache.max_len),
                       f"the cache holds max_len={cache.max_len} tokens per row; a row of length {{}} "
                       f"cannot take {T} more", cache.lengths.max())
        checkify.check(jnp.all((num_new >= 0) & (num_new <= T)), f"num_new must be in [0, T={T}], got {{}}",
                       num_new)


def check_length(T: int, table: int | None, config: ModelConfig) -> None:
    """T positions fit the absolute position table of `table` rows (None: no table, any length)."""
    if table is not None and T > table:
        raise ValueError(f"sequence length {T} exceeds max_seq_len={table} "
                         f"of the {config.positions} position table")


def check_cache(tokens, cache, config: ModelConfig) -> None:
    """`cache` is a `DecodeCache` of `config`'s layers (as its attention declares them) and of the batch
    of `tokens [B, T]`, with room for T tokens."""
    if not isinstance(cache, DecodeCache):
        raise TypeError(f"cache must be a DecodeCache (see init_cache), got {type(cache).__name__}")
    c = config
    expected, units = attention_class(c).cache_type, len(plan_layers(c).units)
    if len(cache.layers) != units or not all(isinstance(l, expected) for l in cache.layers):
        raise ValueError(f"cache must hold {units} {expected.__name__} layers for "
                         f"attention={c.attention!r}{' with scan_layers' if c.scan_layers else ''}, got "
                         f"{[type(l).__name__ for l in cache.layers]}")
    if cache.lengths.shape != (tokens.shape[0],):
        raise ValueError(f"cache.lengths {cache.lengths.shape} does not match the batch of "
                         f"tokens {tokens.shape}")
    if tokens.shape[1] > cache.max_len:
        raise ValueError(f"{tokens.shape[1]} tokens do not fit a cache of max_len={cache.max_len}")


def check_paged(tokens, pools: tuple, batch: PagedBatch, config: ModelConfig) -> None:
    """A paged step's flat `tokens [Tf]` (the shape of `batch.positions`) and one pool per layer, of a
    model whose layers run unrolled (checked first)."""
    if plan_layers(config).repeats:
        raise ValueError("a paged step runs its layers unrolled: give the engine a config without scan_layers "
                         "and jaxattn.scan_plan.unstack_params(params, config)")
    if not hasattr(tokens, "ndim") or tokens.ndim != 1 or tokens.shape != batch.positions.shape:
        raise ValueError(f"tokens must be [Tf] = {batch.positions.shape}, got {getattr(tokens, 'shape', None)}")
    if len(pools) != config.num_layers:
        raise ValueError(f"pools must hold {config.num_layers} layers, got {len(pools)}")
