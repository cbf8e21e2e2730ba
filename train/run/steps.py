"""The jitted programs of a training run: init, `steps_per_dispatch` optimizer steps, evaluation.

One call of `train_steps` runs n optimizer steps inside `lax.scan` over the n batches of
the chunk, read on the host beforehand (`train.data.batches`): windows `[n, B, T + 1]` whose
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
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxattn import axes, layer_losses, lora, sharding
from jaxattn.model import DecoderLM
from jaxattn.scan_plan import relayout
from train.checkpoints.init_from import Initial, params_for
from train.config import ExperimentConfig
from train.run.optim import lr_schedule, make_optimizer
from train.run.runtime import Runtime

ADAPTER_SEED = 7  # folded into the run's seed for the adapters' initialisation


def token_losses(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Next-token losses in float32 `[B*T]`; logits `[B, T, V]`, targets `[B, T]`."""
    logits = logits.reshape(-1, logits.shape[-1]).astype(jnp.float32)  # [B*T, V]
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets.reshape(-1))


def cross_entropy(logits: jax.Array, targets: jax.Array, weights: jax.Array | None = None) -> jax.Array:
    """Mean next-token loss in float32; logits `[B, T, V]`, targets `[B, T]`; with `weights [B, T]` the
    weighted mean (what a packed batch counts: its documents' predictions, 0 for a batch that counts none)."""
    return mean_loss(token_losses(logits, targets), weights)


def mean_loss(losses: jax.Array, weights: jax.Array | None = None) -> jax.Array:
    """The mean of per-token losses `[B*T]`, or with `weights [B, T]` their weighted mean (`cross_entropy`)."""
    if weights is None:
        return losses.mean()
    weights = weights.reshape(-1).astype(jnp.float32)
    return jnp.sum(losses * weights) / jnp.maximum(jnp.sum(weights), 1.0)


def model_inputs(batch: Any) -> tuple[jax.Array, jax.Array, jax.Array | None, dict]:
    """(inputs `[B, T]`, targets `[B, T]`, weights `[B, T]` or None, what else the model takes) of a batch:
    a window `[B, T + 1]` (inputs its first T tokens, targets its last T), or packed documents
    (`train.data.packed_batches`: their segment ids and positions keep attention within each document)."""
    if isinstance(batch, dict):
        where = {"segment_ids": batch["segment_ids"], "positions": batch["positions"]}
        return batch["inputs"], batch["targets"], batch.get("weights"), where
    return batch[:, :-1], batch[:, 1:], None, {}


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


def state_layout(config: ExperimentConfig, mesh: Mesh, init_state: Callable, *, adapters: bool = False
                 ) -> StateLayout:
    """The layout of the state `init_state(seed)` returns, by the rules of `jaxattn.sharding`.

    `adapters`: the state's params are LoRA adapters (`jaxattn.lora`), small: replicated, as their
    optimizer state."""
    shape = axes.MeshShape.of(mesh)
    params = sharding.param_layout(config.model, shape)
    shapes = jax.eval_shape(init_state, 0)
    param_specs = jax.tree.map(lambda _: P(), shapes["params"]) if adapters else params.specs
    opt_specs = sharding.mirror_specs(shapes["opt_state"], param_specs, shapes["params"])
    specs = {"params": param_specs, "opt_state": opt_specs, "step": P(), "rng": P()}
    state = jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda x: isinstance(x, P))
    batch = NamedSharding(mesh, sharding.batch_spec(shape, config.train.batch_size))
    return StateLayout(mesh=mesh, params=params, state=state, batch=batch)


