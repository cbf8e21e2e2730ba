"""Several decode steps in one program call: the host learns the tokens once per call, not once per token.

When every running row only decodes (no prompt chunk, no guided row, nobody waiting to be admitted),
the engine runs up to k steps in one program (`DecodeRunPrograms`, one per decode bucket), a
`jax.lax.while_loop` on the device whose every turn is one engine step: the paged forward of each row's
last token (`jaxattn.serving.step.step_forward`), then its draw (`step_sample`: masks, bias, penalties,
temperature, min-p, top-k, top-p, log-probabilities), the drawn token fed to the next turn. JetStream
runs its decode steps the same way; vLLM's multi-step scheduling did too.

What the device decides, and what stays the host's:

* each row stops drawing at one of its stop tokens (`DecodeRun.stop_ids`), at its last allowed token
  (`remaining`: what `max_tokens` and the context leave) or at logits that are not finite; from then on it
  is padding: its slot is past the pool (nothing written) and it attends nothing;
* the loop ends after `steps` turns, or as soon as no row is drawing;
* the host hands the tokens to the requests in order (`Scheduler.update`), and its checks are the ones
  that count: a stop string (text the device never sees) ends a request there, and the tokens the row
  drew after it are dropped, as are the tokens of a request cancelled during the call.

Nothing changes a token: turn j of a row is the step it would have had alone, with the same inputs
(its token, position, slot, block table, knobs and LoRA slot, the drawn token's position `knobs.position + j`
keying a seeded draw), so greedy and seeded tokens are those of one step at a time. The scheduler
reserves each row's pages for the turns it may take before the call
(`jaxattn.serving.scheduler.Scheduler.schedule`).
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
from typing import NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxattn import program_store
from jaxattn.cache.containers import PagedBatch, RowGroup
from jaxattn.config import ModelConfig
from jaxattn.kernels import Kernels
from jaxattn.model import DecoderLM
from jaxattn.serving.step import DrawKnobs, step_forward, step_sample
from jaxattn.serving.validation import MAX_LOGPROBS

# Stop tokens the device checks per row; a request with more is still stopped by the host at the first.
MAX_STOP_IDS = 8


@flax.struct.dataclass
class DecodeRun:
    """A call of up to `steps` decode steps over `M` rows (a decode bucket); padding rows have `remaining` 0.

    Attributes:
      tokens: `[M]` int32 each row's last token (the first turn's input).
      positions: `[M]` int32 its position (turn j computes `positions + j`).
      block_table: `[M, pages_per_seq]` int32 the row's pages, those of its turns ahead included.
      knobs: the draws' knobs (`position` the first drawn token's).
      stop_ids: `[M, MAX_STOP_IDS]` int32 tokens that end the row (-1: none).
      remaining: `[M]` int32 the most tokens the row may draw in this call.
      logprobs: `[M]` bool the row's draws' log-probabilities are asked.
      steps: `[]` int32 the most turns.
      token_slots: `[M]` int32 the row's LoRA slot (-1: none), with slots in the parameters; else None.
    """

    tokens: jax.Array
    positions: jax.Array
    block_table: jax.Array
    knobs: DrawKnobs
    stop_ids: jax.Array
    remaining: jax.Array
    logprobs: jax.Array
    steps: jax.Array
    token_slots: jax.Array | None = None

    @staticmethod
    def empty(rows: int, pages_per_seq: int, vocab_size: int, lora: bool = False) -> "DecodeRun":
        """Host arrays of a call of padding rows only (nothing drawn, nothing written; with `lora`, every
        row's slot -1)."""
        return DecodeRun(tokens=np.zeros(rows, np.int32), positions=np.zeros(rows, np.int32),
                         block_table=np.zeros((rows, pages_per_seq), np.int32),
                         knobs=DrawKnobs.empty(rows, vocab_size),
                         stop_ids=np.full((rows, MAX_STOP_IDS), -1, np.int32), remaining=np.zeros(rows, np.int32),
                         logprobs=np.zeros(rows, bool), steps=np.int32(1),
                         token_slots=np.full(rows, -1, np.int32) if lora else None)


class RunOut(NamedTuple):
    """What a call drew, on the device: turn j's row r at `[j, r]`; `turns` the turns run."""

    tokens: jax.Array  # [k, M] int32
    finite: jax.Array  # [k, M] bool
    logprob: jax.Array  # [k, M] float32
    top_ids: jax.Array  # [k, M, K] int32
    top: jax.Array  # [k, M, K] float32
    turns: jax.Array  # [] int32


def _turn_batch(run: DecodeRun, turn, drawing, page_size: int, num_slots: int) -> PagedBatch:
    """Turn `turn`'s paged batch: one token per row at `positions + turn`; rows not drawing are padding."""
    positions = run.positions + turn
    pages = jnp.take_along_axis(run.block_table, jnp.maximum(positions // page_size, 0)[:, None], axis=1)[:, 0]
    slots = jnp.where(drawing, pages * page_size + positions % page_size, num_slots)
    group = RowGroup(positions=jnp.where(drawing, positions, -1)[:, None], block_table=run.block_table)
    return PagedBatch(positions=jnp.where(drawing, positions, 0), slots=slots, groups=(group,),
                      logit_tokens=jnp.arange(positions.shape[0], dtype=jnp.int32))


def _decode_run(params, pools, history, run: DecodeRun, *, model: DecoderLM, max_steps: int, page_size: int,
                num_slots: int):
    """The program: up to `run.steps` (at most `max_steps`) turns of forward then draw -> `(pools, history,
    RunOut)`."""
    rows = run.tokens.shape[0]
    k = min(MAX_LOGPROBS, model.config.vocab_size)
    no_prompt = jnp.zeros((0, 1), jnp.int32)

    def turn(carry):
        j, pools, history, tokens, drawing, out = carry
        batch = _turn_batch(run, j, drawing, page_size, num_slots)
        pools, history, raw, _ = step_forward(params, pools, history, tokens, batch, no_prompt, run.token_slots,
                                              model=model)
        knobs = run.knobs.replace(position=run.knobs.position + j)
        drawn, finite, (logprob, top_ids, top) = step_sample(raw, history, knobs, (run.block_table,),
                                                         run.logprobs & drawing)
        drawn = jnp.where(drawing, drawn, -1)
        out = tuple(o.at[j].set(v) for o, v in zip(out, (drawn, finite & drawing, logprob, top_ids, top)))
        stopped = jnp.any(drawn[:, None] == run.stop_ids, axis=1) | (j + 1 >= run.remaining) | ~finite
        return j + 1, pools, history, jnp.maximum(drawn, 0), drawing & ~stopped, out

    def more(carry):
        j, *_, drawing, _ = carry
        return (j < jnp.minimum(run.steps, max_steps)) & jnp.any(drawing)

    out = (jnp.full((max_steps, rows), -1, jnp.int32), jnp.zeros((max_steps, rows), bool),
           jnp.zeros((max_steps, rows), jnp.float32), jnp.zeros((max_steps, rows, k), jnp.int32),
           jnp.zeros((max_steps, rows, k), jnp.float32))
    start = (jnp.int32(0), pools, history, run.tokens, run.remaining > 0, out)
    turns, pools, history, _, _, out = jax.lax.while_loop(more, turn, start)
    return pools, history, RunOut(*out, turns)


class DecodeRunPrograms:
    """One compiled multi-step decode program per decode bucket (ahead of time, as `StepPrograms`; the
    pools and the history donated), each running up to `max_steps` turns a call."""

    def __init__(self, config: ModelConfig, kernels: Kernels, params, pools, history, buckets, *, max_steps: int,
                 page_size: int, pages_per_seq: int, num_slots: int, place=lambda tree: tree,
                 threads: int | None = None, store: program_store.ProgramStore | None = None, lora: bool = False):
        store = program_store.default_store() if store is None else store
        self.max_steps, self._place = max_steps, place
        program = functools.partial(_decode_run, model=DecoderLM(config, kernels), max_steps=max_steps,
                                    page_size=page_size, num_slots=num_slots)
        context = f"{config!r} {kernels!r} steps={max_steps} page={page_size} slots={num_slots}"

        def compile_rows(rows: int):
            args = (params, pools, history, place(DecodeRun.empty(rows, pages_per_seq, config.vocab_size, lora)))
            return rows, store.program("serving-decode-run", context, program, args,
                                       donate_argnums=(1, 2)).lower(*args).compile()

        with concurrent.futures.ThreadPoolExecutor(threads or os.cpu_count() or 1) as pool:
            self.programs = dict(pool.map(compile_rows, buckets))

    def run(self, rows: int, params, pools, history, run: DecodeRun):
        """Dispatches bucket `rows`' program -> `(pools, history, RunOut)`, on the device, before it ends."""
        return self.programs[rows](params, pools, history, self._place(run))
