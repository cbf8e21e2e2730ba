"""The jitted programs of a training run: init, `steps_per_dispatch` optimizer steps, evaluation.

One call of `train_steps` runs n optimizer steps inside `lax.scan`; batches are
drawn on the device from (seed, step), so nothing happens on the host between
steps and a resumed run replays exactly the batches of an uninterrupted one.

Every program is one `jax.jit` over the run's mesh (`jaxattn.sharding`): the
state goes in and comes out with the shardings of `StateLayout` (parameters and
Adam's moments split by the logical-axis rules), the batch is split over data x
fsdp, and XLA's SPMD partitioner adds the collectives. Each device gathers only
its own rows of the batch from the (replicated) corpus, so the processes of a
multi-process run each feed their slice of the global batch. The losses equal
one device's up to the order of float sums.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxattn import sharding
from jaxattn.model import DecoderLM
from train import data as data_lib
from train.config import ExperimentConfig
from train.optim import lr_schedule, make_optimizer
from train.runtime import Runtime

EVAL_SPLITS = {"train": 2, "val": 3}  # rng split ids of the fixed eval batches (0, 1: training batches)


def token_losses(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Next-token losses in float32 `[B*T]`; logits `[B, T, V]`, targets `[B, T]`."""
    logits = logits.reshape(-1, logits.shape[-1]).astype(jnp.float32)  # [B*T, V]
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets.reshape(-1))


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token loss in float32; logits `[B, T, V]`, targets `[B, T]`."""
    return token_losses(logits, targets).mean()


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """Where the train state {'params', 'opt_state', 'step', 'rng'} lives on the mesh.

    Attributes:
      mesh: the run's device mesh.
      params: the `jaxattn.sharding.ParamLayout` of the model (specs and notes).
      state: the state's tree of `NamedSharding`s.
      batch: the `NamedSharding` of a `[B, T]` batch.
    """

    mesh: Mesh
    params: sharding.ParamLayout
    state: Any
    batch: NamedSharding

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    def abstract(self, state_shapes: Any) -> Any:
        """`state_shapes` (ShapeDtypeStructs) with this layout's shardings: what a restore fills in."""
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            state_shapes, self.state)


def state_layout(config: ExperimentConfig, mesh: Mesh, init_state: Callable) -> StateLayout:
    """The layout of the state `init_state(seed)` returns, by the rules of `jaxattn.sharding`."""
    shape = sharding.MeshShape.of(mesh)
    params = sharding.param_layout(config.model, shape)
    shapes = jax.eval_shape(init_state, 0)
    opt_specs = sharding.mirror_specs(shapes["opt_state"], params.specs, shapes["params"])
    specs = {"params": params.specs, "opt_state": opt_specs, "step": P(), "rng": P()}
    state = jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda x: isinstance(x, P))
    batch = NamedSharding(mesh, sharding.batch_spec(shape, config.train.batch_size))
    return StateLayout(mesh=mesh, params=params, state=state, batch=batch)


@dataclasses.dataclass(frozen=True)
class Programs:
    """The jitted functions of a run (`train_steps` compiles once per distinct number of steps)."""

    init: Callable  # (seed) -> state {'params', 'opt_state', 'step', 'rng'}, laid out on the mesh
    train_steps: Callable  # (state, train_data, num_steps) -> (state, (losses, lrs) [num_steps] each)
    evaluate: Callable  # (params, train_data, val_data) -> {'train': loss, 'val': loss}
    place: Callable  # (host arrays) -> replicated on the mesh, in every process
    layout: StateLayout


def build_programs(config: ExperimentConfig, runtime: Runtime) -> Programs:
    model, tc = DecoderLM(config.model, runtime.kernels), config.train
    optimizer, schedule = make_optimizer(tc, sharding.logical_names(config.model)), lr_schedule(tc)
    dropout = config.model.dropout > 0
    B, T = tc.batch_size, tc.block_size
    eval_rows = B * max(1, 256 // B)  # whole-split evaluation: about 256 windows a batch, split like B

    def init_state(seed):
        params_key, dropout_key = jax.random.split(jax.random.PRNGKey(seed))
        params = nn.unbox(model.init(params_key, jnp.zeros((1, T), jnp.int32))["params"])
        return {"params": params, "opt_state": optimizer.init(params), "step": jnp.int32(0), "rng": dropout_key}

    layout = state_layout(config, runtime.mesh, init_state)
    params_sharding, replicated = layout.state["params"], layout.replicated

    def batch(split_data, split_id, i):
        x, y = data_lib.get_batch(split_data, data_lib.batch_key(tc.seed, split_id, i), B, T)
        return jax.lax.with_sharding_constraint((x, y), (layout.batch, layout.batch))  # [B, T] rows split

    def forward(params, x, **kwargs):
        with sharding.activation_rules(layout.mesh):  # rows split through every layer
            return model.apply({"params": params}, x, **kwargs)

    def loss_fn(params, x, y, dropout_key):
        rngs = {"dropout": dropout_key} if dropout else None
        return cross_entropy(forward(params, x, deterministic=not dropout, rngs=rngs), y)

    def one_step(state, train_data):
        step = state["step"]
        x, y = batch(train_data, data_lib.TRAIN, step)
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], x, y, jax.random.fold_in(state["rng"], step))
        grads = jax.lax.with_sharding_constraint(grads, params_sharding)  # FSDP: reduce-scattered
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        # The lr comes back with the loss so that logging it needs no extra device call.
        return {**state, "params": params, "opt_state": opt_state, "step": step + 1}, (loss, schedule(step))

    @partial(jax.jit, static_argnums=(2,), donate_argnums=(0,), in_shardings=(layout.state, replicated),
             out_shardings=(layout.state, replicated))
    def train_steps(state, train_data, num_steps):
        return jax.lax.scan(lambda s, _: one_step(s, train_data), state, None, length=num_steps)

    @partial(jax.jit, in_shardings=(params_sharding, replicated, replicated), out_shardings=replicated)
    def evaluate(params, train_data, val_data):
        def split_loss(split_data, split_id):
            def batch_loss(_, i):
                x, y = batch(split_data, split_id, i)
                return None, cross_entropy(forward(params, x), y)
            return jax.lax.scan(batch_loss, None, jnp.arange(tc.eval_iters))[1].mean()

        def whole_split_loss(split_data):  # every target once (train.data.whole_split_windows)
            starts, weights = data_lib.whole_split_windows(split_data.shape[0], T, eval_rows)

            def batch_loss(_, batch):
                x, y = data_lib.windows_at(split_data, batch[0], T)
                x, y = jax.lax.with_sharding_constraint((x, y), (layout.batch, layout.batch))
                return None, jnp.sum(token_losses(forward(params, x), y) * batch[1].reshape(-1))
            return jax.lax.scan(batch_loss, None, (starts, weights))[1].sum() / weights.sum()
        val = whole_split_loss(val_data) if tc.eval_whole_val else split_loss(val_data, EVAL_SPLITS["val"])
        return {"train": split_loss(train_data, EVAL_SPLITS["train"]), "val": val}

    init = jax.jit(init_state, static_argnums=(0,), out_shardings=layout.state)
    place = lambda tree: sharding.place(tree, jax.tree.map(lambda _: replicated, tree))  # noqa: E731
    return Programs(init=init, train_steps=train_steps, evaluate=evaluate, place=place, layout=layout)
