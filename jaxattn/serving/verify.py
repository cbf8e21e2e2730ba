"""The engine's speculative step: each decode row's last token and its drafts in one forward pass over the
paged cache, the drafts accepted on the device (docs/speculative.md §"In the engine").

A verification step has R rows of W tokens (`widths`: 2, 3, 5, ... up to k_max + 1, the counts of drafts
an adaptive k takes, so a step of short drafts computes no padding of long ones): row r holds its sequence's last token (at
position `num_computed`), then its d_r <= k_max drafts (`jaxattn.serving.speculation`), then padding.
The forward is the plain step's (`jaxattn.serving.step.step_forward`) with logits after every one of the
R * W tokens. At each position j of a row, the draw is the one a plain step would make there had the
drafts before j been drawn: the same knobs (bias, penalties read from the history the forward wrote,
temperature, min-p, top-k, top-p) and the same key, `fold_in(PRNGKey(seed), position)`:

* a greedy row keeps draft j while it equals the argmax, so its tokens are greedy decoding's;
* a sampled row keeps draft j with probability p_j(x_j) (a drafted token is a point mass q: prompt
  lookup's); at the first rejection its token is drawn from p_j without x_j, renormalised, which is
  Leviathan et al.'s max(0, p - q); after every draft kept, the bonus token is p at d_r's own draw.
  Each emitted token is distributed as a plain draw (its exact value is not a plain run's);
* a row without drafts (d_r = 0) draws exactly what a plain step draws.

A row emits `accepted + 1` tokens. The slots past them hold rejected drafts' keys and values that no
query sees (a query at position p sees slots 0..p: `jaxattn.kernels.paged`) and the next step writes
over: rolling the cache back is not advancing the request's `num_computed` past what it emitted.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxattn import program_store
from jaxattn.cache.containers import PagedBatch, RowGroup
from jaxattn.config import ModelConfig
from jaxattn.kernels import Kernels
from jaxattn.model import DecoderLM
from jaxattn.serving import logit_knobs
from jaxattn.serving.logit_knobs import fill_draw_knobs
from jaxattn.serving.requests import Request
from jaxattn.serving.step import DrawKnobs, Logprobs, adjusted, draw_keys, drawn_logprobs, filtered, step_forward
from jaxattn.speculative.acceptance import leading_true
from jaxattn.speculative.schedule import widths


@flax.struct.dataclass
class VerifyInputs:
    """A verification step's arrays besides the parameters and the pools (R rows of W tokens, M = R * W)."""

    tokens: jax.Array  # [M] int32: row r's last token, its drafts, padding
    batch: PagedBatch  # one group [R, W]; logits after every token
    knobs: DrawKnobs  # [M]: position j of row r draws the token after its j-th draft
    drafts: jax.Array  # [R, W] int32: row r's drafts, -1 past them (column W - 1 always -1)
    num_drafts: jax.Array  # [R] int32
    logprobs_asked: jax.Array  # [M] bool
    token_slots: jax.Array | None = None  # [M] int32 each token's LoRA slot; None: no slots

    @staticmethod
    def empty(rows: int, width: int, pages_per_seq: int, num_slots: int, vocab_size: int,
              lora: bool = False) -> "VerifyInputs":
        """Host arrays of padding alone: nothing written, nothing visible, nothing drafted."""
        M = rows * width
        group = RowGroup(positions=np.full((rows, width), -1, np.int32),
                         block_table=np.zeros((rows, pages_per_seq), np.int32))
        batch = PagedBatch(positions=np.zeros(M, np.int32), slots=np.full(M, num_slots, np.int32), groups=(group,),
                           logit_tokens=np.arange(M, dtype=np.int32))
        return VerifyInputs(tokens=np.zeros(M, np.int32), batch=batch, knobs=DrawKnobs.empty(M, vocab_size),
                            drafts=np.full((rows, width), -1, np.int32), num_drafts=np.zeros(rows, np.int32),
                            logprobs_asked=np.zeros(M, bool), token_slots=np.full(M, -1, np.int32) if lora else None)


