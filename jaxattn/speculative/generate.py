"""`speculative_generate`: `jaxattn.generate`'s contract, the target checking k drafted tokens per forward pass.

A host loop over steps. After the prompt's prefill and the first draw (as `generate` does them), each
step:

1. asks the proposer for up to k drafts per row (`jaxattn.speculative.proposal`; k from
   `jaxattn.speculative.schedule.AdaptiveK`, capped by what the row may still emit);
2. runs `jaxattn.speculative.verify.verify_step`: one `DecoderLM.extend` of the last committed token
   and the drafts against the target's dense cache, the acceptance rule
   (`jaxattn.speculative.acceptance.accept`: exact match at temperature 0, rejection sampling above),
   the cache rolled back past the first rejection;
3. emits the kept drafts and the step's own token, stopping a row at its stop token or at
   `max_new_tokens` even inside a kept run (the tokens past that point are dropped).

Greedy output equals `generate`'s token for token (up to the float rounding of a (k+1)-token forward
pass against one-token passes, which can flip an argmax between two near-equal logits); sampled output
has the distribution of `generate`'s, not its draws.

A step with k = 0 is a plain decoding step, and where the schedule has backed off to k = 0 the steps up
to its next probe run as one program (`jaxattn.speculative.verify.plain_steps`, a scan as `generate`'s),
so free text pays no host round trip per token. A step whose drafts are shorter than k (no n-gram
match) verifies at the next width of 0, 1, 2, 4, ... up to k that holds them. The verification program
compiles once per (width, cache length), so a few programs serve a generation.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn._validate import is_int
from jaxattn.cache.containers import KV_CACHES
from jaxattn.config import ModelConfig
from jaxattn.decoding import SamplingKnobs, call_lengths, validated_arguments
from jaxattn.kernels import Kernels, call_kernels
from jaxattn.speculative.proposal import Proposal
from jaxattn.speculative.schedule import AdaptiveK, DraftCosts, widths
from jaxattn.speculative.stats import SpeculativeStats
from jaxattn.speculative.verify import plain_steps, prefill, verify_step


class SpeculativeOutput(NamedTuple):
    """What `speculative_generate` returns.

    Attributes:
      tokens: `[B, max_new_tokens]` int32 numpy generated ids; after a row's stop token (included) the
        rest of the row is `pad_token` (as `jaxattn.GenerateOutput.tokens`).
      counts: `[B]` int32 numpy real generated tokens per row (stop token included).
      stats: the steps, drafts proposed and accepted (`SpeculativeStats`).
    """

    tokens: np.ndarray
    counts: np.ndarray
    stats: SpeculativeStats


class _Rows:
    """Each row's history (prompt, then output), its output and whether it is done, on the host."""

    def __init__(self, tokens: np.ndarray, lengths: np.ndarray, max_new_tokens: int, stop_token: int | None):
        self.histories = [tokens[b, :n].astype(np.int32) for b, n in enumerate(lengths)]
        self.outputs: list[list[int]] = [[] for _ in lengths]
        self.done = np.zeros((len(lengths),), bool)
        self.max_new, self.stop = max_new_tokens, stop_token

    def emit(self, b: int, tokens) -> None:
        """Appends `tokens` to row b's output, up to and including a stop token or the last allowed one."""
        added = []
        for token in map(int, tokens):
            added.append(token)
            if token == self.stop or len(self.outputs[b]) + len(added) == self.max_new:
                self.done[b] = True
                break
        self.outputs[b] += added
        self.histories[b] = np.concatenate([self.histories[b], np.asarray(added, np.int32)])

    def room(self) -> np.ndarray:
        """`[B]` drafts each row may still use: its tokens left to emit less the step's own (0 when done)."""
        left = np.array([self.max_new - len(out) - 1 for out in self.outputs])
        return np.where(self.done, 0, np.maximum(left, 0))

    def result(self, pad_token: int) -> tuple[np.ndarray, np.ndarray]:
        tokens = np.full((len(self.outputs), self.max_new), pad_token, np.int32)
        for b, out in enumerate(self.outputs):
            tokens[b, :len(out)] = out
        return tokens, np.array([len(out) for out in self.outputs], np.int32)


def check_proposer(proposer, config: ModelConfig) -> int:
    """The proposer's k; a TypeError for something that is not a proposer, a ValueError for a draft model of
    another vocabulary or a k below 1."""
    if not all(callable(getattr(proposer, name, None)) for name in ("propose", "begin")):
        raise TypeError(f"proposer must be a jaxattn.speculative proposer (NgramProposer, DraftProposer), "
                        f"got {type(proposer).__name__}")
    k = getattr(proposer, "k", None)
    if not is_int(k) or k < 1:
        raise ValueError(f"proposer.k must be a positive int, got {k!r}")
    vocab = getattr(proposer, "vocab_size", None)
    if vocab is not None and vocab != config.vocab_size:
        raise ValueError(f"proposer's vocabulary ({vocab}) must be the target's, config.vocab_size={config.vocab_size}")
    return int(k)


