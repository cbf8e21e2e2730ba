"""The engine's one step, compiled once per shape bucket: a paged forward and the draws.

A step is a flat run of tokens from many sequences (`jaxattn.cache.containers.PagedBatch`), in two groups
of rows: `decode_rows` rows of one token (a sequence's last token, whose next one is drawn) and
`prefill_rows` rows of up to `chunk` tokens (a piece of a prompt, or of a preempted sequence
being recomputed). The weights are read once for all of them; attention reads each row's own
pages. Logits are computed only for the tokens a draw follows (`PagedBatch.logit_tokens`).

Each draw's randomness depends on the request's seed and the position of the drawn token
only (`jax.random.fold_in(PRNGKey(seed), position)`), never on what else shares the step, so a
seeded request gives the same tokens whatever runs beside it.

Shapes are static per bucket (`StepShape`); `StepInputs.empty` is a step of padding alone, used
to compile every bucket at start-up (`StepPrograms`), so no request ever waits for a compile.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxattn.cache.containers import PagedBatch, RowGroup
from jaxattn.config import ModelConfig
from jaxattn.kernels import Kernels
from jaxattn.model import DecoderLM
from jaxattn.sampling import filter_logits


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
    """Per drawn row: `[M]` arrays. temperature 0 = greedy; top_k <= 0 and top_p >= 1 are off."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    seed: jax.Array  # int32
    position: jax.Array  # int32, the drawn token's position in its sequence
    guided: jax.Array  # bool, the row's tokens are constrained by `mask`
    mask: jax.Array  # [M, ceil(V/32)] int32: bit i % 32 of word i // 32 set = token i allowed (guided rows)


@flax.struct.dataclass
class StepInputs:
    """Everything a step's program takes besides the parameters and the pools."""

    tokens: jax.Array  # [Tf] int32
    batch: PagedBatch
    knobs: DrawKnobs

    @staticmethod
    def empty(shape: StepShape, pages_per_seq: int, num_slots: int, vocab_size: int) -> "StepInputs":
        """Host arrays of a step of padding only (nothing written, nothing visible, nothing guided)."""
        Tf, M = shape.num_tokens, shape.num_draws
        groups = tuple(RowGroup(positions=np.full((rows, width), -1, np.int32),
                                block_table=np.zeros((rows, pages_per_seq), np.int32))
                       for rows, width in ((shape.decode_rows, 1), (shape.prefill_rows, shape.chunk)) if rows)
        batch = PagedBatch(positions=np.zeros(Tf, np.int32), slots=np.full(Tf, num_slots, np.int32),
                           groups=groups, logit_tokens=np.zeros(M, np.int32))
        knobs = DrawKnobs(temperature=np.zeros(M, np.float32), top_k=np.zeros(M, np.int32),
                          top_p=np.ones(M, np.float32), seed=np.zeros(M, np.int32), position=np.zeros(M, np.int32),
                          guided=np.zeros(M, bool), mask=np.full((M, -(-vocab_size // 32)), -1, np.int32))
        return StepInputs(tokens=np.zeros(Tf, np.int32), batch=batch, knobs=knobs)


def draw(logits, knobs: DrawKnobs):
    """`[M, V]` float32 logits -> `[M]` int32 tokens: greedy where temperature is 0, else a draw
    keyed by (seed, position) after temperature, top-k and top-p (`jaxattn.sampling`'s order).
    The sorting top-k/top-p need runs only when some row asks for them."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def sampled(logits):
        t = knobs.temperature
        scaled = logits / jnp.where(t > 0, t, 1.0)[:, None]
        filtered = jax.lax.cond(
            jnp.any((knobs.top_k > 0) | (knobs.top_p < 1.0)),
            lambda x: jax.vmap(lambda row, k, p: filter_logits(row[None], top_k=k, top_p=p)[0])(
                x, knobs.top_k, knobs.top_p),
            lambda x: x, scaled)
        keys = jax.vmap(lambda seed, position: jax.random.fold_in(jax.random.PRNGKey(seed), position))(
            knobs.seed, knobs.position)
        drawn = jax.vmap(lambda key, row: jax.random.categorical(key, row))(keys, filtered).astype(jnp.int32)
        return jnp.where(t > 0, drawn, greedy)

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


def _step(params, pools, inputs: StepInputs, *, model: DecoderLM):
    logits, pools = model.apply({"params": params}, inputs.tokens, pools, inputs.batch,
                                method=DecoderLM.extend_paged)
    logits = apply_masks(logits, inputs.knobs)  # a guided row with nothing allowed is not finite below
    finite = jnp.isfinite(jnp.max(logits, axis=-1))  # [M]: NaN, +inf or all -inf means nothing to draw from
    return pools, draw(logits, inputs.knobs), finite


class StepPrograms:
    """One compiled step per bucket, all compiled here (ahead of time: a call with other shapes
    is refused rather than compiled). The pools are donated: each step updates them in place."""

    def __init__(self, config: ModelConfig, kernels: Kernels, params, pools, shapes, *, pages_per_seq: int,
                 num_slots: int, place=lambda tree: tree, progress=None):
        self.pages_per_seq, self.num_slots, self._place = pages_per_seq, num_slots, place
        step = jax.jit(functools.partial(_step, model=DecoderLM(config, kernels)), donate_argnums=(1,))
        self.programs = {}
        for i, shape in enumerate(sorted(shapes)):
            inputs = place(StepInputs.empty(shape, pages_per_seq, num_slots, config.vocab_size))
            self.programs[shape] = step.lower(params, pools, inputs).compile()
            if progress is not None:
                progress(i + 1, len(shapes), shape)

    @property
    def shapes(self) -> list[StepShape]:
        return sorted(self.programs)

    def __call__(self, shape: StepShape, params, pools, inputs: StepInputs):
        """Runs bucket `shape` -> `(pools, tokens [M] numpy, finite [M] numpy)`."""
        pools, tokens, finite = self.programs[shape](params, pools, self._place(inputs))
        return pools, np.asarray(tokens), np.asarray(finite)
