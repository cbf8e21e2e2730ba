"""Many samples drawn call by call and window by window: `sample`, the loop of `python -m train.sample`.

Each window of every sample (`jaxattn.windowed.windows`: the KV-cached `generate`, continued past
the model's context) is drawn by calls of `rows` samples, so what one call holds does not grow with
the number of samples (`train.decode.memory` plans `rows`). One call draws the tokens
`jaxattn.generate_windowed` draws with the seed's key; several calls each get a key of their own
(`call_keys`). A warm-up call compiles every program first, so the time reported is the steady
state's. A stop signal (Ctrl-C, SIGTERM) ends the run between calls, keeping the windows every sample
has finished; a token drawn from logits that are not finite ends it with a `NonFiniteError` that
names the first layer whose output is not finite (`train.models.nonfinite`).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Iterator

import jax
import numpy as np
from tqdm import tqdm

from jaxattn.config import ModelConfig
from jaxattn.windowed import NonFiniteLogits, window_programs, windows
from train.cli import Stopped, StopSignals
from train.models.nonfinite import describe_nonfinite

BATCH_KEYS = 2 ** 31 - 1  # folded into the seed's key for the keys of several calls (windows fold in 1, 2, ...)


class NonFiniteError(RuntimeError):
    """A sample's token would be drawn from logits that are not finite (exit 1)."""


@dataclass(frozen=True)
class Draw:
    """What to draw: `num_samples` continuations of `max_new_tokens` tokens each, and how (the knobs of
    `jaxattn.windowed.windows`: `kv_cache` is the cache's storage, "auto" or "int8")."""

    num_samples: int
    max_new_tokens: int
    seed: int = 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    kv_cache: str = "auto"


def warmup_tokens(config: ModelConfig, prompt_len: int, max_new_tokens: int) -> int:
    """The fewest new tokens that compile every program `max_new_tokens` needs: the first window's,
    and the later windows' when it has any."""
    programs = window_programs(config, prompt_len, max_new_tokens)
    return programs[0][1] + (len(programs) > 1)  # one token of the later windows compiles theirs


def call_keys(seed: int, calls: int):
    """The rng of each call, `keys[i]`: the seed's key itself when one call draws every sample (the
    draws of `generate_windowed`), else keys folded from it apart from those the windows fold in, as
    one `[calls, 2]` host array (8 bytes a call; a device array each would take kilobytes)."""
    key = jax.random.PRNGKey(seed)
    if calls == 1:
        return [key]
    base = jax.random.fold_in(key, BATCH_KEYS)
    return np.asarray(jax.vmap(jax.random.fold_in, (None, 0))(base, np.arange(calls, dtype=np.uint32)))


def nonfinite_error(err: NonFiniteLogits, params, config: ModelConfig, first_row: int) -> NonFiniteError:
    """The one line for `err` (raised by the call whose rows start at `first_row`): which sample and
    token, and the first layer whose output is not finite on what the model saw."""
    where = describe_nonfinite(params, config, err.context, padding=0)  # generate's pad_token
    return NonFiniteError(f"the logits that new token {err.token + 1} of sample {first_row + err.sample + 1} would "
                          f"be drawn from are not finite (NaN or infinity): {where}")


class Calls:
    """The calls that draw `draw.num_samples` samples `rows` at a time, call i with `keys[i]`."""

    def __init__(self, params, config: ModelConfig, prompt_ids: np.ndarray, draw: Draw, kernels, mesh, rows: int):
        self.params, self.config, self.prompt_ids, self.draw = params, config, prompt_ids, draw
        self.kernels, self.mesh, self.rows = kernels, mesh, rows
        self.keys = call_keys(draw.seed, -(-draw.num_samples // rows))

    def stream(self, i: int, max_new_tokens: int) -> Iterator[np.ndarray]:
        """Call i's windows of `max_new_tokens` new tokens, `[rows, n]` ids each; `NonFiniteError` when a
        token's logits are not finite."""
        d = self.draw
        try:
            yield from windows(self.params, self.config, self.prompt_ids, max_new_tokens=max_new_tokens,
                               rng=self.keys[i], num_samples=self.rows, temperature=d.temperature, top_k=d.top_k,
                               top_p=d.top_p, kernels=self.kernels, mesh=self.mesh, check_finite=True,
                               kv_cache=d.kv_cache)
        except NonFiniteLogits as err:
            raise nonfinite_error(err, self.params, self.config, i * self.rows) from None

    def fill(self, ids: np.ndarray, signals: StopSignals, bar: tqdm) -> int:
        """Draws every call's windows into `ids` `[num_samples, max_new_tokens]`, window after window,
        until they are full or a signal has come; the new tokens every sample has (a window unfinished
        when the signal came is dropped)."""
        num_samples, max_new = ids.shape
        done, streams = 0, [None] * len(self.keys)  # each made at its first window and dropped after its last
        while done < max_new:  # the window in hand when a signal comes is finished, as `until_requested` does
            for i in range(len(streams)):
                if i and signals.requested:
                    break  # between calls of a window drawn by several: it is unfinished, and dropped
                if done == 0:
                    streams[i] = self.stream(i, max_new)
                chunk = next(streams[i])
                low, high = i * self.rows, min(num_samples, (i + 1) * self.rows)
                ids[low:high, done:done + chunk.shape[1]] = chunk[:high - low]
                bar.update((high - low) * chunk.shape[1])
                if done + chunk.shape[1] == max_new:
                    streams[i] = None  # its last window: what it holds can go
            else:
                done += chunk.shape[1]
            if signals.requested:
                break
        return done


def sample(params, config: ModelConfig, prompt_ids: np.ndarray, draw: Draw, kernels, mesh, rows: int | None = None
           ) -> tuple[np.ndarray, str | None]:
    """(`[num_samples, n]` ids, the stop signal's name or None): a warm-up call (compiling, its time on
    stderr), then the timed run (its tokens/s on stderr, with a progress bar on a terminal), window by
    window, each window drawn by calls of `rows` samples (default: all of them). A stop signal ends it
    between calls, keeping the n tokens of the windows every sample has finished (`Stopped` while
    compiling); `NonFiniteError` when a token's logits are not finite."""
    calls = Calls(params, config, prompt_ids, draw, kernels, mesh, draw.num_samples if rows is None else rows)
    with StopSignals() as signals:
        start, warm = time.perf_counter(), warmup_tokens(config, len(prompt_ids), draw.max_new_tokens)
        for _ in calls.stream(0, warm):  # compiles every program the run needs
            pass
        if signals.requested:
            raise Stopped(f"{signals.requested} while compiling: nothing was generated")
        print(f"compile: {time.perf_counter() - start:.2f} s (a warm-up call of {warm} token(s) per sample, "
              "compiling)", file=sys.stderr, flush=True)
        start = time.perf_counter()
        ids = np.empty((draw.num_samples, draw.max_new_tokens), np.int32)  # pages are taken as they are written
        with tqdm(total=ids.size, unit="tok", desc="sampling", file=sys.stderr, disable=None, leave=False) as bar:
            ids = ids[:, :calls.fill(ids, signals, bar)]
    steady = time.perf_counter() - start
    print(f"decode: {ids.size} tokens ({draw.num_samples} x {ids.shape[1]}) in {steady:.3f} s "
          f"= {ids.size / steady:,.0f} tokens/s", file=sys.stderr)
    return ids, signals.requested if ids.shape[1] < draw.max_new_tokens else None
