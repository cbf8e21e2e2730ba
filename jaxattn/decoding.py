"""Autoregressive generation: one prefill, then a `jax.lax.scan` of one-token steps.

`generate` compiles once per (batch size, prompt bucket, max_new_tokens, config):
prompt lengths are padded up to a bucket (powers of two up to 64, then
multiples of 64) and the sampling knobs, the stop token and the rng are traced
values, so a new prompt, temperature, top-k, top-p or seed reuses the compiled
program. Each scan step is one `DecoderLM.extend` call with T = 1 against the
KV cache (see `jaxattn.cache.containers`), then one `jaxattn.sampling.sample`.

`generate_without_cache` is the same loop that reruns the full forward pass
over a fixed-size token buffer every step: the oracle for tests and the
baseline of `bench/decode.py`. `jaxattn.windowed.generate_windowed` goes past the
model's context by running `generate` in windows (the one way this library does it).

Rows stop independently: once a row emits `stop_token` it is `done`, its cache
stops advancing (`num_new = 0`) and its later output tokens are `pad_token`.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxattn import sampling, sharding
from jaxattn._validate import concrete_or_none, is_int
from jaxattn.axes import MeshShape
from jaxattn.cache.containers import KV_CACHES, DecodeCache
from jaxattn.cache.build import init_cache
from jaxattn.config import ModelConfig
from jaxattn.kernels import Kernels, call_kernels
from jaxattn.model import DecoderLM


class GenerateOutput(NamedTuple):
    """What `generate` returns.

    Attributes:
      tokens: `[B, max_new_tokens]` int32 generated ids; after a row's stop
        token (included) the rest of the row is `pad_token`.
      counts: `[B]` int32 number of real generated tokens per row (stop token
        included).
      logits: `[B, max_new_tokens, V]` float32 logits each token was drawn
        from (only with `return_logits=True`, else None).
      nonfinite_from: `[B]` int32 index of the row's first token drawn from
        logits with no finite maximum (a NaN, +inf, or every logit -inf: the
        draw, and every token after it, is arbitrary); -1 for a row whose
        draws were all from finite logits.
    """

    tokens: jax.Array
    counts: jax.Array
    logits: jax.Array | None = None
    nonfinite_from: jax.Array | None = None


@flax.struct.dataclass
class SamplingKnobs:
    """Sampling settings as traced scalars (changing them never recompiles).

    Attributes:
      temperature: `[]` float32; 0 = greedy.
      top_k: `[]` int32; <= 0 disables top-k.
      top_p: `[]` float32; >= 1 disables top-p.
      stop_token: `[]` int32; -1 = no stop token.
      pad_token: `[]` int32 written after a row is done.
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    stop_token: jax.Array
    pad_token: jax.Array


@flax.struct.dataclass
class DecodeState:
    """The carry of the decoding scan.

    Attributes:
      context: what the model needs to produce the next logits: a
        `DecodeCache` for cached decoding, a `TokenBuffer` for recomputation.
      last_token: `[B]` int32 token fed to the next step.
      done: `[B]` bool, True once the row has emitted the stop token.
      counts: `[B]` int32 real tokens generated so far per row.
      rng: PRNG key for the next draw.
      nonfinite_from: `[B]` int32 index of the first token drawn from logits
        with no finite maximum, -1 while there is none.
    """

    context: DecodeCache | "TokenBuffer"
    last_token: jax.Array
    done: jax.Array
    counts: jax.Array
    rng: jax.Array
    nonfinite_from: jax.Array


@flax.struct.dataclass
class TokenBuffer:
    """Prompt plus generated tokens for decoding by full recomputation.

    Attributes:
      tokens: `[B, L]` int32, right-padded.
      lengths: `[B]` int32 real tokens per row.
    """

    tokens: jax.Array
    lengths: jax.Array