@dataclasses.dataclass(frozen=True)
class Programs:
    """The jitted functions of a run (each compiles once per distinct input shape).

    Attributes:
      init: (seed) -> state {'params', 'opt_state', 'step', 'rng'}, laid out on the mesh: the params
        drawn at random, or a checkpoint's (`train.init_from`); with LoRA the state's params are the
        adapters alone (`jaxattn.lora.split_lora`).
      train_steps: (state, windows [n, B, T + 1] int32, frozen) -> (state, (losses [n], lrs [n],
        layer_losses)): one optimizer step per batch of the chunk. `layer_losses` is `{name: [n]}`,
        each loss the layers sowed (`jaxattn.layer_losses`), the step's mean over the layers that
        sowed it: `{}` for a dense model; the losses include the sown objective.
      evaluate: (params, windows [n, R, T + 1] int32, weights [n, R, T] float32, frozen) -> [n]
        float32, the weighted sum of each batch's next-token losses.
      eval_rows: R of whole-split evaluation (about 256 windows a batch, split like B).
      layout: where everything lives.
      frozen: what the programs take besides the state and is never trained: a LoRA run's base
        (`jaxattn.lora.split_lora`'s frozen part, laid out on the mesh as the model's params), `{}`
        for every other run. The programs' last argument.
    """

    init: Callable
    train_steps: Callable
    evaluate: Callable
    eval_rows: int
    layout: StateLayout
    block_size: int
    frozen: Any = dataclasses.field(default_factory=dict)

    def model_params(self, params: Any) -> Any:
        """The model's whole params from the state's: a LoRA run's adapters merged into its frozen base
        (`jaxattn.lora.merge_lora`: plain params, which sample, shard and count as any model's)."""
        return lora.merge_lora(lora.combine_lora(self.frozen, params)) if self.frozen else params

    def inputs(self, n: int, rows: int, packed: bool = False) -> tuple[Any, jax.ShapeDtypeStruct]:
        """What `evaluate` takes, abstract and laid out on the mesh (what it is compiled for ahead of
        time): windows `[n, rows, T + 1]` (`packed`: batches of packed documents, `train.data.packed_batches`,
        `{inputs, targets, segment_ids, positions: [n, rows, T]}`) and the target weights `[n, rows, T]`."""
        sharded, T = self.layout.windows(rows), self.block_size
        ids = lambda width: jax.ShapeDtypeStruct((n, rows, width), jnp.int32, sharding=sharded)  # noqa: E731
        weights = jax.ShapeDtypeStruct((n, rows, T), jnp.float32, sharding=sharded)
        if packed:
            return {field: ids(T) for field in ("inputs", "targets", "segment_ids", "positions")}, weights
        return ids(T + 1), weights

    def train_inputs(self, n: int, rows: int, packed: bool = False) -> Any:
        """What `train_steps` takes besides the state, abstract: windows `[n, rows, T + 1]`, or packed
        batches with their weights (`{inputs, targets, weights, segment_ids, positions: [n, rows, T]}`)."""
        batch, weights = self.inputs(n, rows, packed)
        return {**batch, "weights": weights} if packed else batch