def _drafts(proposer, rows: _Rows, k: int, stats: SpeculativeStats) -> Proposal:
    """The proposer's drafts `[B, k]`, each row's count capped by its room (0 for finished rows)."""
    if k == 0:
        return Proposal.from_rows([np.zeros((0,), np.int32)] * len(rows.outputs), 0)
    start = time.perf_counter()
    proposal = proposer.propose(rows.histories, k)
    stats.draft_seconds += time.perf_counter() - start
    tokens = np.asarray(proposal.tokens, np.int32)
    if tokens.ndim != 2 or tokens.shape[0] != len(rows.outputs) or tokens.shape[1] > k:
        raise ValueError(f"the proposer returned drafts of shape {tokens.shape}, not [B={len(rows.outputs)}, <= {k}]")
    tokens = np.pad(tokens, ((0, 0), (0, k - tokens.shape[1])))
    return Proposal(tokens=tokens, num=np.minimum(np.asarray(proposal.num, np.int32), rows.room()))


def _step(target, cache, rows: _Rows, proposer, k: int, stats: SpeculativeStats, step: int):
    """One propose-verify-emit step; returns the cache and (proposed, accepted), the most of any row."""
    params, knobs, rng, config, kernels, sampled = target
    proposal = _drafts(proposer, rows, k, stats)
    # Shorter drafts than k (no n-gram match, the end of a repeat) run a narrower program: 0, 1, 2, 4, ... up to k.
    most = int(np.where(rows.done, 0, proposal.num).max())
    width = 0 if most == 0 else min(k, 1 << (most - 1).bit_length())
    proposal = Proposal(tokens=proposal.tokens[:, :width], num=np.minimum(proposal.num, width))
    last = np.array([h[-1] for h in rows.histories], np.int32)
    tokens = np.concatenate([last[:, None], proposal.tokens], axis=1)  # [B, k+1]
    active = ~rows.done
    accepted, next_token, cache = verify_step(params, cache, jnp.asarray(tokens), jnp.asarray(proposal.num),
                                              jnp.asarray(active), rng, jnp.int32(step), knobs, config=config,
                                              kernels=kernels, sampled=sampled)
    accepted, next_token = np.asarray(accepted), np.asarray(next_token)
    num = np.where(active, proposal.num, 0)
    stats.record(width, num, np.where(active, accepted, 0))
    for b in np.flatnonzero(active):
        rows.emit(b, [*proposal.tokens[b, :accepted[b]], next_token[b]])
    return cache, (int(num.max()), int(np.where(active, accepted, 0).max()))


def _plain(target, cache, rows: _Rows, steps: int, stats: SpeculativeStats):
    """`steps` plain decoding steps in one program (`plain_steps`), emitted as a step each would; the cache."""
    params, knobs, rng, config, kernels, sampled = target
    last = np.array([h[-1] for h in rows.histories], np.int32)
    active = ~rows.done
    tokens, cache = plain_steps(params, cache, jnp.asarray(last), jnp.asarray(active), rng, jnp.int32(stats.steps),
                                knobs, config=config, kernels=kernels, steps=steps, sampled=sampled)
    tokens = np.asarray(tokens)
    for _ in range(steps):
        stats.record(0, np.zeros(len(last), np.int32), np.zeros(len(last), np.int32))
    for b in np.flatnonzero(active):
        rows.emit(b, tokens[b])
    return cache


def _prefill(params, config, kernels, tokens, lengths, max_new_tokens: int, k_max: int, key, knobs, pad_token: int,
             kv_cache: str):
    """The prompts padded to `generate`'s bucket into a cache with room for k drafts past the output (within
    the context); `(cache length, first tokens [B] numpy, cache)`."""
    bucket, _ = call_lengths(config, int(lengths.max()), max_new_tokens)
    cache_len = min(bucket + max_new_tokens + k_max, config.max_seq_len)
    padded = np.full((tokens.shape[0], bucket), pad_token, np.int32)
    padded[:, :min(bucket, tokens.shape[1])] = tokens[:, :bucket]
    first, cache = prefill(params, jnp.asarray(padded), jnp.asarray(lengths), key, knobs, config=config,
                           kernels=kernels, cache_len=cache_len, kv_cache=kv_cache)
    return cache_len, np.asarray(first), cache