def prompt_bucket(length: int, max_len: int) -> int:
    """The padded prompt length: next power of two (>= 8) up to 64, then next multiple of 64; at most `max_len`."""
    bucket = 8
    while bucket < min(length, 64):
        bucket *= 2
    if length > 64:
        bucket = -(-length // 64) * 64
    return max(length, min(bucket, max_len))


# ---------------------------------------------------------------- one step


def _choose(state: DecodeState, logits: jax.Array, context, knobs: SamplingKnobs):
    """Draws the next token of every row from `[B, V]` logits and records it; returns `(state, token)`."""
    rng, key = jax.random.split(state.rng)
    drawn = sampling.sample(logits, key, temperature=knobs.temperature, top_k=knobs.top_k, top_p=knobs.top_p)
    token = jnp.where(state.done, knobs.pad_token, drawn)  # [B]
    unusable = ~jnp.isfinite(jnp.max(logits, axis=-1)) & ~state.done  # NaN, +inf or all -inf: nothing to draw from
    state = DecodeState(
        context=context,
        last_token=token,
        done=state.done | (token == knobs.stop_token),
        counts=state.counts + (~state.done).astype(jnp.int32),
        rng=rng,
        nonfinite_from=jnp.where(unusable & (state.nonfinite_from < 0), state.counts, state.nonfinite_from),
    )
    return state, token


def _extend_cache(model: DecoderLM, params, cache: DecodeCache, token, active):
    """One cached step: `[B]` tokens -> (`[B, V]` logits, cache); inactive rows do not advance."""
    logits, cache = model.apply({"params": params}, token[:, None], cache,
                                num_new=active.astype(jnp.int32), method=DecoderLM.extend)
    return logits[:, 0], cache


def _extend_buffer(model: DecoderLM, params, buffer: TokenBuffer, token, active):
    """One recomputed step: append `[B]` tokens, rerun the whole buffer, read `[B, V]` logits at the last real token."""
    rows = jnp.arange(token.shape[0])
    tokens = buffer.tokens.at[rows, buffer.lengths].set(jnp.where(active, token, buffer.tokens[rows, buffer.lengths]))
    lengths = buffer.lengths + active.astype(jnp.int32)
    logits = model.apply({"params": params}, tokens)  # [B, L, V]
    return logits[rows, lengths - 1], TokenBuffer(tokens=tokens, lengths=lengths)


# ---------------------------------------------------------------- the loop


def _decode(first_logits, context, advance: Callable, rng, knobs: SamplingKnobs, max_new_tokens: int,
            return_logits: bool):
    """Samples from `[B, V]` prefill logits, then scans `max_new_tokens - 1` steps of `advance`."""
    batch = first_logits.shape[0]
    state = DecodeState(context=context, last_token=jnp.zeros((batch,), jnp.int32),
                        done=jnp.zeros((batch,), bool), counts=jnp.zeros((batch,), jnp.int32), rng=rng,
                        nonfinite_from=jnp.full((batch,), -1, jnp.int32))
    state, first_token = _choose(state, first_logits, context, knobs)

    def step(state: DecodeState, _):
        logits, context = advance(state.context, state.last_token, ~state.done)
        state, token = _choose(state, logits, context, knobs)
        return state, (token, logits if return_logits else None)

    state, (tokens, logits) = jax.lax.scan(step, state, None, length=max_new_tokens - 1)
    tokens = jnp.concatenate([first_token[:, None], tokens.T], axis=1)  # [B, max_new_tokens]
    if return_logits:
        logits = jnp.concatenate([first_logits[:, None], jnp.swapaxes(logits, 0, 1)], axis=1)  # [B, max_new, V]
    return GenerateOutput(tokens=tokens, counts=state.counts, logits=logits, nonfinite_from=state.nonfinite_from)


def _last_real(logits, lengths):
    """`[B, T, V]` logits -> `[B, V]` at position `lengths - 1` of each row."""
    return logits[jnp.arange(logits.shape[0]), lengths - 1]


_STATIC = ("config", "kernels", "max_new_tokens", "return_logits")


def _on_mesh(cache: DecodeCache, config: ModelConfig, mesh: Mesh | None) -> DecodeCache:
    """The cache split by rows (data x fsdp) and kv heads (tensor) where those divide; as is without a mesh."""
    if mesh is None:
        return cache
    return sharding.constrain(cache, sharding.cache_specs(cache, config, MeshShape.of(mesh)), mesh)


@functools.partial(jax.jit, static_argnames=(*_STATIC, "cache_len", "mesh", "kv_cache"))
def _generate_cached(params, prompt, lengths, rng, knobs, *, config, kernels, max_new_tokens, cache_len,
                     return_logits, mesh=None, kv_cache="auto"):
    model = DecoderLM(config, kernels)
    cache = _on_mesh(init_cache(config, prompt.shape[0], cache_len, dtype=kv_cache), config, mesh)
    logits, cache = model.apply({"params": params}, prompt, cache, num_new=lengths, method=DecoderLM.extend)
    cache = _on_mesh(cache, config, mesh)
    advance = functools.partial(_extend_cache, model, params)
    return _decode(_last_real(logits, lengths), cache, advance, rng, knobs, max_new_tokens, return_logits)


@functools.partial(jax.jit, static_argnames=(*_STATIC, "buffer_len"))
def _generate_recomputed(params, prompt, lengths, rng, knobs, *, config, kernels, max_new_tokens, buffer_len,
                         return_logits):
    model = DecoderLM(config, kernels)
    tokens = jnp.zeros((prompt.shape[0], buffer_len), jnp.int32).at[:, :prompt.shape[1]].set(prompt)
    logits = model.apply({"params": params}, tokens)  # [B, L, V]
    advance = functools.partial(_extend_buffer, model, params)
    buffer = TokenBuffer(tokens=tokens, lengths=lengths)
    return _decode(_last_real(logits, lengths), buffer, advance, rng, knobs, max_new_tokens, return_logits)


# ---------------------------------------------------------------- public API


def _require_concrete(**values) -> None:
    """TypeError naming the first argument that is a tracer: `generate` runs its own jitted programs."""
    for name, value in values.items():
        if value is not None and concrete_or_none(value) is None:
            raise TypeError(f"{name} is a traced value: generate cannot run inside jax.jit (it picks the "
                            "prompt bucket from the lengths and compiles its own programs); call it outside "
                            "jit (temperature, top_k, top_p and the rng are traced inside, so changing them "
                            "does not recompile)")


def _validate_tokens(config, top_k, stop_token, pad_token) -> None:
    _require_concrete(top_k=top_k, stop_token=stop_token, pad_token=pad_token)
    if not np.all(np.asarray(top_k) >= 0):
        raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}")
    for name, token in (("stop_token", stop_token), ("pad_token", pad_token)):
        if token is not None and not 0 <= int(token) < config.vocab_size:
            raise ValueError(f"{name} must be a token id in [0, vocab_size={config.vocab_size}), got {token}")


