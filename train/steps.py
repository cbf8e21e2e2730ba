"""The jitted programs of a training run: init, `steps_per_dispatch` optimizer steps, evaluation.

One call of `train_steps` runs n optimizer steps inside `lax.scan`; batches are
drawn on the device from (seed, step), so nothing happens on the host between
steps and a resumed run replays exactly the batches of an uninterrupted one.
With `data_parallel > 1` each batch is split over that many devices
(`shard_map`): gradients are averaged, parameters stay replicated, and the
result equals one device's up to float summation order.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.flatten_util import ravel_pytree
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxattn.model import DecoderLM
from train import data as data_lib
from train.config import ExperimentConfig
from train.optim import lr_schedule, make_optimizer
from train.runtime import Runtime

EVAL_SPLITS = {"train": 2, "val": 3}  # rng split ids of the fixed eval batches (0, 1: training batches)


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token loss in float32; logits `[B, T, V]`, targets `[B, T]`."""
    logits = logits.reshape(-1, logits.shape[-1]).astype(jnp.float32)  # [B*T, V]
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets.reshape(-1)).mean()


@dataclasses.dataclass(frozen=True)
class Programs:
    """The jitted functions of a run (`train_steps` compiles once per distinct number of steps)."""

    init: Callable  # (seed) -> state {'params', 'opt_state', 'step', 'rng'}
    train_steps: Callable  # (state, train_data, num_steps) -> (state, (losses, lrs) [num_steps] each)
    evaluate: Callable  # (params, train_data, val_data) -> {'train': loss, 'val': loss}
    place: Callable  # (pytree) -> the pytree on the run's devices


def build_programs(config: ExperimentConfig, runtime: Runtime) -> Programs:
    model, tc = DecoderLM(config.model, runtime.kernels), config.train
    optimizer, schedule = make_optimizer(tc), lr_schedule(tc)
    dropout = config.model.dropout > 0
    B, T = tc.batch_size, tc.block_size

    def loss_fn(params, x, y, dropout_key):
        rngs = {"dropout": dropout_key} if dropout else None
        return cross_entropy(model.apply({"params": params}, x, deterministic=not dropout, rngs=rngs), y)

    loss_and_grads = jax.value_and_grad(loss_fn)
    if runtime.data_parallel > 1:
        loss_and_grads = data_parallel(loss_and_grads, runtime.data_parallel)

    def one_step(state, train_data):
        step = state["step"]
        x, y = data_lib.get_batch(train_data, data_lib.batch_key(tc.seed, data_lib.TRAIN, step), B, T)
        loss, grads = loss_and_grads(state["params"], x, y, jax.random.fold_in(state["rng"], step))
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        # The lr comes back with the loss so that logging it needs no extra device call.
        return {**state, "params": params, "opt_state": opt_state, "step": step + 1}, (loss, schedule(step))

    @partial(jax.jit, static_argnums=(2,), donate_argnums=(0,))
    def train_steps(state, train_data, num_steps):
        return jax.lax.scan(lambda s, _: one_step(s, train_data), state, None, length=num_steps)

    @jax.jit
    def evaluate(params, train_data, val_data):
        def split_loss(split_data, split_id):
            def batch_loss(_, i):
                x, y = data_lib.get_batch(split_data, data_lib.batch_key(tc.seed, split_id, i), B, T)
                return None, cross_entropy(model.apply({"params": params}, x), y)
            return jax.lax.scan(batch_loss, None, jnp.arange(tc.eval_iters))[1].mean()
        return {name: split_loss(data, EVAL_SPLITS[name])
                for name, data in (("train", train_data), ("val", val_data))}

    def init(seed):
        params_key, dropout_key = jax.random.split(jax.random.PRNGKey(seed))
        params = model.init(params_key, jnp.zeros((1, T), jnp.int32))["params"]
        return {"params": params, "opt_state": optimizer.init(params), "step": jnp.int32(0), "rng": dropout_key}

    place = partial(replicate, num_devices=runtime.data_parallel)
    return Programs(init=init, train_steps=train_steps, evaluate=evaluate, place=place)


def _mesh(num_devices: int) -> Mesh:
    devices = jax.devices()
    if len(devices) < num_devices:
        raise ValueError(f"data parallelism over {num_devices} devices needs {num_devices}, JAX has {len(devices)}")
    return Mesh(np.array(devices[:num_devices]), ("data",))


def replicate(tree: Any, num_devices: int) -> Any:
    """`tree` replicated on the first `num_devices` devices (as is, for one device)."""
    if num_devices == 1:
        return tree
    return jax.device_put(tree, NamedSharding(_mesh(num_devices), P()))


def data_parallel(loss_and_grads: Callable, num_devices: int) -> Callable:
    """The same (loss, grads) as the mean over `num_devices` devices, each taking B / num_devices rows."""
    def local(params, x, y, dropout_key):  # x, y: [B / num_devices, T]
        key = jax.random.fold_in(dropout_key, jax.lax.axis_index("data"))
        flat, unravel = ravel_pytree(loss_and_grads(params, x, y, key))  # [1 + num_params]
        # One buffer: XLA:CPU all-reduces one large buffer faster than ~30 small ones (docs/performance.md).
        return unravel(jax.lax.pmean(flat, "data"))

    return jax.shard_map(local, mesh=_mesh(num_devices), in_specs=(P(), P("data"), P("data"), P()),
                         out_specs=P(), check_vma=False)
