"""The jitted programs of a training run: init, `steps_per_dispatch` optimizer steps, evaluation.

One call of `train_steps` runs n optimizer steps inside `lax.scan` over the n batches of
the chunk, read on the host beforehand (`train.batches`): windows `[n, B, T + 1]` whose
first T tokens are the inputs and last T the targets. Evaluation takes windows the same
way, with a weight per target, and returns the weighted sums of the losses.

The training loss is the cross entropy plus whatever objective the layers sowed
(`jaxattn.layer_losses`: a mixture-of-experts layer's `aux_loss`, `MoEConfig.aux_loss_coef` times
the Switch Transformer's load-balancing loss plus `z_loss_coef` times the router z-loss, averaged
over the layers that sowed it; nothing for a dense model), and `train_steps` also returns each
step's mean of every loss the layers sowed. Evaluation is the plain cross entropy for every
model, so val losses compare across dense and MoE models.

Every program is one `jax.jit` over the run's mesh (`jaxattn.sharding`): the
state goes in and comes out with the shardings of `StateLayout` (parameters and
Adam's moments split by the logical-axis rules), the windows are split by rows over
data x fsdp, and XLA's SPMD partitioner adds the collectives. The losses equal
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

from jaxattn import axes, layer_losses, sharding
from jaxattn.model import DecoderLM
from train.config import ExperimentConfig
from train.optim import lr_schedule, make_optimizer
from train.runtime import Runtime

def token_losses(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Next-token losses in float32 `[B*T]`; logits `[B, T, V]`, targets `[B, T]`."""
    logits = logits.reshape(-1, logits.shape[-1]).astype(jnp.float32)  # [B*T, V]
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets.reshape(-1))


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token loss in float32; logits `[B, T, V]`, targets `[B, T]`."""
    return token_losses(logits, targets).mean()


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """Where the train state {'params', 'opt_state', 'step', 'rng'} and the batches live on the mesh.

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

    def windows(self, rows: int) -> NamedSharding:
        """The sharding of windows `[n, rows, T + 1]` (and weights `[n, rows, T]`): rows over data x fsdp."""
        return NamedSharding(self.mesh, P(None, *sharding.batch_spec(axes.MeshShape.of(self.mesh), rows)))

    def abstract(self, state_shapes: Any) -> Any:
        """`state_shapes` (ShapeDtypeStructs) with this layout's shardings: what a restore fills in."""
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            state_shapes, self.state)


def state_layout(config: ExperimentConfig, mesh: Mesh, init_state: Callable) -> StateLayout:
    """The layout of the state `init_state(seed)` returns, by the rules of `jaxattn.sharding`."""
    shape = axes.MeshShape.of(mesh)
    params = sharding.param_layout(config.model, shape)
    shapes = jax.eval_shape(init_state, 0)
    opt_specs = sharding.mirror_specs(shapes["opt_state"], params.specs, shapes["params"])
    specs = {"params": params.specs, "opt_state": opt_specs, "step": P(), "rng": P()}
    state = jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda x: isinstance(x, P))
    batch = NamedSharding(mesh, sharding.batch_spec(shape, config.train.batch_size))
    return StateLayout(mesh=mesh, params=params, state=state, batch=batch)