def validated_arguments(config, kernels, prompt_tokens, prompt_lengths, max_new_tokens, temperature, top_k, top_p,
                        stop_token, pad_token):
    """`generate`'s checks on host values before anything is traced (a TypeError or ValueError naming the
    argument); returns numpy `(tokens [B,Tp], lengths [B])` int32. Also run by `jaxattn.speculative`."""
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config must be a ModelConfig, got {type(config).__name__}")
    if not isinstance(kernels, Kernels):
        raise TypeError(f"kernels must be a jaxattn.Kernels, got {type(kernels).__name__}")
    _require_concrete(prompt_tokens=prompt_tokens, prompt_lengths=prompt_lengths, temperature=temperature,
                      top_p=top_p)
    tokens, lengths = np.asarray(prompt_tokens), np.asarray(prompt_lengths)
    if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"prompt_tokens must be an integer array [B, Tp], got {tokens.dtype} {tokens.shape}")
    if tokens.shape[0] == 0:
        raise ValueError(f"prompt_tokens must hold at least one row, got shape {tokens.shape}")
    if lengths.shape != tokens.shape[:1] or not np.issubdtype(lengths.dtype, np.integer):
        raise ValueError(f"prompt_lengths must be an integer array [B] = [{tokens.shape[0]}], "
                         f"got {lengths.dtype} {lengths.shape}")
    if lengths.min() < 1 or lengths.max() > tokens.shape[1]:
        raise ValueError(f"prompt_lengths must be in [1, Tp={tokens.shape[1]}], got {lengths.tolist()}")
    if tokens.min() < 0 or tokens.max() >= config.vocab_size:
        raise ValueError(f"prompt_tokens must be in [0, vocab_size={config.vocab_size}), "
                         f"got range [{tokens.min()}, {tokens.max()}]")
    if not is_int(max_new_tokens, numpy=False) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if lengths.max() + max_new_tokens > config.max_seq_len:
        raise ValueError(f"longest prompt ({lengths.max()}) + max_new_tokens ({max_new_tokens}) exceeds "
                         f"the model's context, config.max_seq_len={config.max_seq_len}")
    if not np.all(np.asarray(temperature) >= 0):
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if not 0.0 <= float(top_p) <= 1.0:
        raise ValueError(f"top_p must be in [0, 1], got {top_p}")
    _validate_tokens(config, top_k, stop_token, pad_token)
    return tokens.astype(np.int32), lengths.astype(np.int32)


