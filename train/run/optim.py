"""The optimizers of the tiny LM: nanoGPT's AdamW, or Muon for the hidden matrices with AdamW for the
rest; the learning-rate schedules (cosine, warmup-stable-decay); the weight-decay mask.

Muon (docs/theory.md §22) orthogonalises each hidden matrix's Nesterov momentum with a Newton-Schulz
iteration (`optax.contrib.scale_by_muon`) and scales it as `optax.contrib.muon` does. Which
parameters it takes is decided by their logical axis names (`jaxattn.sharding.logical_names`), never
by their paths: a matrix whose axes name no token or position table (`TABLE_AXES`) is hidden and
goes to Muon; embeddings, the head, norms, biases and sinks go to AdamW.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from jaxattn.axes import LAYERS
from train.config import TrainConfig
from train.run.adam8bit import adamw_8bit

TABLE_AXES = frozenset({"vocab", "position", "length"})  # rows looked up by token or position
MUON, ADAM = "muon", "adam"
# A scanned model's stacked parameters lead with the LAYERS axis (`jaxattn.scan_plan`): each of its
# slices is one layer's parameter, so every rule below reads the axes after it (a matrix per layer).


def stacked_axes(names: tuple[str | None, ...]) -> int:
    """How many leading axes of a parameter named `names` stack layers (0 or 1)."""
    return int(bool(names) and names[0] == LAYERS)


def lr_schedule(tc: TrainConfig, peak: float | None = None) -> Callable[[jax.Array], jax.Array]:
    """The learning rate at each step: linear warmup to `peak` (default `tc.lr`), then cosine
    (nanoGPT's get_lr) or warmup-stable-decay (flat, then linear over the last `decay_fraction` of
    `lr_decay_iters`), down to `min_lr` scaled like the peak at `lr_decay_iters`, and there after."""
    peak = tc.lr if peak is None else peak
    low = tc.min_lr if peak == tc.lr else tc.min_lr * peak / tc.lr

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        warmup = peak * (step + 1) / (tc.warmup_iters + 1)
        if tc.schedule == "wsd":
            decay_start = tc.lr_decay_iters * (1.0 - tc.decay_fraction)
            window = max(tc.lr_decay_iters - decay_start, 1e-9)  # decay_fraction 0: a step down at the end
            ratio = jnp.where(step >= tc.lr_decay_iters, 1.0, jnp.clip((step - decay_start) / window, 0.0, 1.0))
            after = peak - ratio * (peak - low)
        else:
            ratio = jnp.clip((step - tc.warmup_iters) / max(tc.lr_decay_iters - tc.warmup_iters, 1), 0.0, 1.0)
            after = low + 0.5 * (1.0 + jnp.cos(math.pi * ratio)) * (peak - low)
        return jnp.where(step < tc.warmup_iters, warmup, after)
    return schedule


def momentum_schedule(tc: TrainConfig) -> Callable[[jax.Array], jax.Array]:
    """Muon's momentum: linear from `muon_momentum_start` to `muon_momentum` over `muon_momentum_warmup` steps."""
    def momentum(step):
        if tc.muon_momentum_warmup == 0:
            return jnp.asarray(tc.muon_momentum, jnp.float32)
        ratio = jnp.clip(jnp.asarray(step, jnp.float32) / tc.muon_momentum_warmup, 0.0, 1.0)
        return tc.muon_momentum_start + ratio * (tc.muon_momentum - tc.muon_momentum_start)
    return momentum


def param_group(names: tuple[str | None, ...]) -> str:
    """MUON for a hidden matrix (rank >= 2 per layer, no axis of `TABLE_AXES`), else ADAM."""
    names = names[stacked_axes(names):]
    return MUON if len(names) >= 2 and not TABLE_AXES.intersection(names) else ADAM


def param_groups(logical_names: Any) -> Any:
    """The params tree with each leaf `param_group` of its names; `logical_names` is the tree
    `jaxattn.sharding.logical_names(config)` gives ((names, shape) pairs)."""
    return jax.tree.map(lambda pair: param_group(pair[0]), logical_names, is_leaf=_is_pair)


def muon_dimensions(x: jax.Array, stacked: int = 0) -> optax.contrib.MuonDimensionNumbers:
    """A kernel's first axis after its `stacked` layer axes is its input (`x @ W`): the reduction
    axis; the rest are its outputs (MLA's `[latent, heads, head_dim]` is orthogonalised as one
    `latent x (heads * head_dim)` matrix); the layer axes are a batch of matrices."""
    return optax.contrib.MuonDimensionNumbers(reduction_axis=stacked, output_axis=tuple(range(stacked + 1, x.ndim)))


