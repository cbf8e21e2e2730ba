"""The target model's side of a speculative step over its dense cache: one forward pass over the committed
token and its drafts, the acceptance rule, and the rollback.

`verify_step` appends to each row `[pending, d_1, ..., d_k]` (the last committed token, not yet in the
cache, then the drafts) in one `DecoderLM.extend` of width k + 1 (`num_new` = the row's drafts + 1, so
a row proposing fewer, or none, shares the program), applies `jaxattn.speculative.acceptance.accept`,
and sets each row's cache length to keep only the pending token and the accepted drafts (`rollback`).
The slots of rejected drafts stay written but are never read: reads are masked by position
(`jaxattn.masks.visible_cache_slots`) and the next step overwrites them. The program compiles once per
(k, cache length); the cache is donated, so the step updates it in place as a decoding scan would.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxattn import sampling
from jaxattn.cache.build import init_cache
from jaxattn.cache.containers import DecodeCache
from jaxattn.config import ModelConfig
from jaxattn.decoding import SamplingKnobs
from jaxattn.kernels import Kernels
from jaxattn.model import DecoderLM
from jaxattn.speculative.acceptance import accept, greedy_accept


def rollback(cache: DecodeCache, lengths) -> DecodeCache:
    """`cache` holding only the first `lengths [B]` tokens of each row (the slots past them are masked from
    every later read and overwritten by the next writes)."""
    return cache.replace(lengths=jnp.asarray(lengths, jnp.int32))


@functools.partial(jax.jit, static_argnames=("config", "kernels", "cache_len", "kv_cache"))
def prefill(params, prompt, lengths, rng, knobs: SamplingKnobs, *, config: ModelConfig, kernels: Kernels,
            cache_len: int, kv_cache: str = "auto"):
    """The prompt into a fresh cache and the first token drawn, as `jaxattn.generate` does.

    Args:
      prompt: `[B, Tp]` int right-padded prompts; `lengths`: `[B]` int real tokens per row.
      rng: the key of the first draw; `knobs`: the sampling settings.
      cache_len: the cache's slots per row (prompt, output and k drafts).

    Returns:
      `(first_token [B] int32, cache)`: the cache holds each row's prompt.
    """
    model = DecoderLM(config, kernels)
    cache = init_cache(config, prompt.shape[0], cache_len, dtype=kv_cache)
    logits, cache = model.apply({"params": params}, prompt, cache, num_new=lengths, method=DecoderLM.extend)
    last = logits[jnp.arange(prompt.shape[0]), lengths - 1]  # [B, V]
    token = sampling.sample(last, rng, temperature=knobs.temperature, top_k=knobs.top_k, top_p=knobs.top_p)
    return token, cache


@functools.partial(jax.jit, static_argnames=("config", "kernels", "sampled"), donate_argnames=("cache",))
def verify_step(params, cache: DecodeCache, tokens, num_proposed, active, rng, step, knobs: SamplingKnobs, *,
                config: ModelConfig, kernels: Kernels, sampled: bool = True):
    """One verification of k drafts per row.

    Args:
      cache: the target's `DecodeCache`, each row holding its committed tokens but the last.
      tokens: `[B, k+1]` int: each row's last committed token, then its k drafts (right-padded).
      num_proposed: `[B]` int in `[0, k]` real drafts per row.
      active: `[B]` bool; an inactive row (finished) neither advances nor accepts.
      rng, step: the generation's key and this step's index (folded in: a key per step).
      knobs: the sampling settings (temperature 0: greedy, exact match).
      sampled: False compiles the exact-match rule alone, for a caller that knows every row is greedy
        (the rejection sampler's sorts are most of a small model's compile time); True serves any knobs.

    Returns:
      `(accepted [B] int32, next_token [B] int32, cache)`: each row keeps its first `accepted` drafts and
      then emits `next_token`; the cache holds the last committed token and the accepted drafts.
    """
    model = DecoderLM(config, kernels)
    num_proposed = jnp.where(active, num_proposed, 0)
    start = cache.lengths
    logits, cache = model.apply({"params": params}, tokens, cache, num_new=jnp.where(active, num_proposed + 1, 0),
                                method=DecoderLM.extend)
    if sampled:
        accepted, next_token = accept(logits, tokens[:, 1:], num_proposed, jax.random.fold_in(rng, step),
                                      temperature=knobs.temperature, top_k=knobs.top_k, top_p=knobs.top_p)
    else:
        accepted, next_token = greedy_accept(logits, tokens[:, 1:], num_proposed)
    return accepted, next_token, rollback(cache, start + jnp.where(active, accepted + 1, 0))


@functools.partial(jax.jit, static_argnames=("config", "kernels", "steps", "sampled"), donate_argnames=("cache",))
def plain_steps(params, cache: DecodeCache, last_token, active, rng, step, knobs: SamplingKnobs, *,
                config: ModelConfig, kernels: Kernels, steps: int, sampled: bool = True):
    """`steps` plain decoding steps in one program (a `jax.lax.scan` of one-token extends, as `generate`'s),
    for a stretch with nothing to verify: no host round trip per token.

    Args:
      cache, last_token `[B]`, active `[B]`: as `verify_step`'s (inactive rows do not advance).
      rng, step: step i's draw uses the key `fold_in(fold_in(rng, step), i)`.
      sampled: False draws the argmax alone (the knobs' temperature must then be 0).

    Returns:
      `(tokens [B, steps] int32, cache)`: the cache holds `last_token` and all but the last new token.
    """
    model = DecoderLM(config, kernels)
    key = jax.random.fold_in(rng, step)

    def one(carry, i):
        cache, token = carry
        logits, cache = model.apply({"params": params}, token[:, None], cache, num_new=active.astype(jnp.int32),
                                    method=DecoderLM.extend)
        token = (sampling.sample(logits[:, 0], jax.random.fold_in(key, i), temperature=knobs.temperature,
                                 top_k=knobs.top_k, top_p=knobs.top_p) if sampled else sampling.greedy(logits[:, 0]))
        return (cache, token), token

    (cache, _), tokens = jax.lax.scan(one, (cache, last_token), jnp.arange(steps))
    return tokens.T, cache