@dataclasses.dataclass(frozen=True)
class Programs:
    """The jitted functions of a run (each compiles once per distinct input shape).

    Attributes:
      init: (seed) -> state {'params', 'opt_state', 'step', 'rng'}, laid out on the mesh.
      train_steps: (state, windows [n, B, T + 1] int32) -> (state, (losses [n], lrs [n], layer_losses)):
        one optimizer step per batch of the chunk. `layer_losses` is `{name: [n]}`, each loss the
        layers sowed (`jaxattn.layer_losses`), the step's mean over the layers that sowed it: `{}`
        for a dense model; the losses include the sown objective.
      evaluate: (params, windows [n, R, T + 1] int32, weights [n, R, T] float32) -> [n] float32, the
        weighted sum of each batch's next-token losses.
      eval_rows: R of whole-split evaluation (about 256 windows a batch, split like B).
      layout: where everything lives.
    """

    init: Callable
    train_steps: Callable
    evaluate: Callable
    eval_rows: int
    layout: StateLayout
    block_size: int

    def inputs(self, n: int, rows: int) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
        """The abstract windows `[n, rows, T + 1]` and target weights `[n, rows, T]` the programs
        take, laid out on the mesh (what they are compiled for ahead of time)."""
        sharded, T = self.layout.windows(rows), self.block_size
        return (jax.ShapeDtypeStruct((n, rows, T + 1), jnp.int32, sharding=sharded),
                jax.ShapeDtypeStruct((n, rows, T), jnp.float32, sharding=sharded))


def build_programs(config: ExperimentConfig, runtime: Runtime) -> Programs:
    model, tc = DecoderLM(config.model, runtime.kernels), config.train
    optimizer, schedule = make_optimizer(tc, sharding.logical_names(config.model)), lr_schedule(tc)
    dropout = config.model.dropout > 0
    B, T = tc.batch_size, tc.block_size
    eval_rows = B * max(1, 256 // B)

    def init_state(seed):
        params_key, dropout_key = jax.random.split(jax.random.PRNGKey(seed))
        params = nn.unbox(model.init(params_key, jnp.zeros((1, T), jnp.int32))["params"])
        return {"params": params, "opt_state": optimizer.init(params), "step": jnp.int32(0), "rng": dropout_key}

    layout = state_layout(config, runtime.mesh, init_state)
    params_sharding, replicated = layout.state["params"], layout.replicated

    def forward(params, x, **kwargs):
        with axes.activation_rules(layout.mesh):  # rows split through every layer
            return model.apply({"params": params}, x, **kwargs)

    def loss_fn(params, x, y, dropout_key):  # -> (cross entropy + the sown objective, the layers' mean losses)
        rngs = {"dropout": dropout_key} if dropout else None
        logits, sown = forward(params, x, deterministic=not dropout, rngs=rngs, mutable=[layer_losses.COLLECTION])
        means = layer_losses.mean_over_layers(sown)
        return layer_losses.add_objective(cross_entropy(logits, y), means), means

    def one_step(state, window):
        step = state["step"]
        x, y = window[:, :-1], window[:, 1:]  # [B, T] inputs and next-token targets
        args = (state["params"], x, y, jax.random.fold_in(state["rng"], step))
        (loss, sown_means), grads = jax.value_and_grad(loss_fn, has_aux=True)(*args)
        grads = jax.lax.with_sharding_constraint(grads, params_sharding)  # FSDP: reduce-scattered
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        # The lr comes back with the loss so that logging it needs no extra device call.
        state = {**state, "params": params, "opt_state": opt_state, "step": step + 1}
        return state, (loss, schedule(step), sown_means)

    @partial(jax.jit, donate_argnums=(0,), in_shardings=(layout.state, layout.windows(B)),
             out_shardings=(layout.state, replicated))
    def train_steps(state, windows):
        return jax.lax.scan(one_step, state, windows)

    def batch_loss(params, window, weight):  # [R, T + 1], [R, T] -> the weighted sum of R * T losses
        losses = token_losses(forward(params, window[:, :-1]), window[:, 1:])
        return jnp.sum(losses * weight.reshape(-1))

    @partial(jax.jit, in_shardings=(params_sharding, None, None), out_shardings=replicated)
    def evaluate(params, windows, weights):
        return jax.lax.map(lambda batch: batch_loss(params, *batch), (windows, weights))

    init = jax.jit(init_state, static_argnums=(0,), out_shardings=layout.state)
    return Programs(init=init, train_steps=train_steps, evaluate=evaluate, eval_rows=eval_rows, layout=layout,
                    block_size=T)
