"""Generation past the model's context: `generate` run in windows, as nanoGPT crops its context.

`generate_windowed` returns every drawn token at once; `windows` yields them window by
window, so a program can show progress, print tokens as they come, or stop between windows
and keep what was drawn (what `python -m train.sample` and the end-of-run sample do);
with `check_finite=True` it raises `NonFiniteLogits` when a token was drawn from logits that
are not finite (a model with NaN weights), instead of yielding arbitrary tokens.
"""

from __future__ import annotations

from typing import Iterator

import jax
import numpy as np
from jax.sharding import Mesh

from jaxattn._validate import require_positive_int
from jaxattn.cache.containers import KV_CACHES
from jaxattn.config import ModelConfig
from jaxattn.decoding import generate
from jaxattn.kernels import Kernels, call_kernels


class NonFiniteLogits(FloatingPointError):
    """A token was drawn from logits with no finite maximum (a NaN, +inf, or every logit -inf).

    Attributes:
      sample: the row of the batch.
      token: the index of that token among the row's new tokens.
      context: `[n]` int32 ids the model saw when it gave those logits (the window's history
        and the tokens drawn before it): the model's forward pass over them ends in those logits.
    """

    def __init__(self, sample: int, token: int, context: np.ndarray):
        self.sample, self.token, self.context = sample, token, context
        super().__init__(f"sample {sample}'s new token {token} was drawn from logits that are not finite "
                         "(NaN or infinity)")


def windows(params, config: ModelConfig, prompt_ids, *, max_new_tokens: int, rng: jax.Array,
            num_samples: int = 1, temperature=1.0, top_k=0, top_p=1.0, kernels: Kernels | None = None,
            mesh: Mesh | None = None, check_finite: bool = False, kv_cache: str = "auto") -> Iterator[np.ndarray]:
    """`generate_windowed` as a stream: yields `[num_samples, n]` ids, one window at a time.

    The chunks, concatenated, are `generate_windowed`'s output (n sums to `max_new_tokens`),
    so a caller can show progress, write tokens as they come, or stop between windows and
    keep what was drawn. Arguments are checked when this is called, before the first window.
    Host memory holds the chunks already yielded (the caller's) and half a context of history.
    With `check_finite`, a window in which some row drew a token from logits that are not finite
    (`GenerateOutput.nonfinite_from`) raises `NonFiniteLogits` for its first such row instead of
    being yielded.
    """
    context = config.max_seq_len
    prompt = np.asarray(prompt_ids).reshape(-1)
    if prompt.size == 0 or context < 2:
        raise ValueError(f"generate_windowed needs a non-empty prompt and max_seq_len >= 2, got "
                         f"{prompt.shape[0]} tokens and max_seq_len={context}")
    require_positive_int("max_new_tokens", max_new_tokens)
    require_positive_int("num_samples", num_samples)
    prompt = prompt.astype(np.int32)[-(context - 1):]  # room for one new token
    if kv_cache not in KV_CACHES:
        raise ValueError(f"kv_cache must be one of {KV_CACHES}, got {kv_cache!r}")
    kernels, params = call_kernels(params, kernels, on_mesh=mesh is not None)  # None: resolved and laid out once
    knobs = dict(temperature=temperature, top_k=top_k, top_p=top_p, kernels=kernels, mesh=mesh, kv_cache=kv_cache)
    return _windows(params, config, np.tile(prompt, (num_samples, 1)), int(max_new_tokens), rng, knobs,
                    check_finite)