def call_lengths(config: ModelConfig, prompt_len: int, max_new_tokens: int) -> tuple[int, int]:
    """(padded prompt length, cache length) of a `generate` call whose longest prompt has `prompt_len`
    tokens: the shapes its program is compiled for (and what it holds)."""
    bucket = prompt_bucket(prompt_len, config.max_seq_len)
    return bucket, min(bucket + max_new_tokens, config.max_seq_len)


def _prepare(config, kernels, prompt_tokens, prompt_lengths, max_new_tokens, temperature, top_k, top_p,
             stop_token, pad_token):
    """Validates, pads the prompt to its bucket and packs the traced knobs."""
    tokens, lengths = validated_arguments(config, kernels, prompt_tokens, prompt_lengths, max_new_tokens,
                                          temperature, top_k, top_p, stop_token, pad_token)
    bucket, context_len = call_lengths(config, int(lengths.max()), max_new_tokens)
    padded = np.full((tokens.shape[0], bucket), pad_token, np.int32)
    width = min(bucket, tokens.shape[1])
    padded[:, :width] = tokens[:, :width]
    knobs = SamplingKnobs(
        temperature=jnp.asarray(temperature, jnp.float32), top_k=jnp.asarray(top_k, jnp.int32),
        top_p=jnp.asarray(top_p, jnp.float32), stop_token=jnp.asarray(-1 if stop_token is None else stop_token,
                                                                       jnp.int32),
        pad_token=jnp.asarray(pad_token, jnp.int32))
    return jnp.asarray(padded), jnp.asarray(lengths), knobs, context_len