def verify_inputs(requests: list[Request], drafts: list[np.ndarray], rows: int, width: int, *, page_size: int,
                  pages_per_seq: int, num_slots: int, vocab_size: int, lora: bool) -> VerifyInputs:
    """A verification step's host arrays: request i in row i, its last token at `num_computed` and then
    `drafts[i]` (at most `width - 1`; its pages hold their slots: `KVCacheManager.reserve`)."""
    inputs = VerifyInputs.empty(rows, width, pages_per_seq, num_slots, vocab_size, lora)
    group, draws = inputs.batch.groups[0], []
    for row, (request, draft) in enumerate(zip(requests, drafts)):
        start, count, first = request.num_computed, len(draft) + 1, row * width
        positions, flat = start + np.arange(count), first + np.arange(count)
        pages = np.asarray(request.pages)
        inputs.tokens[first], inputs.tokens[first + 1:first + count] = request.token_at(start), draft
        inputs.batch.positions[flat] = group.positions[row, :count] = positions
        inputs.batch.slots[flat] = pages[positions // page_size] * page_size + positions % page_size
        group.block_table[row, :len(pages)] = np.maximum(pages, 0)  # pages given back: never visible again
        inputs.drafts[row, :len(draft)], inputs.num_drafts[row] = draft, len(draft)
        if inputs.token_slots is not None:
            inputs.token_slots[flat] = request.lora_slot
        inputs.logprobs_asked[first:first + width] = request.sampling.logprobs is not None or request.wants_logprob
        draws += range(first, first + width)
    fill_draw_knobs(inputs.knobs, draws, [request for request in requests for _ in range(width)])
    inputs.knobs.position[draws] += np.tile(np.arange(width, dtype=np.int32), len(requests))
    return inputs


def accept_drafts(logits, knobs: DrawKnobs, drafts, num_drafts):
    """`[M, V]` float32 logits (biased and penalised), `drafts [R, W]`, `num_drafts [R]` -> `(tokens [R, W],
    accepted [R])`: row r emits `tokens[r, :accepted[r] + 1]` (see the module docstring)."""
    R, W = drafts.shape
    x = drafts.reshape(-1)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def sampled(logits):
        allowed = filtered(logits, knobs)
        keys = draw_keys(knobs)
        p_x = jnp.take_along_axis(jax.nn.softmax(allowed, axis=-1), jnp.maximum(x, 0)[:, None], axis=-1)[:, 0]
        u = jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, 1)))(keys)
        own = jax.vmap(jax.random.categorical)(keys, allowed).astype(jnp.int32)  # the plain step's draw
        without_x = jnp.where(jnp.arange(allowed.shape[-1])[None, :] == x[:, None], -jnp.inf, allowed)
        residual = jax.vmap(lambda key, row: jax.random.categorical(jax.random.fold_in(key, 2), row))(
            keys, without_x).astype(jnp.int32)
        t = knobs.temperature > 0
        return (jnp.where(t, u < jnp.where(x >= 0, p_x, 0.0), x == greedy), jnp.where(t, residual, greedy),
                jnp.where(t, own, greedy))

    keep, rejected, own = jax.lax.cond(jnp.any(knobs.temperature > 0), sampled,
                                       lambda _: (x == greedy, greedy, greedy), logits)
    column = jnp.arange(W)[None, :]
    accepted = leading_true(keep.reshape(R, W) & (column < num_drafts[:, None]))
    after = jnp.where(column < num_drafts[:, None], rejected.reshape(R, W), own.reshape(R, W))
    return jnp.where(column < accepted[:, None], drafts, after), accepted


