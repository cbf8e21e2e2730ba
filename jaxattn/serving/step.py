"""The engine's step, compiled once per shape bucket as two programs: a paged forward, then the draws.

A step is a flat run of tokens from many sequences (`jaxattn.cache.containers.PagedBatch`), in two groups
of rows: `decode_rows` rows of one token (a sequence's last token, whose next one is drawn) and
`prefill_rows` rows of up to `chunk` tokens (a piece of a prompt, or of a preempted sequence
being recomputed). The weights are read once for all of them; attention reads each row's own
pages. Logits are computed only for the tokens a draw follows (`PagedBatch.logit_tokens`).

Before the draw, a row's logits may be biased and penalised, and after the temperature filtered by
min-p (`jaxattn.serving.logit_knobs`, vLLM's order), each only when some row asks. The penalties read
each row's tokens from `history`, one int32 per slot of the pool, written by every step beside the
keys and values.

Each draw's randomness depends on the request's seed and the position of the drawn token
only (`jax.random.fold_in(PRNGKey(seed), position)`), never on what else shares the step, so a
seeded request gives the same tokens whatever runs beside it.

Log-probabilities, for the rows that ask (`LogprobKnobs`): the drawn token's and the top
`MAX_LOGPROBS` of each drawn row, and, for prefill tokens, the next prompt token's and the top
there (prompt log-probabilities: the head then runs on every prefill token, one row of `chunk`
tokens at a time). Both are the model's raw log-softmax in float32, before temperature or any
filter; each runs under a `jax.lax.cond` on "some row asks", so a step where none asks computes
neither, and they stay on the device for whoever reads them (`StepPrograms.sample`).

The forward needs nothing of the draws, and the draws' program is small: between the two the host
fills the guided rows' masks (`StepPrograms.forward`, then `.sample`) while the device runs the forward,
so a mask costs the step nothing while it takes less than the forward.

With LoRA slots in the parameters (`jaxattn.serving.loras`), each flat token carries its row's slot
(`StepInputs.token_slots`, -1 for none and for padding), set on every slotted weight at the start of
the forward (`jaxattn.lora.with_token_slots`): an input like the tokens, so which adapters a step's rows
run, and what the slots hold, compile nothing. Without slots it is None and the programs are as before.

Shapes are static per bucket (`StepShape`); `StepInputs.empty` is a step of padding alone, used
to compile every bucket at start-up (`StepPrograms`), so no request ever waits for a compile.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
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
from jaxattn.lora import with_token_slots
from jaxattn.model import DecoderLM
from jaxattn.sampling import filter_logits
from jaxattn.serving import logit_knobs
from jaxattn.serving.validation import MAX_LOGPROBS


@dataclasses.dataclass(frozen=True, order=True)
class StepShape:
    """One bucket: `decode_rows` rows of 1 token and `prefill_rows` rows of `chunk` tokens."""

    decode_rows: int
    prefill_rows: int
    chunk: int

    @property
    def num_tokens(self) -> int:
        """Tf, the flat tokens of a step (padding included)."""
        return self.decode_rows + self.prefill_rows * self.chunk

    @property
    def num_draws(self) -> int:
        """M, one logit row per row."""
        return self.decode_rows + self.prefill_rows


@flax.struct.dataclass
class DrawKnobs:
    """Per drawn row: `[M]` arrays (the bias `[M, MAX_LOGIT_BIAS]`). temperature 0 = greedy; top_k <= 0,
    top_p >= 1, min_p 0, penalties 0 (repetition 1) and bias padding (`logit_knobs.NO_TOKEN`) are off."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    seed: jax.Array  # int32
    position: jax.Array  # int32, the drawn token's position in its sequence
    presence: jax.Array
    frequency: jax.Array
    repetition: jax.Array
    min_p: jax.Array
    prompt_len: jax.Array  # int32: the tokens after it were drawn (the presence and frequency counts)
    bias_ids: jax.Array  # [M, MAX_LOGIT_BIAS] int32
    bias_values: jax.Array  # [M, MAX_LOGIT_BIAS] float32
    guided: jax.Array  # bool, the row's tokens are constrained by `mask`
    mask: jax.Array  # [M, ceil(V/32)] int32: bit i % 32 of word i // 32 set = token i allowed (guided rows)

    @staticmethod
    def empty(rows: int, vocab_size: int) -> "DrawKnobs":
        """Host arrays of `rows` rows with every knob off (greedy, nothing guided, every token allowed)."""
        return DrawKnobs(temperature=np.zeros(rows, np.float32), top_k=np.zeros(rows, np.int32),
                         top_p=np.ones(rows, np.float32), seed=np.zeros(rows, np.int32),
                         position=np.zeros(rows, np.int32), guided=np.zeros(rows, bool),
                         mask=np.full((rows, -(-vocab_size // 32)), -1, np.int32), **logit_knobs.empty_knobs(rows))


@flax.struct.dataclass
class LogprobKnobs:
    """Which log-probabilities a step computes: per drawn row, and per prefill token."""

    drawn: jax.Array  # [M] bool: the drawn token's log-probability and the top ones
    prompt_targets: jax.Array  # [prefill_rows, chunk] int32: the prompt token after each prefill token (-1: none)

    @staticmethod
    def empty(shape: StepShape) -> "LogprobKnobs":
        return LogprobKnobs(drawn=np.zeros(shape.num_draws, bool),
                            prompt_targets=np.full((shape.prefill_rows, shape.chunk), -1, np.int32))


@flax.struct.dataclass
class Logprobs:
    """A step's log-probabilities, on the device (zeros where nobody asked): of each drawn row's token
    `[M]` and its top `[M, K]` (ids and values, the most likely first), and of each prefill token's
    next prompt token `[prefill_rows, chunk]` and the top there `[prefill_rows, chunk, K]`."""

    drawn: jax.Array
    drawn_top_ids: jax.Array
    drawn_top: jax.Array
    prompt: jax.Array
    prompt_top_ids: jax.Array
    prompt_top: jax.Array


@flax.struct.dataclass
class StepInputs:
    """Everything a step's program takes besides the parameters and the pools."""

    tokens: jax.Array  # [Tf] int32
    batch: PagedBatch
    knobs: DrawKnobs
    logprobs: LogprobKnobs
    token_slots: jax.Array | None = None  # [Tf] int32 each token's LoRA slot (-1: none); None: no slots

    @staticmethod
    def empty(shape: StepShape, pages_per_seq: int, num_slots: int, vocab_size: int,
              lora: bool = False) -> "StepInputs":
        """Host arrays of a step of padding only (nothing written, nothing visible, nothing guided; with
        `lora`, every token's slot -1)."""
        Tf, M = shape.num_tokens, shape.num_draws
        groups = tuple(RowGroup(positions=np.full((rows, width), -1, np.int32),
                                block_table=np.zeros((rows, pages_per_seq), np.int32))
                       for rows, width in ((shape.decode_rows, 1), (shape.prefill_rows, shape.chunk)) if rows)
        batch = PagedBatch(positions=np.zeros(Tf, np.int32), slots=np.full(Tf, num_slots, np.int32),
                           groups=groups, logit_tokens=np.zeros(M, np.int32))
        return StepInputs(tokens=np.zeros(Tf, np.int32), batch=batch, knobs=DrawKnobs.empty(M, vocab_size),
                          logprobs=LogprobKnobs.empty(shape), token_slots=np.full(Tf, -1, np.int32) if lora else None)


def adjusted(logits, knobs: DrawKnobs, tokens):
    """The raw `[M, V]` logits biased, then penalised (`tokens`: `[M, L]` each row's tokens by position,
    a thunk, read only when a row is penalised); each only when some row asks."""
    logits = jax.lax.cond(jnp.any(knobs.bias_ids != logit_knobs.NO_TOKEN),
                          lambda x: logit_knobs.apply_logit_bias(x, knobs.bias_ids, knobs.bias_values),
                          lambda x: x, logits)
    penalised = (knobs.presence != 0) | (knobs.frequency != 0) | (knobs.repetition != 1)
    return jax.lax.cond(jnp.any(penalised), lambda x: logit_knobs.apply_penalties(
        x, tokens(), knobs.position, knobs.prompt_len, knobs.presence, knobs.frequency, knobs.repetition),
        lambda x: x, logits)


def filtered(logits, knobs: DrawKnobs):
    """`[M, V]` float32 logits (already biased and penalised) -> what a sampled row draws from: after the
    temperature, min-p, top-k and top-p (each filtered token at -inf). The sorting top-k/top-p need, and
    min-p's softmax, run only when some row asks for them."""
    t = knobs.temperature
    scaled = logits / jnp.where(t > 0, t, 1.0)[:, None]
    scaled = jax.lax.cond(jnp.any(knobs.min_p > 0), lambda x: logit_knobs.apply_min_p(x, knobs.min_p),
                          lambda x: x, scaled)
    return jax.lax.cond(
        jnp.any((knobs.top_k > 0) | (knobs.top_p < 1.0)),
        lambda x: jax.vmap(lambda row, k, p: filter_logits(row[None], top_k=k, top_p=p)[0])(
            x, knobs.top_k, knobs.top_p),
        lambda x: x, scaled)


def draw_keys(knobs: DrawKnobs):
    """`[M]` PRNG keys of the draws: `fold_in(PRNGKey(seed), position)`, nothing else."""
    return jax.vmap(lambda seed, position: jax.random.fold_in(jax.random.PRNGKey(seed), position))(
        knobs.seed, knobs.position)


def draw(logits, knobs: DrawKnobs):
    """`[M, V]` float32 logits (already biased and penalised) -> `[M]` int32 tokens: greedy where
    temperature is 0, else a draw keyed by (seed, position) from the `filtered` logits."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def sampled(logits):
        drawn = jax.vmap(lambda key, row: jax.random.categorical(key, row))(
            draw_keys(knobs), filtered(logits, knobs)).astype(jnp.int32)
        return jnp.where(knobs.temperature > 0, drawn, greedy)

    return jax.lax.cond(jnp.any(knobs.temperature > 0), sampled, lambda _: greedy, logits)


def apply_masks(logits, knobs: DrawKnobs):
    """`[M, V]` logits with each guided row's refused tokens at -inf (`knobs.mask`, one bit per token);
    the unpacking runs only when some row is guided."""

    def masked(logits):
        M, V = logits.shape
        bits = (knobs.mask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)[None, None, :]) & 1  # [M, W, 32]
        allowed = bits.reshape(M, -1)[:, :V].astype(bool) | ~knobs.guided[:, None]
        return jnp.where(allowed, logits, -jnp.inf)

    return jax.lax.cond(jnp.any(knobs.guided), masked, lambda x: x, logits)


def scored(logprobs, tokens, k: int):
    """`[..., V]` log-probabilities -> `(of tokens [...], top-k ids [..., k] int32, top-k values [..., k])`."""
    chosen = jnp.take_along_axis(logprobs, jnp.maximum(tokens, 0)[..., None], axis=-1)[..., 0]
    top, top_ids = jax.lax.top_k(logprobs, k)
    return chosen, top_ids.astype(jnp.int32), top


def _zeros(shape: tuple, k: int):
    return jnp.zeros(shape, jnp.float32), jnp.zeros((*shape, k), jnp.int32), jnp.zeros((*shape, k), jnp.float32)


def drawn_logprobs(logits, tokens, asked):
    """Of each drawn row's token `[M]` and its top `(ids, values) [M, K]`, from the raw `[M, V]` float32
    `logits`; zeros where nobody asked (`asked [M]` bool), under one `lax.cond` on "some row asks"."""
    k = min(MAX_LOGPROBS, logits.shape[-1])
    return jax.lax.cond(jnp.any(asked), lambda: scored(jax.nn.log_softmax(logits), tokens, k),
                        lambda: _zeros(tokens.shape, k))


def prompt_logprobs(head, hidden, targets, vocab_size: int):
    """Of each prefill token's next prompt token `[prefill_rows, chunk]` and the top there (zeros where
    `targets`, the next prompt tokens, are -1).

    `head` maps `[T, D]` hidden states to `[T, V]` float32 logits; `hidden` `[Tf, D]` is the step's (its
    prefill rows last). The head runs over one prefill row of `chunk` tokens at a time (`lax.map`, and
    only on the rows that ask): one row's `[chunk, V]` logits are live, not all rows'."""
    k = min(MAX_LOGPROBS, vocab_size)
    rows, chunk = targets.shape
    if rows == 0:
        return _zeros((0, chunk), k)
    prefill = hidden[hidden.shape[0] - rows * chunk:].reshape(rows, chunk, hidden.shape[-1])

    def row(args):
        hidden_row, row_targets = args
        return jax.lax.cond(jnp.any(row_targets >= 0),
                            lambda: scored(jax.nn.log_softmax(head(hidden_row)), row_targets, k),
                            lambda: _zeros((chunk,), k))

    return jax.lax.cond(jnp.any(targets >= 0), lambda: jax.lax.map(row, (prefill, targets)),
                        lambda: _zeros((rows, chunk), k))


def step_forward(params, pools, history, tokens, batch: PagedBatch, prompt_targets, token_slots=None, *,
                 model: DecoderLM):
    """The step's first program: the paged forward -> `(pools, history, raw [M, V] float32 logits of the
    drawn rows, prompt log-probabilities)`. It needs nothing of the draws, so the host fills the guided
    rows' masks while it runs. `token_slots` (`[Tf]`, with LoRA slots in `params`): each token's slot."""
    # The tokens go into the history at their keys' slots first, so a row reads its own sequence whole.
    history = history.reshape(-1).at[batch.slots].set(tokens, mode="drop").reshape(history.shape)
    variables = {"params": params if token_slots is None else with_token_slots(params, token_slots)}
    hidden, pools = model.apply(variables, tokens, pools, batch, method=DecoderLM.paged_hidden)
    head = lambda x: model.apply(variables, x[None], method=DecoderLM.logits)[0].astype(jnp.float32)  # noqa: E731
    raw = head(hidden[batch.logit_tokens])  # log-probabilities are the model's, before any knob
    return pools, history, raw, prompt_logprobs(head, hidden, prompt_targets, raw.shape[-1])


def step_sample(raw, history, knobs: DrawKnobs, block_tables: tuple, logprobs_asked):
    """The step's second program: the raw logits masked, biased, penalised and drawn -> `(tokens [M],
    finite [M], the drawn rows' log-probabilities)`."""
    logits = apply_masks(raw, knobs)  # a guided row with nothing allowed is not finite below
    finite = jnp.isfinite(jnp.max(logits, axis=-1))  # [M]: NaN, +inf or all -inf means nothing to draw from
    block_table = jnp.concatenate(block_tables)  # [M, pages], in draw order
    tokens = draw(adjusted(logits, knobs, lambda: logit_knobs.sequence_tokens(history, block_table)), knobs)
    return tokens, finite, drawn_logprobs(raw, tokens, logprobs_asked)


class Pending(NamedTuple):
    """A dispatched forward: the drawn rows' raw logits and the prompt log-probabilities, on the device."""

    raw: jax.Array
    prompt: tuple


def _rows(shape: StepShape) -> tuple[int, int]:
    """What a sampler's program depends on: the decode and prefill rows (not the chunk)."""
    return shape.decode_rows, shape.prefill_rows


def _forward_args(inputs: StepInputs) -> tuple:
    slots = () if inputs.token_slots is None else (inputs.token_slots,)  # no slots: the arguments as before
    return inputs.tokens, inputs.batch, inputs.logprobs.prompt_targets, *slots


def _sample_args(inputs: StepInputs) -> tuple:
    return inputs.knobs, tuple(group.block_table for group in inputs.batch.groups), inputs.logprobs.drawn


class StepPrograms:
    """Two compiled programs per bucket, all compiled here (ahead of time: a call with other shapes is
    refused rather than compiled): the forward, per shape, and the draws, per rows (the chunk does
    not change them). The pools and the token history (`[num_pages, page_size]` int32) are donated to
    the forward: each step updates them in place.

    A step is `forward`, which returns as soon as the program is dispatched, then `sample`, whose
    inputs (the guided rows' masks above all) the host may fill while the forward runs.

    The programs are traced one after another (or read back from `store`, default the one beside the
    enabled program cache: `jaxattn.program_store`) and compiled on `threads` threads (default: one per
    core); `progress(done, total, shape)` is called as each shape's programs are ready."""

    def __init__(self, config: ModelConfig, kernels: Kernels, params, pools, history, shapes, *,
                 pages_per_seq: int, num_slots: int, place=lambda tree: tree, progress=None,
                 threads: int | None = None, store: program_store.ProgramStore | None = None, lora: bool = False):
        self.pages_per_seq, self.num_slots, self.place = pages_per_seq, num_slots, place
        store = program_store.default_store() if store is None else store
        forward, context = functools.partial(step_forward, model=DecoderLM(config, kernels)), f"{config!r} {kernels!r}"
        shapes = sorted(shapes)
        # Each rows' sampler is compiled after the first forward of those rows: it takes that forward's outputs.
        first_of_rows = {_rows(shape): shape for shape in reversed(shapes)}

        empty = {shape: place(StepInputs.empty(shape, pages_per_seq, num_slots, config.vocab_size, lora))
                 for shape in shapes}
        forward_args = {shape: (params, pools, history, *_forward_args(empty[shape])) for shape in shapes}

        def compile_shape(shape: StepShape, lowered):
            compiled = lowered.compile()
            sampler = None
            if first_of_rows[_rows(shape)] == shape:
                _, history_out, raw, _ = compiled.out_info  # shapes and shardings the forward gives
                args = (raw, history_out, *_sample_args(empty[shape]))
                sampler = store.program("serving-sample", "", step_sample, args).lower(*args).compile()
            return shape, compiled, sampler

        self.programs, self.samplers = {}, {}
        # XLA compiles outside the GIL, one program per core at once, while this thread traces (or reads back
        # from the store) the next; the pools and the history are donated.
        with concurrent.futures.ThreadPoolExecutor(threads or os.cpu_count() or 1) as pool:
            futures = [pool.submit(compile_shape, shape, store.program(
                "serving-forward", context, forward, args, donate_argnums=(1, 2)).lower(*args))
                for shape, args in forward_args.items()]
            for done, future in enumerate(concurrent.futures.as_completed(futures), 1):
                shape, compiled, sampler = future.result()
                self.programs[shape] = compiled
                if sampler is not None:
                    self.samplers[_rows(shape)] = sampler
                if progress is not None:
                    progress(done, len(shapes), shape)

    @property
    def shapes(self) -> list[StepShape]:
        return sorted(self.programs)

    def forward(self, shape: StepShape, params, pools, history, inputs: StepInputs):
        """Dispatches bucket `shape`'s forward -> `(pools, history, Pending)`, all on the device, returned
        before the program ends. Reads `inputs`' tokens, batch and prompt targets, not its knobs."""
        pools, history, raw, prompt = self.programs[shape](params, pools, history,
                                                           *self.place(_forward_args(inputs)))
        return pools, history, Pending(raw, prompt)

    def sample(self, shape: StepShape, pending: Pending, history, inputs: StepInputs):
        """Dispatches the draws after `forward` -> `(tokens [M], finite [M], Logprobs)`, all on the device,
        returned before the program ends: the caller waits for them and copies what it reads."""
        tokens, finite, drawn = self.samplers[_rows(shape)](pending.raw, history, *self.place(_sample_args(inputs)))
        return tokens, finite, Logprobs(*drawn, *pending.prompt)