def generate(params, config: ModelConfig, prompt_tokens, prompt_lengths, *, max_new_tokens: int, rng: jax.Array,
             temperature=1.0, top_k=0, top_p=1.0, stop_token: int | None = None, pad_token: int = 0,
             return_logits: bool = False, kernels: Kernels | None = None, mesh: Mesh | None = None,
             kv_cache: str = "auto") -> GenerateOutput:
    """Generates `max_new_tokens` tokens after each prompt with a KV cache.

    Args:
      params: `DecoderLM(config)` parameters.
      config: the model config (static: part of the compilation key).
      prompt_tokens: `[B, Tp]` int, right-padded prompts.
      prompt_lengths: `[B]` int, real tokens per prompt (1..Tp).
      max_new_tokens: tokens to generate per row; prompt + new must fit in
        `config.max_seq_len` (`generate_windowed` goes further).
      rng: PRNG key of the draws (same key, same tokens).
      temperature, top_k, top_p: see `jaxattn.sampling`; traced, so changing
        them does not recompile.
      stop_token: id that ends a row (it is emitted, then padding); None = never.
      pad_token: id written after a row's stop token (and used to pad prompts).
      return_logits: also return the `[B, max_new_tokens, V]` logits of each draw.
      kernels: which implementations run the model (static). None: the reference, except that a
        quantized model's matmuls take the platform's fast path (`jaxattn.kernels.default_kernels`,
        its weights laid out for it each call: `call_kernels`); `Kernels()`: the reference throughout.
      mesh: a device mesh over `jaxattn.axes.MESH_AXES` (`jaxattn.axes.make_mesh`) to
        run on: the parameters are laid out by `jaxattn.axes.RULES` and the cache
        is split by rows and kv heads; the tokens equal one device's (up to float
        summation order in the logits). The outputs are replicated on the mesh.
      kv_cache: the cache's storage (static): "auto" (the compute dtype: exact) or "int8" (int8
        values and a float32 scale per token and head, dequantized before the softmax: a quarter
        of float32's bytes plus the scales, logits off by the rounding; `jaxattn.cache.int8`).

    Returns:
      `GenerateOutput(tokens [B, max_new_tokens], counts [B], logits, nonfinite_from [B])`.
    """
    if kv_cache not in KV_CACHES:
        raise ValueError(f"kv_cache must be one of {KV_CACHES}, got {kv_cache!r}")
    kernels, params = call_kernels(params, kernels, on_mesh=mesh is not None)
    prompt, lengths, knobs, cache_len = _prepare(config, kernels, prompt_tokens, prompt_lengths, max_new_tokens,
                                                 temperature, top_k, top_p, stop_token, pad_token)
    if mesh is not None:
        params, (prompt, lengths, rng, knobs) = _place_on(mesh, config, params, (prompt, lengths, rng, knobs))
    return _generate_cached(params, prompt, lengths, rng, knobs, config=config, kernels=kernels,
                            max_new_tokens=max_new_tokens, cache_len=cache_len, return_logits=return_logits,
                            mesh=mesh, kv_cache=kv_cache)


def _place_on(mesh: Mesh, config: ModelConfig, params, inputs):
    """Params laid out on `mesh` by the rules of `jaxattn.sharding` (a no-op for params already
    there), the other inputs replicated."""
    layout = sharding.param_layout(config, MeshShape.of(mesh))
    params = sharding.place(nn.unbox(params), layout.shardings(mesh))
    replicated = NamedSharding(mesh, PartitionSpec())
    return params, sharding.place(inputs, jax.tree.map(lambda _: replicated, inputs))


def generate_without_cache(params, config: ModelConfig, prompt_tokens, prompt_lengths, *, max_new_tokens: int,
                           rng: jax.Array, temperature=1.0, top_k=0, top_p=1.0, stop_token: int | None = None,
                           pad_token: int = 0, return_logits: bool = False,
                           kernels: Kernels = Kernels()) -> GenerateOutput:
    """`generate` without a cache: every step reruns the full forward over a fixed `[B, L]` buffer.

    Same arguments, same draws (the rng is split identically), so with equal
    logits it returns the same tokens; O(L) times the work per step.
    """
    prompt, lengths, knobs, buffer_len = _prepare(config, kernels, prompt_tokens, prompt_lengths, max_new_tokens,
                                                  temperature, top_k, top_p, stop_token, pad_token)
    return _generate_recomputed(params, prompt, lengths, rng, knobs, config=config, kernels=kernels,
                                max_new_tokens=max_new_tokens, buffer_len=buffer_len, return_logits=return_logits)


@functools.lru_cache(maxsize=32)
def _checked_extend_program(model: DecoderLM) -> Callable:
    """One jitted, checkified `extend` per model (equal models share it), so calls retrace only for new shapes."""
    def extend(params, tokens, cache, num_new):
        return model.apply({"params": params}, tokens, cache, num_new=num_new, check=True,
                           method=DecoderLM.extend)
    return jax.jit(checkify.checkify(extend))


def checked_extend(model: DecoderLM, params, tokens, cache: DecodeCache, *, num_new=None):
    """`DecoderLM.extend` under `jit` with its preconditions checked on the device.

    Cache capacity, `num_new` and token ids are checked by `checkify`; a failed
    check raises a ValueError with its message instead of returning wrong logits.
    Slower than `extend` (the checks and a host round trip), for tests and debugging; compiled
    once per model and input shapes.
    """
    error, out = _checked_extend_program(model)(params, tokens, cache, num_new)
    message = error.get()
    if message:
        raise ValueError(message.split(" (`check` failed)")[0])
    return out
