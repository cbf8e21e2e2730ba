"""Many samples drawn call by call and window by window: `sample`, the loop of `python -m train.sample`.

Each window of every sample (`jaxattn.windowed.windows`: the KV-cached `generate`, continued past
the model's context) is drawn by calls of `rows` samples, so what one call holds does not grow with
the number of samples (`train.decode.memory` plans `rows`). One call draws the tokens
`jaxattn.generate_windowed` draws with the seed's key; several calls each get a key of their own
(`call_keys`). A warm-up call compiles every program first, so the time reported is the steady
state's. The calls run one after another, each drawing all its windows, and hand their samples out as
they end, so a long run's first samples are out long before its last. A stop signal (Ctrl-C, SIGTERM)
ends the call in hand after its current window and starts no other: the samples drawn are kept (those
of the call in hand as far as they go), none is made up for the samples never drawn; a token drawn from logits that are not finite ends it with a `NonFiniteError` that
names the first layer whose output is not finite (`train.models.nonfinite`).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Callable, Iterator

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

    def each(self, signals: StopSignals, bar: tqdm) -> Iterator[np.ndarray]:
        """Each call's samples as soon as the call has drawn them, `[rows, max_new_tokens]` ids, call after
        call. After a stop signal the call in hand ends after its current window (its samples as far as
        they go, `[rows, n]`) and no other call starts; the first call's first window is always drawn."""
        num_samples, max_new = self.draw.num_samples, self.draw.max_new_tokens
        for i in range(len(self.keys)):
            if i and signals.requested:
                return
            low, high = i * self.rows, min(num_samples, (i + 1) * self.rows)
            ids, done = np.empty((high - low, max_new), np.int32), 0
            for chunk in self.stream(i, max_new):
                ids[:, done:done + chunk.shape[1]] = chunk[:high - low]
                done += chunk.shape[1]
                bar.update((high - low) * chunk.shape[1])
                if signals.requested and done < max_new:
                    break  # the window in hand is finished, as `until_requested` does; the rest never drawn
            yield ids[:, :done]


@dataclass(frozen=True)
class Sampled:
    """What a run drew: `complete` samples of every new token, then `cut` samples of `cut_tokens` (a stop
    signal ended their call early; 0 without one), and the signal's name or None."""

    complete: int
    cut: int = 0
    cut_tokens: int = 0
    stopped: str | None = None


def sample(params, config: ModelConfig, prompt_ids: np.ndarray, draw: Draw, kernels, mesh, rows: int | None = None,
           emit: Callable[[np.ndarray], None] = lambda ids: None) -> Sampled:
    """Draws the samples, handing each call's to `emit` (`[rows, n]` ids) as soon as it is drawn: a warm-up
    call (compiling, its time on stderr), then the timed run (its tokens/s on stderr, with a progress bar
    on a terminal), call by call, each call of `rows` samples (default: all of them) drawing its windows.
    A stop signal ends the call in hand after its window and starts no other (`Stopped` while compiling):
    nothing drawn is lost, and nothing is made up for samples never drawn. `NonFiniteError` when a
    token's logits are not finite."""
    calls = Calls(params, config, prompt_ids, draw, kernels, mesh, draw.num_samples if rows is None else rows)
    complete, cut, tokens = 0, (0, 0), 0
    with StopSignals() as signals:
        start, warm = time.perf_counter(), warmup_tokens(config, len(prompt_ids), draw.max_new_tokens)
        for _ in calls.stream(0, warm):  # compiles every program the run needs
            pass
        if signals.requested:
            raise Stopped(f"{signals.requested} while compiling: nothing was generated")
        print(f"compile: {time.perf_counter() - start:.2f} s (a warm-up call of {warm} token(s) per sample, "
              "compiling)", file=sys.stderr, flush=True)
        start = time.perf_counter()
        total = draw.num_samples * draw.max_new_tokens
        with tqdm(total=total, unit="tok", desc="sampling", file=sys.stderr, disable=None, leave=False) as bar:
            for ids in calls.each(signals, bar):
                emit(ids)
                tokens += ids.size
                if ids.shape[1] == draw.max_new_tokens:
                    complete += len(ids)
                else:
                    cut = (len(ids), ids.shape[1])
    steady = time.perf_counter() - start
    print(f"decode: {tokens} tokens ({complete} x {draw.max_new_tokens}"
          + (f" and {cut[0]} x {cut[1]}" if cut[0] else "") + f") in {steady:.3f} s = {tokens / steady:,.0f} tokens/s",
          file=sys.stderr)
    return Sampled(complete, *cut, signals.requested if complete < draw.num_samples else None)
