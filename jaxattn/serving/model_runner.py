"""The model's side of a step: the parameters and pools where they run, the compiled step programs, and a
scheduled step turned into the programs' arrays.

`ModelRunner` places the parameters and the page pools (on a device mesh, or as they are), compiles
every step shape once (`jaxattn.serving.step.StepPrograms`), and for each `SchedulerOutput` picks the
smallest compiled shape that holds it (`shape`), writes its host arrays (`inputs`: flat tokens,
positions and slots, each row's block table and positions, the draws' knobs, those of
`jaxattn.serving.logit_knobs` by `fill_logit_knobs`) straight into the
layout of `jaxattn.serving.step.StepInputs` and `jaxattn.cache.containers.PagedBatch`, and runs it
(`execute`): the drawn tokens and whether each row's logits were finite, one entry per scheduled row.

It reads the requests' page bookkeeping and never writes it (the KV-cache manager's). Beside the pools
it holds `history`, each slot's token, which the step programs write and the penalties read.

vLLM V1's GPUModelRunner is the model (read for its shape). What lands here next: a grammar's logit
mask, built per drawn row into the step's inputs and applied before the draw (`step.draw`); several
decode steps per program call (a program that loops k decode steps on the device); many LoRA adapters
per step (the adapters' weights stacked once here, each row's adapter index in the step's inputs).
"""

from __future__ import annotations

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
from jaxattn.scan_plan import relayout
from jaxattn.serving.engine_config import EngineConfig
from jaxattn.serving.logit_knobs import fill_logit_knobs
from jaxattn.serving.requests import Request
from jaxattn.serving.scheduler import SchedulerOutput
from jaxattn.serving.step import StepInputs, StepPrograms, StepShape


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
      num_pages: the pool's pages (`jaxattn.serving.kv_cache_manager.pool_pages`).
      max_model_len: the longest sequence (the block table's width is its pages).
      kernels: which implementations run the model.
      mesh: a device mesh: parameters laid out by `jaxattn.axes.RULES`, the pools split over kv heads.
      progress: called `(done, total, shape)` as each step program compiles.
    """

    def __init__(self, params, config: ModelConfig, engine_config: EngineConfig, *, num_pages: int,
                 max_model_len: int, kernels: Kernels = Kernels(), mesh: Mesh | None = None, progress=None):
        # A paged step runs its layers unrolled: a scan would copy each layer's pool out of the stack
        # and back on every step (`jaxattn.scan_plan`), so stacked parameters are unstacked once here.
        params, config = relayout(nn.unbox(params), config, scan_layers=False)
        ec = engine_config
        self.config, self.kernels, self.page_size = config, kernels, ec.page_size
        self.pages_per_seq = -(-max_model_len // ec.page_size)
        self.num_slots = num_pages * ec.page_size
        self._buckets, self._prefill_shapes, self._chunk = ec.buckets(), ec.prefill_shapes(), ec.chunk
        pools = init_pools(config, num_pages, ec.page_size, ec.kv_cache)
        self.params, self.pools, place = _placed(params, pools, config, mesh)
        # Each slot's token, written beside its keys and values (the penalties read it: `logit_knobs`).
        self.history = place(jnp.zeros((num_pages, ec.page_size), jnp.int32))
        self.programs = StepPrograms(config, kernels, self.params, self.pools, self.history, step_shapes(ec),
                                     pages_per_seq=self.pages_per_seq, num_slots=self.num_slots, place=place,
                                     progress=progress)

    def execute(self, output: SchedulerOutput) -> tuple[list[int], list[bool], list[float]]:
        """Runs the step -> `(tokens, finite, logprobs)`: one entry per decode row, then one per prompt
        chunk (a chunk that does not reach its prompt's end has a draw nobody takes); a logprob is the
        drawn token's raw log-probability for a request that `wants_logprob`, else 0."""
        decode, prefill = output.decode, output.prefill
        shape = self.shape(len(decode), prefill)
        self.pools, self.history, *arrays = self.programs(shape, self.params, self.pools, self.history,
                                                          self.inputs(shape, output))
        rows = slice(shape.decode_rows, shape.decode_rows + len(prefill))
        drawn, finite, logprobs = (a.tolist() for a in arrays)
        return (drawn[:len(decode)] + drawn[rows], finite[:len(decode)] + finite[rows],
                logprobs[:len(decode)] + logprobs[rows])

    def shape(self, decoding: int, prefill: list) -> StepShape:
        """The smallest compiled shape that holds the step: decode rows, then prefill rows and chunk."""
        decode_rows = min((d for d in self._buckets if d >= decoding), default=0)
        if not prefill:
            return StepShape(decode_rows, 0, self._chunk)
        rows, chunk = next((r, c) for r, c in self._prefill_shapes
                           if r >= len(prefill) and c >= max(n for _, _, n in prefill))
        return StepShape(0 if decoding == 0 else decode_rows, rows, chunk)

    def block_table(self, request: Request) -> np.ndarray:
        """The request's pages as one row of the block table (pages given back: 0, never visible again)."""
        table = np.zeros(self.pages_per_seq, np.int32)
        table[:len(request.pages)] = np.maximum(request.pages, 0)
        return table

    def inputs(self, shape: StepShape, output: SchedulerOutput) -> StepInputs:
        """The step's host arrays: flat tokens, positions and slots, the rows' groups, the draws' knobs."""
        inputs = StepInputs.empty(shape, self.pages_per_seq, self.num_slots)
        groups = iter(inputs.batch.groups)
        decode_group = next(groups) if shape.decode_rows else None
        prefill_group = next(groups, None)
        rows = [(request, request.num_computed, 1, row, row, decode_group) for row, request in enumerate(output.decode)]
        rows += [(request, start, count, row, shape.decode_rows + row * shape.chunk, prefill_group)
                 for row, (request, start, count) in enumerate(output.prefill)]
        for request, start, count, row, first, group in rows:
            positions = start + np.arange(count)
            flat = first + np.arange(count)
            inputs.tokens[flat] = request.tokens[positions[0]:positions[-1] + 1]
            inputs.batch.positions[flat] = positions
            pages = np.asarray(request.pages)[positions // self.page_size]
            inputs.batch.slots[flat] = pages * self.page_size + positions % self.page_size
            group.positions[row, :count] = positions
            group.block_table[row] = self.block_table(request)
            draw = row if group is decode_group else shape.decode_rows + row  # the row's logits
            inputs.batch.logit_tokens[draw] = flat[-1]
            knobs, sampling = inputs.knobs, request.sampling
            knobs.temperature[draw], knobs.top_k[draw], knobs.top_p[draw] = (
                sampling.temperature, sampling.top_k, sampling.top_p)
            knobs.seed[draw], knobs.position[draw] = request.seed, request.num_tokens  # the drawn token's position
            fill_logit_knobs(knobs, draw, request)
        return inputs
