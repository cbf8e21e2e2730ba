"""Which layers of a model run under one scan, and the parameter and cache layouts that follow.

With `ModelConfig.scan_layers`, the model compiles its repeated layers once: a `jax.lax.scan`
(through `nn.scan`) steps over R repeats of a period of P layers whose parameters are stacked
along a leading "layers" axis. Layers that differ from the period stay unrolled before it (the
`prefix`: DeepSeek's dense first layers) or after it (the `suffix`: what is left when P does
not divide the rest). Two layers may share a scan step's program when everything the layer
index decides is equal: its attention (`ModelConfig.layer_attention`: window, RoPE, sinks),
whether its MLP is a mixture of experts, and whether it has a value-embedding table. Gemma 3's
five local and one global layer make P = 6; a uniform model P = 1.

Parameters (`DecoderLM.init`): the unrolled layers keep their names `blocks_{i}`; the scanned
ones live under `layers/blocks_{j}` (j < P), each leaf `[R, ...]`, repeat r of block j being
layer `first + r * P + j`. `stack_params` and `unstack_params` convert between that layout and
the unrolled one (`blocks_{i}` for every layer), which is what Hugging Face export, older
checkpoints and per-layer tools read. A dense cache (`DecodeCache.layers`) follows the same
order: one container per unrolled layer and one per period position with leading `[R]`
(`stack_caches`, `unstack_caches`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn.axes import LAYERS
from jaxattn.config import ModelConfig

SCANNED = LAYERS  # the parameter subtree of the scanned layers, named as their logical axis


def _signature(config: ModelConfig, i: int) -> tuple:
    """Everything layer i's program depends on besides its weights."""
    return (config.layer_attention(i), config.layer_is_moe(i), config.value_embedding_table(i) is not None)


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """Layers `0 .. first - 1` unrolled, then `repeats` x `period` scanned, then the rest unrolled.

    Attributes:
      num_layers: the model's layers.
      first: the first scanned layer (the prefix is `range(first)`).
      period: P, layers per scan step.
      repeats: R, scan steps (0: nothing is scanned).
    """

    num_layers: int
    first: int
    period: int
    repeats: int

    @property
    def prefix(self) -> tuple[int, ...]:
        return tuple(range(self.first))

    @property
    def suffix(self) -> tuple[int, ...]:
        return tuple(range(self.first + self.period * self.repeats, self.num_layers))

    def layer(self, repeat: int, position: int) -> int:
        """The model layer that scan step `repeat` runs as its block `position`."""
        return self.first + repeat * self.period + position

    @property
    def units(self) -> tuple[tuple[str, int], ...]:
        """The model's layer units in order: ("layer", i) unrolled, ("scanned", j) a period position."""
        scanned = range(self.period) if self.repeats else ()
        return (tuple(("layer", i) for i in self.prefix) + tuple(("scanned", j) for j in scanned)
                + tuple(("layer", i) for i in self.suffix))

    def unit_layers(self) -> tuple[tuple[int, ...], ...]:
        """Per unit (as `units`), the model layers it holds, in order."""
        return tuple((i,) if kind == "layer" else tuple(self.layer(r, i) for r in range(self.repeats))
                     for kind, i in self.units)


