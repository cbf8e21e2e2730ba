"""The model's side of a step: the parameters and pools where they run, the compiled step programs, and a
scheduled step turned into the programs' arrays.

`ModelRunner` places the parameters and the page pools (on a device mesh, or as they are), compiles
every step shape once (`jaxattn.serving.step.StepPrograms`), and for each `SchedulerOutput` picks the
smallest compiled shape that holds it (`shape`), writes its host arrays (`inputs`: flat tokens,
positions and slots, each row's block table and positions, the draws' knobs, those of
`jaxattn.serving.logit_knobs` by `fill_logit_knobs`, which log-probabilities are asked:
`logprob_knobs`) straight into the layout of `jaxattn.serving.step.StepInputs` and
`jaxattn.cache.containers.PagedBatch`, and runs it (`execute`): the drawn tokens and whether each row's
logits were finite, one entry per scheduled row, and the log-probabilities asked (`StepLogprobsOut`,
read back from the device only when some row asked).

It reads the requests' page bookkeeping and never writes it (the KV-cache manager's). Beside the pools
it holds `history`, each slot's token, which the step programs write and the penalties read.

A guided row (a request with a guide, drawing this step) gets its mask of allowed tokens filled on the
host (`fill_guides`, through `jaxattn.serving.structured`) while the device runs the step's forward, and
applied in the step's second program before the draw (`jaxattn.serving.step.StepPrograms`), as vLLM
fills its grammar bitmask while the model runs.

A step whose decode rows take several turns (`SchedulerOutput.turns`) runs as one call of up to
`max_steps` decode steps (`jaxattn.serving.multi_step`, compiled per decode bucket when `max_steps` > 1):
`execute_run` writes its inputs (`run_inputs`) and reads each row's tokens once, at the call's end.

With `EngineConfig.max_loras` > 0 the parameters carry LoRA slots (`jaxattn.lora.empty_slots`, made once
here); `write_slot` fills or clears one (new arrays of the same shapes: no program changes), and each
row's tokens carry its request's slot (`StepInputs.token_slots`, `DecodeRun.token_slots`).

vLLM V1's GPUModelRunner is the model (read for its shape).
"""

from __future__ import annotations

import concurrent.futures
import functools
import time
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxattn import sharding
from jaxattn.axes import MeshShape
from jaxattn.cache.build import init_pools
from jaxattn.config import ModelConfig
from jaxattn.kernels import Kernels
from jaxattn.kernels.select import lora_form, this_platform
from jaxattn.lora import empty_slots, write_slot
from jaxattn.program_store import ProgramStore
from jaxattn.scan_plan import relayout
from jaxattn.serving.engine_config import EngineConfig
from jaxattn.serving.logit_knobs import fill_draw_knobs
from jaxattn.serving.loras import SlotWriter
from jaxattn.serving.multi_step import MAX_STOP_IDS, DecodeRun, DecodeRunPrograms
from jaxattn.serving.requests import Request, StepLogprobs
from jaxattn.serving.scheduler_output import SchedulerOutput
from jaxattn.serving.step import LogprobKnobs, Logprobs, Pending, StepInputs, StepPrograms, StepShape
from jaxattn.serving.step_clock import StepClock
from jaxattn.serving.structured import GuideCompiler
from jaxattn.serving.verify import VerifyPrograms, verify_inputs


class InFlight(NamedTuple):
    """A dispatched step: what was scheduled, its shape and host inputs, the scheduled rows' draws (decode
    rows, then prompt chunks) and its outputs on the device, not yet read back."""

    output: SchedulerOutput
    shape: StepShape
    inputs: StepInputs
    rows: list[int]
    drawn: jax.Array
    finite: jax.Array
    logprobs: Logprobs


class StepLogprobsOut(NamedTuple):
    """A step's log-probabilities on the host, in the order of `execute`'s tokens.

    Attributes:
      drawn: per scheduled row (decode rows, then prompt chunks): its draw's `StepLogprobs`, or None
        where the request did not ask.
      prompt: per prompt chunk: `(position, StepLogprobs)` of each prompt token it scored (the token at
        `position` given those before it); empty where the request did not ask.
    """

    drawn: list[StepLogprobs | None]
    prompt: list[list[tuple[int, StepLogprobs]]]