def build_programs(config: ExperimentConfig, runtime: Runtime, initial: Initial | None = None) -> Programs:
    """The run's programs; `initial`: the checkpoint it starts from (`train.init_from`), whose params
    (and, with `config.lora`, adapters on them) replace the random initialisation."""
    model, tc = DecoderLM(config.model, runtime.kernels), config.train
    adapters = config.lora is not None
    optimizer = make_optimizer(tc, None if adapters else sharding.logical_names(config.model))
    B, T = tc.batch_size, tc.block_size
    start_state, init_state = _state_makers(model, optimizer, T)
    frozen, trained = {}, None
    if initial is not None:
        trained, frozen = start_params(config, initial)
        layout = state_layout(config, runtime.mesh, lambda seed: start_state(trained, seed), adapters=adapters)
    else:
        layout = state_layout(config, runtime.mesh, init_state)
    frozen_sharding = frozen_layout(frozen, layout)
    frozen = jax.device_put(frozen, frozen_sharding)
    forward_losses = _forward_losses(model, layout.mesh, adapters)
    train_steps = _train_steps(config, optimizer, forward_losses, layout, frozen_sharding)
    evaluate = _evaluate(forward_losses, layout, frozen_sharding)
    if initial is None:
        init = jax.jit(init_state, static_argnums=(0,), out_shardings=layout.state)
    else:
        # each call places the host params anew, so the placed copy can become the state's (donated)
        start = jax.jit(start_state, static_argnums=(1,), donate_argnums=(0,), out_shardings=layout.state)
        init = lambda seed: start(jax.device_put(trained, layout.state["params"]), seed)  # noqa: E731
    return Programs(init=init, train_steps=train_steps, evaluate=evaluate, eval_rows=B * max(1, 256 // B),
                    layout=layout, block_size=T, frozen=frozen)


def _state_makers(model: DecoderLM, optimizer: optax.GradientTransformation, T: int) -> tuple[Callable, Callable]:
    """(start_state(params, seed), init_state(seed)): the whole train state from trained params, and
    from params drawn at random (one key of the seed for the params, the other for dropout)."""

    def start_state(params, seed):  # the trained params -> the whole state
        _, dropout_key = jax.random.split(jax.random.PRNGKey(seed))
        return {"params": params, "opt_state": optimizer.init(params), "step": jnp.int32(0), "rng": dropout_key}

    def init_state(seed):  # from scratch: random params
        params_key, _ = jax.random.split(jax.random.PRNGKey(seed))
        return start_state(nn.unbox(model.init(params_key, jnp.zeros((1, T), jnp.int32))["params"]), seed)

    return start_state, init_state


def _forward_losses(model: DecoderLM, mesh: Mesh, adapters: bool) -> Callable:
    """forward_losses(params, frozen, x, y, **kwargs) -> per-token losses [B*T] (and what apply returns);
    with `adapters`, params are a LoRA run's adapters, combined with the frozen base first."""

    def forward_losses(params, frozen, x, y, **kwargs):
        whole = lora.combine_lora(frozen, params) if adapters else params
        with axes.activation_rules(mesh):  # rows split through every layer
            # The head fused with the cross entropy where it is frozen (a LoRA run): no [B, T, V] logits
            # kept, and no more products than the logits' pair. A trained head's gradient would cost
            # one more, so a full run keeps the logits (`DecoderLM.token_losses`).
            return model.apply({"params": whole}, x, y, fused=adapters, method=DecoderLM.token_losses, **kwargs)

    return forward_losses


def _train_steps(config: ExperimentConfig, optimizer: optax.GradientTransformation, forward_losses: Callable,
                 layout: StateLayout, frozen_sharding: Any) -> Callable:
    """The jitted `Programs.train_steps`: one optimizer step per batch of the chunk, inside `lax.scan`."""
    schedule = lr_schedule(config.train)
    dropout = config.model.dropout > 0 or (config.lora is not None and config.lora.dropout > 0)
    params_sharding = layout.state["params"]

    def loss_fn(params, frozen, batch, dropout_key):  # -> (cross entropy + the sown objective, the layers' mean losses)
        x, y, weights, where = model_inputs(batch)
        rngs = {"dropout": dropout_key} if dropout else None
        losses, sown = forward_losses(params, frozen, x, y, deterministic=config.model.dropout == 0, rngs=rngs,
                                      mutable=[layer_losses.COLLECTION], **where)
        means = layer_losses.mean_over_layers(sown)
        return layer_losses.add_objective(mean_loss(losses, weights), means), means

    def one_step(frozen, state, batch):
        step = state["step"]
        args = (state["params"], frozen, batch, jax.random.fold_in(state["rng"], step))
        (loss, sown_means), grads = jax.value_and_grad(loss_fn, has_aux=True)(*args)
        grads = jax.lax.with_sharding_constraint(grads, params_sharding)  # FSDP: reduce-scattered
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        # The lr comes back with the loss so that logging it needs no extra device call.
        state = {**state, "params": params, "opt_state": opt_state, "step": step + 1}
        return state, (loss, schedule(step), sown_means)

    chunk_sharding = layout.windows(config.train.batch_size)

    @partial(jax.jit, donate_argnums=(0,), in_shardings=(layout.state, chunk_sharding, frozen_sharding),
             out_shardings=(layout.state, layout.replicated))
    def train_steps(state, windows, frozen):
        return jax.lax.scan(partial(one_step, frozen), state, windows)

    return train_steps


def _evaluate(forward_losses: Callable, layout: StateLayout, frozen_sharding: Any) -> Callable:
    """The jitted `Programs.evaluate`: the weighted sum of each batch's next-token losses."""

    def batch_loss(params, frozen, batch, weight):  # [R, T + 1] (or packed), [R, T] -> the weighted sum of R * T losses
        x, y, _, where = model_inputs(batch)
        losses = forward_losses(params, frozen, x, y, **where)
        return jnp.sum(losses * weight.reshape(-1))

    @partial(jax.jit, in_shardings=(layout.state["params"], None, None, frozen_sharding),
             out_shardings=layout.replicated)
    def evaluate(params, windows, weights, frozen):
        return jax.lax.map(lambda batch: batch_loss(params, frozen, *batch), (windows, weights))

    return evaluate


def start_params(config: ExperimentConfig, initial: Initial) -> tuple[Any, Any]:
    """(the params a run from `initial` trains, what it keeps frozen): the checkpoint's params and `{}`
    for a full fine-tune; with `config.lora`, the adapters (`jaxattn.lora.add_lora`, drawn from the
    run's seed) and the base, stored in `lora.base_dtype`. Both in the layout of `config.model`: stacked
    for a scan with `model.scan_layers` (`init_from.params_for`), the adapters drawn per layer first so
    that a run starts from the same ones either way. The checkpoint's arrays are handed on as host
    arrays: the programs place them on the mesh."""
    if config.lora is None:
        return params_for(initial, config.model), {}
    key = jax.random.fold_in(jax.random.PRNGKey(config.train.seed), ADAPTER_SEED)
    drawn_on = config.model.replace(scan_layers=initial.config.scan_layers)  # the checkpoint's layout
    adapters, frozen = lora.split_lora(lora.add_lora(initial.params, drawn_on, config.lora.settings(), key))
    adapters, frozen = (relayout(tree, drawn_on, config.model.scan_layers)[0] for tree in (adapters, frozen))
    if config.lora.base_dtype != "float32":
        dtype = jnp.dtype(config.lora.base_dtype)
        frozen = jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, frozen)
    return adapters, frozen


def frozen_layout(frozen: Any, layout: StateLayout) -> Any:
    """The shardings of a LoRA run's frozen base: each base kernel as the model's parameter at its path
    (the pytree attribute holding it left out of the path), anything else replicated."""
    by_path = {_plain_path(path): spec for path, spec in jax.tree_util.tree_leaves_with_path(
        layout.params.specs, is_leaf=lambda x: isinstance(x, P))}
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: NamedSharding(layout.mesh, by_path.get(_plain_path(path), P())), frozen)


def _plain_path(path) -> tuple[str, ...]:
    return tuple(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))