@functools.lru_cache(maxsize=64)
def plan_layers(config: ModelConfig) -> LayerPlan:
    """The scan plan of `config`: the fewest distinct layer programs (unrolled layers plus one
    period), the earliest start on a tie. Without `config.scan_layers` nothing is scanned."""
    L = config.num_layers
    if not config.scan_layers:
        return LayerPlan(L, first=L, period=1, repeats=0)
    signatures = [_signature(config, i) for i in range(L)]
    best = LayerPlan(L, first=L, period=1, repeats=0)
    for first in range(L):
        for period in range(1, (L - first) // 2 + 1):
            repeats = 1  # how many times the period starting at `first` repeats in a row
            while first + (repeats + 1) * period <= L and all(
                    signatures[first + repeats * period + j] == signatures[first + j] for j in range(period)):
                repeats += 1
            if repeats < 2:
                continue
            candidate = LayerPlan(L, first, period, repeats)
            if _programs(candidate) < _programs(best):
                best = candidate
    return best


def _programs(plan: LayerPlan) -> int:
    return len(plan.prefix) + len(plan.suffix) + (plan.period if plan.repeats else 0)


def _blocks(j: int) -> str:
    return f"blocks_{j}"


def stack_params(params: Any, config: ModelConfig) -> Any:
    """An unrolled parameter tree (`blocks_{i}` for every layer; unboxed) in `config`'s scan layout.

    A tree already in the scan layout, or a config that scans nothing, comes back as it is.
    """
    plan = plan_layers(config)
    if not plan.repeats or SCANNED in params:
        return params
    out = {name: value for name, value in params.items()
           if not (name.startswith("blocks_") and int(name[len("blocks_"):]) in _scanned(plan))}
    missing = [_blocks(i) for i in _scanned(plan) if _blocks(i) not in params]
    if missing:
        raise ValueError(f"params lack the layers {missing[:3]}{'...' if len(missing) > 3 else ''} "
                         f"of a {config.num_layers}-layer model")
    out[SCANNED] = {_blocks(j): jax.tree.map(_stack,
                                             *[params[_blocks(plan.layer(r, j))] for r in range(plan.repeats)])
                    for j in range(plan.period)}
    return type(params)(out) if isinstance(params, dict) else out


def _stack(*leaves: Any) -> Any:
    # host arrays stay on the host (a checkpoint read for a run is placed on its mesh later), others on JAX's device
    return np.stack(leaves) if all(isinstance(leaf, np.ndarray) for leaf in leaves) else jnp.stack(leaves)


def unstack_params(params: Any, config: ModelConfig) -> Any:
    """A parameter tree in `config`'s scan layout (unboxed) as the unrolled one (`blocks_{i}` for
    every layer). An unrolled tree comes back as it is."""
    if SCANNED not in params:
        return params
    plan = plan_layers(config)
    out = {name: value for name, value in params.items() if name != SCANNED}
    for j in range(plan.period):
        stacked = params[SCANNED][_blocks(j)]
        for r in range(plan.repeats):
            out[_blocks(plan.layer(r, j))] = jax.tree.map(lambda leaf: leaf[r], stacked)
    return dict(sorted(out.items(), key=lambda item: _order(item[0])))


def relayout(params: Any, config: ModelConfig, scan_layers: bool) -> tuple[Any, ModelConfig]:
    """`(params, config)` with `config.scan_layers` set to `scan_layers` and the parameters (unboxed,
    unrolled or stacked) converted to its layout: the same model, compiled once or layer by layer."""
    unrolled = unstack_params(params, config) if config.scan_layers else params
    target = config.replace(scan_layers=scan_layers)
    return (stack_params(unrolled, target) if scan_layers else unrolled), target


def _scanned(plan: LayerPlan) -> set[int]:
    return {plan.layer(r, j) for r in range(plan.repeats) for j in range(plan.period)}


def _order(name: str) -> tuple:
    return (1, int(name[len("blocks_"):]), "") if name.startswith("blocks_") else (0, 0, name)


def stack_caches(layers: tuple, config: ModelConfig) -> tuple:
    """Per-layer cache containers (one per model layer) in `config`'s unit order (see module doc)."""
    plan = plan_layers(config)
    if len(layers) != config.num_layers:
        raise ValueError(f"expected {config.num_layers} layer caches, got {len(layers)}")
    return tuple(layers[held[0]] if kind == "layer" else jax.tree.map(lambda *a: jnp.stack(a),
                                                                         *[layers[i] for i in held])
                 for (kind, _), held in zip(plan.units, plan.unit_layers()))


def unstack_caches(units: tuple, config: ModelConfig) -> tuple:
    """Cache containers in `config`'s unit order as one per model layer, in layer order."""
    plan = plan_layers(config)
    per_layer: dict[int, Any] = {}
    for (kind, _), held, unit in zip(plan.units, plan.unit_layers(), units):
        for r, i in enumerate(held):
            per_layer[i] = unit if kind == "layer" else jax.tree.map(lambda a: a[r], unit)
    return tuple(per_layer[i] for i in range(config.num_layers))