def logprob_knobs(knobs: LogprobKnobs, request: Request, draw: int, prefill_row: int | None,
                  start: int, count: int) -> None:
    """Writes which log-probabilities a row asks for: its draw's (`sampling.logprobs`), and for a prompt
    chunk (`prefill_row`: its tokens at positions start ... start + count - 1), each prompt token after
    its tokens (`sampling.prompt_logprobs`; the prompt only, before anything is drawn: a preempted
    request's recomputed prompt is not scored again)."""
    sampling = request.sampling
    knobs.drawn[draw] = sampling.logprobs is not None or request.wants_logprob  # best_of ranks by it
    if prefill_row is None or sampling.prompt_logprobs is None or request.output_ids:
        return
    positions = start + np.arange(count)
    prompt = request.prompt_ids
    scored = positions + 1 < len(prompt)
    knobs.prompt_targets[prefill_row, :len(positions)] = np.where(
        scored, np.asarray(prompt)[np.minimum(positions + 1, len(prompt) - 1)], -1)


def _top(ids: np.ndarray, values: np.ndarray) -> tuple:
    return tuple(zip(ids.tolist(), values.tolist()))


def read_logprobs(logprobs: Logprobs, inputs: StepInputs, rows: list[int], chunks: list[tuple[int, int]]
                  ) -> StepLogprobsOut | None:
    """The asked log-probabilities of the scheduled `rows` (their draws' rows) and prompt `chunks` (their
    `(start position, count)`), copied from the device; None (nothing copied) when no row asked."""
    asked, targets = inputs.logprobs.drawn, inputs.logprobs.prompt_targets
    if not asked.any() and not (targets >= 0).any():
        return None
    drawn = [None] * len(rows)
    if asked.any():
        value, ids, top = (np.asarray(a) for a in (logprobs.drawn, logprobs.drawn_top_ids, logprobs.drawn_top))
        drawn = [StepLogprobs(float(value[r]), _top(ids[r], top[r])) if asked[r] else None for r in rows]
    prompt = [[] for _ in chunks]
    if (targets >= 0).any():
        value, ids, top = (np.asarray(a) for a in (logprobs.prompt, logprobs.prompt_top_ids, logprobs.prompt_top))
        for row, (start, count) in enumerate(chunks):
            prompt[row] = [(start + j + 1, StepLogprobs(float(value[row, j]), _top(ids[row, j], top[row, j])))
                           for j in range(count) if targets[row, j] >= 0]
    return StepLogprobsOut(drawn, prompt)


def step_shapes(ec: EngineConfig) -> list[StepShape]:
    """Every shape compiled: each decode bucket alone, and with each prefill shape (and prefill alone)."""
    shapes = [StepShape(d, 0, ec.chunk) for d in ec.buckets()]
    return shapes + [StepShape(d, rows, chunk) for d in (0, *ec.buckets()) for rows, chunk in ec.prefill_shapes()]


def _placed(params, pools, config: ModelConfig, mesh: Mesh | None):
    """Params and pools on `mesh` (and a function placing each step's inputs), or as they are."""
    if mesh is None:
        return params, pools, lambda tree: tree
    shape = MeshShape.of(mesh)
    params = sharding.place(nn.unbox(params), sharding.param_layout(config, shape).shardings(mesh))
    specs = sharding.pool_specs(pools, config, shape)
    pools = sharding.place(pools, jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                                               is_leaf=lambda x: isinstance(x, PartitionSpec)))
    replicated = NamedSharding(mesh, PartitionSpec())
    return params, pools, lambda tree: jax.device_put(tree, replicated)