def _decode(target, cache, cache_len: int, rows: _Rows, proposer, schedule: AdaptiveK, stats: SpeculativeStats):
    """Steps until every row is done, each one timed into `schedule.costs` (what a step of each width costs)."""
    costs, batch = schedule.costs, len(rows.histories)
    schedule.for_rows(batch)
    runs = set()
    while not rows.done.all():
        # k drafts write k + 1 slots from each row's cache length (its history less the pending token).
        fits = cache_len - max(len(h) for h in rows.histories)
        # k is not cut to the rows' room near the end (their drafts are): one program width serves the tail.
        k = 0 if schedule.adaptive and costs.wants_plain(batch) else max(0, min(schedule.k, fits))
        run = schedule.plain_run
        started = time.perf_counter()
        if 1 < run <= min(fits, int(rows.room().max()) + 1):  # k = 0: the steps to the next probe in one program
            cache = _plain(target, cache, rows, run, stats)
            if run in runs:  # a run of a new length compiled its program: not a step's cost
                costs.observe(batch, 0, (time.perf_counter() - started) / run)
            runs.add(run)
            schedule.update(0, 0, steps=run)
            continue
        cache, (proposed, accepted) = _step(target, cache, rows, proposer, k, stats, stats.steps)
        costs.observe(batch, proposed, time.perf_counter() - started)
        schedule.update(proposed, accepted)


def speculative_generate(params, config: ModelConfig, prompt_tokens, prompt_lengths=None, *, max_new_tokens: int,
                         rng: jax.Array, proposer, temperature=1.0, top_k=0, top_p=1.0, stop_token: int | None = None,
                         pad_token: int = 0, kernels: Kernels | None = None, kv_cache: str = "auto",
                         adaptive: bool = True, probe_after: int = 16) -> SpeculativeOutput:
    """Generates `max_new_tokens` tokens after each prompt, the target verifying drafted tokens in one pass.

    Args:
      params, config, prompt_tokens, max_new_tokens, rng, temperature, top_k, top_p, stop_token,
        pad_token, kernels, kv_cache: as `jaxattn.generate`'s (the same checks, the same errors).
      prompt_lengths: `[B]` real tokens per prompt; None: every row's full width.
      proposer: a `NgramProposer` or `DraftProposer` (`jaxattn.speculative.proposal.Proposer`); its `k`
        is the most drafts per step.
      adaptive: let k follow the acceptance (`jaxattn.speculative.schedule.AdaptiveK`); False: always
        the proposer's k (capped near the end).
      probe_after: plain steps at k = 0 before drafting again.

    Returns:
      `SpeculativeOutput(tokens [B, max_new_tokens], counts [B], stats)`.
    """
    if kv_cache not in KV_CACHES:
        raise ValueError(f"kv_cache must be one of {KV_CACHES}, got {kv_cache!r}")
    k_max = check_proposer(proposer, config)
    # This call's steps are timed into its costs: what drafting costs here.
    schedule = AdaptiveK(k_max, probe_after=probe_after, adaptive=bool(adaptive), costs=DraftCosts(widths(k_max)))
    kernels, params = call_kernels(params, kernels)
    if prompt_lengths is None:
        shape = np.shape(prompt_tokens)
        prompt_lengths = np.full(shape[:1], shape[-1] if len(shape) == 2 else 0, np.int32)
    tokens, lengths = validated_arguments(config, kernels, prompt_tokens, prompt_lengths, max_new_tokens,
                                          temperature, top_k, top_p, stop_token, pad_token)
    knobs = SamplingKnobs(temperature=jnp.float32(temperature), top_k=jnp.int32(top_k), top_p=jnp.float32(top_p),
                          stop_token=jnp.int32(-1 if stop_token is None else stop_token),
                          pad_token=jnp.int32(pad_token))
    first_key, rng = jax.random.split(rng)
    cache_len, first, cache = _prefill(params, config, kernels, tokens, lengths, max_new_tokens, k_max, first_key,
                                       knobs, pad_token, kv_cache)
    rows = _Rows(tokens, lengths, max_new_tokens, stop_token)
    for b, token in enumerate(first):
        rows.emit(b, [token])
    proposer.begin(tokens.shape[0], cache_len)
    # Greedy calls compile the exact-match rule alone (a temperature of 0 is known here, on the host).
    target = (params, knobs, rng, config, kernels, bool(np.any(np.asarray(temperature) > 0)))
    stats = SpeculativeStats.empty(k_max)
    _decode(target, cache, cache_len, rows, proposer, schedule, stats)
    return SpeculativeOutput(*rows.result(pad_token), stats=stats)