def shape_scale(shape: tuple[int, ...], stacked: int = 0) -> float:
    """`sqrt(max(1, fan_out / fan_in))`, fan_in the first axis after the `stacked` layer axes
    (`muon_dimensions`): what `optax.contrib.muon` multiplies an orthogonalised update by, so that
    its RMS per output unit does not shrink as a matrix gets wider (Jordan's Muon)."""
    shape = shape[stacked:]
    return math.sqrt(max(1.0, math.prod(shape[1:]) / shape[0]))


def _is_embedding(path) -> bool:
    names = [str(getattr(k, "key", getattr(k, "name", k))).lower() for k in path]
    return any("embed" in n or n in ("wte", "wpe") for n in names)


def decay_mask(params: Any, decay_embeddings: bool, stacked: Any = None) -> Any:
    """True where weight decay applies: matrices (ndim >= 2 per layer: `stacked` is a tree of each
    leaf's layer axes, `stacked_of`; None = none stacked), embeddings only if asked."""
    stacked = jax.tree.map(lambda _: 0, params) if stacked is None else stacked
    return jax.tree_util.tree_map_with_path(
        lambda path, p, lead: p.ndim - lead >= 2 and (decay_embeddings or not _is_embedding(path)), params, stacked)


def stacked_of(logical_names: Any) -> Any:
    """The params tree with each leaf its number of stacked layer axes (`stacked_axes`)."""
    return jax.tree.map(lambda pair: stacked_axes(pair[0]), logical_names, is_leaf=_is_pair)


def _is_pair(x) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], tuple)


def _adamw(tc: TrainConfig, stacked: Any = None) -> optax.GradientTransformation:
    mask = lambda params: decay_mask(params, tc.decay_embeddings,  # noqa: E731 (masked leaves: the subtree)
                                     None if stacked is None else _matching(stacked, params))
    adamw = adamw_8bit if tc.adam_states == "int8" else optax.adamw
    return adamw(lr_schedule(tc), b1=tc.beta1, b2=tc.beta2, weight_decay=tc.weight_decay, mask=mask)


def _matching(stacked: Any, tree: Any) -> Any:
    """`stacked` cut to the leaves `tree` has (a partition hands each optimizer a masked tree)."""
    return jax.tree.map(lambda lead, sub: jax.tree.map(lambda _: lead, sub), stacked, tree)


def _muon(tc: TrainConfig, stacked: Any) -> optax.GradientTransformation:
    """Nesterov momentum (warmed up), Newton-Schulz orthogonalisation, `shape_scale`, decoupled
    weight decay, the scheduled `muon_lr`; `stacked` gives each leaf's layer axes (`stacked_of`)."""
    def dimensions(updates):  # masked leaves (another group's) are empty subtrees and skip
        return jax.tree.map(lambda lead, u: jax.tree.map(lambda x: muon_dimensions(x, lead), u), stacked, updates)
    orthogonalise = optax.inject_hyperparams(
        optax.contrib.scale_by_muon, static_args=("ns_coeffs", "ns_steps", "eps", "mu_dtype", "nesterov",
                                                  "adaptive", "preconditioning", "weight_dimension_numbers"))
    return optax.chain(
        orthogonalise(beta=momentum_schedule(tc), nesterov=True, weight_dimension_numbers=dimensions),
        optax.stateless(lambda updates, params: jax.tree.map(
            lambda lead, u: jax.tree.map(lambda x: x * shape_scale(x.shape, lead), u), stacked, updates)),
        optax.add_decayed_weights(tc.weight_decay),
        optax.scale_by_learning_rate(lr_schedule(tc, tc.muon_lr)))


def make_optimizer(tc: TrainConfig, logical_names: Any = None) -> optax.GradientTransformation:
    """`tc.optimizer`: "adamw" (nanoGPT's: AdamW, decay on matrices only) or "muon" (Muon for the
    hidden matrices, that AdamW for the rest; needs the model's `logical_names`), after global-norm
    clipping when `grad_clip > 0`; AdamW's moments as `tc.adam_states` says (train.run.adam8bit)."""
    if tc.optimizer == "muon":
        if logical_names is None:
            raise ValueError("make_optimizer: optimizer 'muon' needs the model's logical_names "
                             "(jaxattn.sharding.logical_names(config))")
        stacked = stacked_of(logical_names)
        optimizer = optax.partition({MUON: _muon(tc, stacked), ADAM: _adamw(tc, stacked)}, param_groups(logical_names))
    else:
        optimizer = _adamw(tc, None if logical_names is None else stacked_of(logical_names))
    if tc.grad_clip > 0:
        return optax.chain(optax.clip_by_global_norm(tc.grad_clip), optimizer)
    return optimizer