class ModelRunner:
    """The parameters, the pools and the compiled steps (see the module docstring).

    Args:
      params: `DecoderLM(config)` parameters.
      config: the model.
      engine_config: the compiled shapes and the pages' storage.
      num_pages: the pool's pages (`jaxattn.serving.kv_memory.pool_plan`).
      max_model_len: the longest sequence (the block table's width is its pages).
      kernels: which implementations run the model.
      mesh: a device mesh: parameters laid out by `jaxattn.axes.RULES`, the pools split over kv heads.
      progress: called `(done, total, shape)` as each step program compiles.
      guide_compiler: fills the masks of guided rows (`jaxattn.serving.structured`); None: no guides.
      max_steps: the most decode steps a call runs (`EngineConfig.steps_per_call`); above 1 a multi-step
        program is compiled per decode bucket (`runs`).
      max_drafts: speculative decoding's most drafts per row (k), its verification programs compiled per
        decode bucket and width (`verifies`, `jaxattn.serving.verify`); None: none.

    Attributes:
      mask_seconds, masked_rows: host time spent filling guided rows' masks, and the rows filled.
      masks_late: steps whose forward had already ended when their masks were filled.
    """

    def __init__(self, params, config: ModelConfig, engine_config: EngineConfig, *, num_pages: int,
                 max_model_len: int, kernels: Kernels = Kernels(), mesh: Mesh | None = None, progress=None,
                 guide_compiler: GuideCompiler | None = None, store: ProgramStore | None = None,
                 max_steps: int = 1, max_drafts: int | None = None):
        # A paged step runs its layers unrolled: a scan would copy each layer's pool out of the stack
        # and back on every step (`jaxattn.scan_plan`), so stacked parameters are unstacked once here.
        params, config = relayout(nn.unbox(params), config, scan_layers=False)
        ec = engine_config
        self.lora, self._slot_writer = ec.max_loras > 0, None
        if self.lora:  # refused on a mesh by the engine: the slots are laid out on one device
            form = lora_form(this_platform(), config.param_dtype)[0] if ec.lora_form == "auto" else ec.lora_form
            params = empty_slots(params, config, ec.max_loras, ec.max_lora_rank, ec.lora_targets, form=form)
            self._slot_writer = SlotWriter(params)
            params = self._slot_writer(params, 0, None)  # its one program compiles here, not at a request
        self.config, self.kernels, self.page_size = config, kernels, ec.page_size
        self.guide_compiler, self.mask_seconds, self.masked_rows, self.masks_late = guide_compiler, 0.0, 0, 0
        self.pages_per_seq = -(-max_model_len // ec.page_size)
        self.num_slots = num_pages * ec.page_size
        self._buckets, self._prefill_shapes, self._chunk = ec.buckets(), ec.prefill_shapes(), ec.chunk
        make_pools = functools.partial(init_pools, config, num_pages, ec.page_size, ec.kv_cache)
        with concurrent.futures.ThreadPoolExecutor(1) as zeroing:
            # On one device the pools (gigabytes: seconds of zeroing) are made while the programs are traced or
            # read back and compiled, which need only their shapes; on a mesh they are placed first.
            made = zeroing.submit(make_pools) if mesh is None else None
            pools = jax.eval_shape(make_pools) if mesh is None else make_pools()
            self.params, pools, place = _placed(params, pools, config, mesh)
            # Each slot's token, written beside its keys and values (the penalties read it: `logit_knobs`).
            self.history = place(jnp.zeros((num_pages, ec.page_size), jnp.int32))
            self.programs = StepPrograms(config, kernels, self.params, pools, self.history, step_shapes(ec),
                                         pages_per_seq=self.pages_per_seq, num_slots=self.num_slots, place=place,
                                         progress=progress, store=store, lora=self.lora)
            self.verifies = None if max_drafts is None else VerifyPrograms(
                config, kernels, self.params, pools, self.history, self._buckets, max_drafts,
                pages_per_seq=self.pages_per_seq, num_slots=self.num_slots, place=place, store=store, lora=self.lora)
            self.runs = None if max_steps == 1 else DecodeRunPrograms(
                config, kernels, self.params, pools, self.history, self._buckets, max_steps=max_steps,
                page_size=ec.page_size, pages_per_seq=self.pages_per_seq, num_slots=self.num_slots, place=place,
                store=store, lora=self.lora)
            self.pools = pools if made is None else made.result()

    def write_slot(self, slot: int, adapter) -> None:
        """LoRA slot `slot` holding `adapter` (`jaxattn.serving.loras.host_adapter`'s, of the slots' rank), or
        emptied (None): one compiled program, the slots' stacks written in place (`SlotWriter`)."""
        self.params = self._slot_writer(self.params, slot, adapter)

    def check_adapter(self, adapter) -> None:
        """ValueError (naming the weight) where `adapter` does not fit the slots; nothing is computed."""
        jax.eval_shape(lambda params, adapter: write_slot(params, 0, adapter), self.params, adapter)

    def execute(self, output: SchedulerOutput, clock: StepClock | None = None
                ) -> tuple[list[int], list[bool], StepLogprobsOut | None]:
        """Runs the step -> `(tokens, finite, logprobs)`: one entry per decode row, then one per prompt
        chunk (a chunk that does not reach its prompt's end has a draw nobody takes); `logprobs` None
        when no row asked for any. `dispatch`, then `collect`."""
        clock = StepClock() if clock is None else clock
        return self.collect(self.dispatch(output, clock), clock)

    def dispatch(self, output: SchedulerOutput, clock: StepClock, after: InFlight | None = None) -> InFlight:
        """Queues the step on the device and returns before it runs. The guided rows' masks are filled
        while the forward runs. A step scheduled ahead (`output.fed_by`) is queued behind `after`, the
        step in flight, and takes its decode rows' tokens from `after`'s draws on the device: each row
        computes the position after its `num_computed`. `clock` (a `StepClock`) takes the phases' times:
        inputs, dispatch."""
        decode, prefill = output.decode, output.prefill
        with clock.phase("inputs"):
            # Ahead, each row keeps its row of `after` (a decode-only step of the same shape), so `after`'s
            # drawn tokens are this step's tokens as they are: no program between the two.
            shape = after.shape if output.fed_by else self.shape(len(decode), prefill)
            inputs, guided = self.inputs(shape, output)
            if output.fed_by:
                inputs = inputs.replace(tokens=after.drawn)
        with clock.phase("dispatch"):
            self.pools, self.history, pending = self.programs.forward(shape, self.params, self.pools, self.history,
                                                                      inputs)
            self.fill_guides(inputs, guided, pending)
            drawn, finite, logprobs = self.programs.sample(shape, pending, self.history, inputs)
        rows = (output.fed_by or list(range(len(decode)))) + list(range(shape.decode_rows,
                                                                         shape.decode_rows + len(prefill)))
        return InFlight(output, shape, inputs, rows, drawn, finite, logprobs)

    def collect(self, step: InFlight, clock: StepClock) -> tuple[list[int], list[bool], StepLogprobsOut | None]:
        """Waits for a dispatched step and reads back what `execute` returns ("device", then "outputs")."""
        with clock.phase("device"):
            jax.block_until_ready((step.drawn, step.finite, step.logprobs))
        with clock.phase("outputs"):
            chunks = [(start, count) for _, start, count in step.output.prefill]
            logprobs = read_logprobs(step.logprobs, step.inputs, step.rows, chunks)
            drawn, finite = np.asarray(step.drawn).tolist(), np.asarray(step.finite).tolist()
        return [drawn[r] for r in step.rows], [finite[r] for r in step.rows], logprobs

    def shape(self, decoding: int, prefill: list) -> StepShape:
        """The smallest compiled shape that holds the step: decode rows, then prefill rows and chunk."""
        decode_rows = min((d for d in self._buckets if d >= decoding), default=0)
        if not prefill:
            return StepShape(decode_rows, 0, self._chunk)
        rows, chunk = next((r, c) for r, c in self._prefill_shapes
                           if r >= len(prefill) and c >= max(n for _, _, n in prefill))
        return StepShape(0 if decoding == 0 else decode_rows, rows, chunk)

    def inputs(self, shape: StepShape, output: SchedulerOutput) -> tuple[StepInputs, list[tuple[Request, int]]]:
        """The step's host arrays (flat tokens, positions and slots, the rows' groups, the draws' knobs;
        the guided rows' masks left for `fill_guides`) and the guided rows: (request, its logit row)."""
        inputs = StepInputs.empty(shape, self.pages_per_seq, self.num_slots, self.config.vocab_size, self.lora)
        guided = []  # (request, its logit row) of the rows drawn under a guide
        groups = iter(inputs.batch.groups)
        decode_group = next(groups) if shape.decode_rows else None
        prefill_group = next(groups, None)
        ahead = int(bool(output.fed_by))  # a step scheduled ahead computes the position after num_computed
        rows = [(request, request.num_computed + ahead, 1, row, row, decode_group)
                for row, request in zip(output.fed_by or range(len(output.decode)), output.decode)]
        rows += [(request, start, count, row, shape.decode_rows + row * shape.chunk, prefill_group)
                 for row, (request, start, count) in enumerate(output.prefill)]
        page_size, draws = self.page_size, []
        for request, start, count, row, first, group in rows:
            pages = request.pages
            if count == 1:  # a decode row: plain ints, no arrays to make
                inputs.tokens[first] = 0 if ahead else request.token_at(start)  # ahead: the device's token
                inputs.batch.positions[first] = group.positions[row, 0] = start
                inputs.batch.slots[first] = pages[start // page_size] * page_size + start % page_size
            else:
                positions = start + np.arange(count)
                flat = first + np.arange(count)
                inputs.tokens[flat] = request.tokens[start:start + count]
                inputs.batch.positions[flat] = group.positions[row, :count] = positions
                inputs.batch.slots[flat] = np.asarray(pages)[positions // page_size] * page_size + positions % page_size
            group.block_table[row, :len(pages)] = pages  # pages given back are -1: 0 below, never visible again
            if inputs.token_slots is not None:
                inputs.token_slots[first:first + count] = request.lora_slot
            draw = row if group is decode_group else shape.decode_rows + row  # the row's logits
            inputs.batch.logit_tokens[draw] = first + count - 1
            draws.append(draw)
            logprob_knobs(inputs.logprobs, request, draw, None if group is decode_group else row, start, count)
            if request.guide_state is not None and start + count == request.num_tokens:  # a draw it takes
                guided.append((request, draw))
        for table in (group.block_table for group in inputs.batch.groups):
            np.maximum(table, 0, out=table)
        fill_draw_knobs(inputs.knobs, draws, [request for request, *_ in rows])
        inputs.knobs.position[draws] += ahead
        return inputs, guided

    def run_inputs(self, output: SchedulerOutput) -> DecodeRun:
        """A multi-step call's host arrays: each decode row's last token, position, pages, knobs, stop
        tokens (the first `MAX_STOP_IDS`; the host stops at any of them) and turns."""
        rows = min(d for d in self._buckets if d >= len(output.decode))
        run = DecodeRun.empty(rows, self.pages_per_seq, self.config.vocab_size, self.lora)
        for row, request in enumerate(output.decode):
            if run.token_slots is not None:
                run.token_slots[row] = request.lora_slot
            run.tokens[row], run.positions[row] = request.token_at(request.num_computed), request.num_computed
            run.block_table[row, :len(request.pages)] = request.pages
            stop = request.sampling.stop_token_ids[:MAX_STOP_IDS]
            run.stop_ids[row, :len(stop)] = stop
            run.logprobs[row] = request.sampling.logprobs is not None or request.wants_logprob
        np.maximum(run.block_table, 0, out=run.block_table)
        run.remaining[:len(output.turns)] = output.turns
        fill_draw_knobs(run.knobs, list(range(len(output.decode))), output.decode)
        return run.replace(steps=np.int32(output.steps))

    def execute_run(self, output: SchedulerOutput, clock: StepClock | None = None
                    ) -> tuple[list[list[int]], list[list[bool]], list[list] | None]:
        """Runs a multi-step call -> per decode row its tokens in order, whether each was drawn from finite
        logits, and its log-probabilities (`StepLogprobs`, None where not asked; None when no row asked)."""
        clock = StepClock() if clock is None else clock
        with clock.phase("inputs"):
            run = self.run_inputs(output)
        with clock.phase("dispatch"):
            self.pools, self.history, out = self.runs.run(len(run.tokens), self.params, self.pools, self.history, run)
        with clock.phase("device"):
            jax.block_until_ready(out)
        with clock.phase("outputs"):
            rows, turns = len(output.decode), int(out.turns)
            tokens = np.asarray(out.tokens)[:turns, :rows].T
            finite = np.asarray(out.finite)[:turns, :rows].T
            drawn = [[t for t in row if t >= 0] for row in tokens.tolist()]
            logprobs = None
            if run.logprobs.any():
                value, ids, top = (np.asarray(a)[:turns] for a in (out.logprob, out.top_ids, out.top))
                logprobs = [[StepLogprobs(float(value[j, r]), _top(ids[j, r], top[j, r])) if run.logprobs[r] else None
                             for j in range(len(drawn[r]))] for r in range(rows)]
        return drawn, [row[:len(d)] for row, d in zip(finite.tolist(), drawn)], logprobs

    def execute_verify(self, output: SchedulerOutput, clock: StepClock
                       ) -> tuple[list[list[int]], list[list[bool]], list[list] | None]:
        """Runs a verification step (`output.drafts`) -> per decode row the tokens it emits (its kept drafts,
        then its own), whether each was drawn from finite logits, and their log-probabilities (as
        `execute_run`'s)."""
        programs = self.verifies
        with clock.phase("inputs"):
            rows, width = programs.shape(len(output.decode), max(map(len, output.drafts)))
            inputs = verify_inputs(output.decode, output.drafts, rows, width, page_size=self.page_size,
                                   pages_per_seq=self.pages_per_seq, num_slots=self.num_slots,
                                   vocab_size=self.config.vocab_size, lora=self.lora)
        with clock.phase("dispatch"):
            self.pools, self.history, *out = programs.run(self.params, self.pools, self.history, inputs)
        with clock.phase("device"):
            jax.block_until_ready(out)
        with clock.phase("outputs"):
            tokens, accepted, finite, logprobs = out
            counts = np.asarray(accepted)[:len(output.decode)] + 1
            drawn = [row[:n] for row, n in zip(np.asarray(tokens).tolist(), counts)]
            finite = np.asarray(finite).reshape(rows, -1).tolist()
            asked = inputs.logprobs_asked.reshape(rows, -1)[:, 0]
            read = None
            if asked.any():
                value, ids, top = (np.asarray(a).reshape(rows, width, -1)
                                   for a in (logprobs.drawn, logprobs.drawn_top_ids, logprobs.drawn_top))
                read = [[StepLogprobs(float(value[r, j, 0]), _top(ids[r, j], top[r, j])) if asked[r] else None
                         for j in range(len(drawn[r]))] for r in range(len(drawn))]
        return drawn, [row[:len(d)] for row, d in zip(finite, drawn)], read

    def fill_guides(self, inputs: StepInputs, guided: list[tuple[Request, int]], pending: Pending) -> None:
        """Each guided row's mask of allowed tokens (its guide's next step), filled on the host in one
        parallel call while the dispatched forward (`pending`) runs, and the row marked guided; the other
        rows' masks stay all ones. Counts a step whose forward had ended before the masks were
        filled (`masks_late`): then the host's time was not hidden behind the device's."""
        if not guided:
            return
        started = time.perf_counter()
        self.guide_compiler.fill_masks([(request.guide_state, row) for request, row in guided], inputs.knobs.mask)
        inputs.knobs.guided[[row for _, row in guided]] = True
        self.mask_seconds += time.perf_counter() - started
        self.masked_rows += len(guided)
        self.masks_late += pending.raw.is_ready()