def _kept(config: ModelConfig) -> int:
    """The history a later window continues: the last half context."""
    return max(1, config.max_seq_len // 2)


def _first_new(config: ModelConfig, prompt_len: int, max_new_tokens: int) -> int:
    """The tokens the first window draws after a prompt of `prompt_len` (already cropped to fit)."""
    return min(max_new_tokens, config.max_seq_len - prompt_len)


def window_programs(config: ModelConfig, prompt_len: int, max_new_tokens: int) -> list[tuple[int, int]]:
    """(prompt length, new tokens) of each `generate` program `windows` runs for a prompt of `prompt_len`
    ids: the first window's, and the later windows' when there are any (at most two compile)."""
    prompt = min(prompt_len, config.max_seq_len - 1)  # as `windows` crops it
    first, keep = _first_new(config, prompt, max_new_tokens), _kept(config)
    return [(prompt, first)] + ([(keep, config.max_seq_len - keep)] if max_new_tokens > first else [])


def _windows(params, config: ModelConfig, rows: np.ndarray, max_new_tokens: int, rng, knobs,
             check_finite: bool = False) -> Iterator[np.ndarray]:
    """The windows of `windows`: the first continues `rows` [B, P], each later one the last half context."""
    context, window, drawn, keep = config.max_seq_len, 0, 0, _kept(config)
    while drawn < max_new_tokens:
        num_new = _first_new(config, rows.shape[1], max_new_tokens) if window == 0 else context - keep
        key = rng if window == 0 else jax.random.fold_in(rng, window)
        out = generate(params, config, rows, np.full(rows.shape[0], rows.shape[1]), max_new_tokens=num_new,
                       rng=key, **knobs)
        tokens, nonfinite_from = np.asarray(out.tokens), np.asarray(out.nonfinite_from)  # [B, num_new], [B]
        del out  # a paused stream holds host arrays only (a caller may keep thousands, one per call of rows)
        chunk = tokens[:, :max_new_tokens - drawn]
        if check_finite:
            _check_finite(nonfinite_from, chunk.shape[1], rows, tokens, drawn)
        rows = np.concatenate([rows, tokens], axis=1)[:, -keep:]  # the next window's history
        drawn, window = drawn + chunk.shape[1], window + 1
        yield chunk


def _check_finite(nonfinite_from: np.ndarray, kept: int, rows: np.ndarray, tokens: np.ndarray, drawn: int) -> None:
    """`NonFiniteLogits` for the row whose earliest kept token (of the first `kept`) came from logits that
    are not finite, with their context: the row's history `rows`, then its `tokens` before that one."""
    at = np.where((nonfinite_from >= 0) & (nonfinite_from < kept), nonfinite_from, kept)
    row = int(np.argmin(at))
    if at[row] < kept:
        raise NonFiniteLogits(row, drawn + int(at[row]),
                              np.concatenate([rows[row], tokens[row, :at[row]]]).astype(np.int32))


def generate_windowed(params, config: ModelConfig, prompt_ids, *, max_new_tokens: int, rng: jax.Array,
                      num_samples: int = 1, temperature=1.0, top_k=0, top_p=1.0,
                      kernels: Kernels | None = None, mesh: Mesh | None = None, kv_cache: str = "auto") -> np.ndarray:
    """`[num_samples, max_new_tokens]` ids continuing one prompt, past the model's context if need be.

    Within the context this is `generate` (the same draws for the same `rng`).
    Beyond it, as nanoGPT crops its context, generation goes on in windows: the
    last half context of tokens is prefilled again and the next half context
    drawn, so every token sees between half and all of a context of history.
    A prompt that fills the context keeps its last `max_seq_len - 1` tokens.
    At most two programs compile: the first window and the later ones.
    `windows` yields the same tokens window by window.

    Args:
      prompt_ids: `[P]` int token ids, P >= 1.
      max_new_tokens, num_samples: positive ints (ValueError otherwise, as `generate`).
      the rest: as `generate` (one prompt, `num_samples` rows).
    """
    return np.concatenate(list(windows(params, config, prompt_ids, max_new_tokens=max_new_tokens, rng=rng,
                                       num_samples=num_samples, temperature=temperature, top_k=top_k,
                                       top_p=top_p, kernels=kernels, mesh=mesh, kv_cache=kv_cache)), axis=1)