def verify_sample(raw, history, knobs: DrawKnobs, drafts, num_drafts, block_table, logprobs_asked):
    """The verification's second program: `raw [M, V]` logits -> `(tokens [R, W], accepted [R], finite [M],
    the emitted tokens' log-probabilities [M])`. No row of a verification step is guided."""
    W = drafts.shape[1]
    finite = jnp.isfinite(jnp.max(raw, axis=-1))
    tables = jnp.repeat(block_table, W, axis=0)  # [M, pages]: each position reads its row's sequence
    logits = adjusted(raw, knobs, lambda: logit_knobs.sequence_tokens(history, tables))
    tokens, accepted = accept_drafts(logits, knobs, drafts, num_drafts)
    return tokens, accepted, finite, drawn_logprobs(raw, tokens.reshape(-1), logprobs_asked)


def _forward_args(inputs: VerifyInputs) -> tuple:
    no_prompt = np.full((0, inputs.drafts.shape[1]), -1, np.int32)  # nothing scores a prompt here
    slots = () if inputs.token_slots is None else (inputs.token_slots,)
    return inputs.tokens, inputs.batch, no_prompt, *slots


def _sample_args(inputs: VerifyInputs) -> tuple:
    return (inputs.knobs, inputs.drafts, inputs.num_drafts, inputs.batch.groups[0].block_table,
            inputs.logprobs_asked)


class VerifyPrograms:
    """The verification step's two programs per decode bucket of rows and width (`widths(k)`), compiled here
    (as `jaxattn.serving.step.StepPrograms`: traced or read back from `store`, compiled on `threads` threads)."""

    def __init__(self, config: ModelConfig, kernels: Kernels, params, pools, history, rows: tuple[int, ...],
                 k: int, *, pages_per_seq: int, num_slots: int, place=lambda tree: tree,
                 store: program_store.ProgramStore | None = None, lora: bool = False, threads: int | None = None):
        self.widths, self.place = widths(k), place
        store = program_store.default_store() if store is None else store
        forward, context = functools.partial(step_forward, model=DecoderLM(config, kernels)), f"{config!r} {kernels!r}"
        empty = {(r, w): VerifyInputs.empty(r, w, pages_per_seq, num_slots, config.vocab_size, lora)
                 for r in rows for w in self.widths}

        def compile_shape(shape, lowered):
            compiled = lowered.compile()
            _, history_out, raw, _ = compiled.out_info
            args = (raw, history_out, *place(_sample_args(empty[shape])))
            return shape, compiled, store.program("serving-verify", "", verify_sample, args).lower(*args).compile()

        self.programs, self.samplers = {}, {}
        with concurrent.futures.ThreadPoolExecutor(threads or os.cpu_count() or 1) as pool:
            futures = []
            for shape, inputs in empty.items():
                args = (params, pools, history, *place(_forward_args(inputs)))
                lowered = store.program("serving-forward", context, forward, args, donate_argnums=(1, 2)).lower(*args)
                futures.append(pool.submit(compile_shape, shape, lowered))
            for future in concurrent.futures.as_completed(futures):
                shape, self.programs[shape], self.samplers[shape] = future.result()

    def shape(self, rows: int, most_drafts: int) -> tuple[int, int]:
        """The smallest compiled (rows, width) that holds `rows` rows of up to `most_drafts` drafts."""
        return min(shape for shape in self.programs if shape[0] >= rows and shape[1] > most_drafts)

    def run(self, params, pools, history, inputs: VerifyInputs):
        """Dispatches a verification (its rows and width a compiled shape) -> `(pools, history, tokens [R, W],
        accepted [R], finite [M], Logprobs)`, all on the device, returned before the programs end."""
        shape = inputs.drafts.shape
        pools, history, raw, _ = self.programs[shape](params, pools, history, *self.place(_forward_args(inputs)))
        tokens, accepted, finite, drawn = self.samplers[shape](raw, history, *self.place(_sample_args(inputs)))
        none = jnp.zeros((0,), jnp.float32)
        return pools, history, tokens, accepted, finite, Logprobs(*drawn, none, none, none)
