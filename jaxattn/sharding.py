"""Where a whole model lives on a device mesh: its parameters, an optimizer state that mirrors them,
its caches and data (docs/theory.md §16).

The names and the rules are `jaxattn.axes` (the floor the layers stand on); this module stands
above the model, whose parameter tree (`jaxattn.model.abstract_params`) it reads for each
parameter's logical names. `param_layout` gives every parameter its `PartitionSpec` by
`jaxattn.axes.RULES` and says in `ParamLayout.notes` which logical axes a mesh axis could not
divide and left replicated; `mirror_specs` lays out a tree of copies of the parameters (Adam's
moments); `cache_specs` and `batch_spec` lay out caches and data by rows; `place` puts host or
device arrays onto the mesh in every process.
Sharding never changes the maths: results equal one device's up to the order of float sums.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxattn.axes import BATCH, MeshShape, logical_counts, spec_for
from jaxattn.cache.containers import DecodeCache
from jaxattn.cache.build import cache_fields
from jaxattn.config import ModelConfig
from jaxattn.model import abstract_params

# ------------------------------------------------------------------------- parameters

@dataclasses.dataclass(frozen=True)
class ParamLayout:
    """Where a model's parameters live on a mesh.

    Attributes:
      names: params tree of tuples, each parameter's logical axis names.
      specs: params tree of `PartitionSpec`s over `MESH_AXES`.
      notes: the logical axes replicated because the mesh does not divide them.
    """

    names: Any
    specs: Any
    notes: tuple[str, ...]

    def shardings(self, mesh: Mesh) -> Any:
        return jax.tree.map(lambda spec: NamedSharding(mesh, spec), self.specs, is_leaf=_is_spec)


def _is_spec(x) -> bool:
    return isinstance(x, P)


def logical_names(config: ModelConfig) -> Any:
    """The params tree of `DecoderLM(config)` with each leaf its logical axis names (nothing allocated)."""
    is_box = lambda x: isinstance(x, nn.LogicallyPartitioned)  # noqa: E731
    return jax.tree.map(lambda box: (tuple(box.names), tuple(box.value.shape)), abstract_params(config),
                        is_leaf=is_box)


@functools.lru_cache(maxsize=32)
def param_layout(config: ModelConfig, mesh: MeshShape) -> ParamLayout:
    """Each parameter's `PartitionSpec` on `mesh` by `jaxattn.axes.RULES`, replicating what cannot split.

    Cached: `generate(..., mesh=)` asks for it on every call (every window of
    `generate_windowed`), and finding the names traces the model's `init`."""
    named, counts, notes = logical_names(config), logical_counts(config), []
    is_pair = lambda x: isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], tuple)  # noqa: E731

    def spec(pair):
        result, why = spec_for(pair[0], pair[1], mesh, counts)
        notes.extend(why)
        return result

    specs = jax.tree.map(spec, named, is_leaf=is_pair)
    names = jax.tree.map(lambda pair: pair[0], named, is_leaf=is_pair)
    return ParamLayout(names=names, specs=specs, notes=tuple(dict.fromkeys(notes)))


def _path_key(path) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def mirror_specs(tree: Any, params_specs: Any, params: Any) -> Any:
    """Specs for a tree that holds copies of the params (an optimizer state: Adam's mu and nu).

    A leaf whose path ends with a parameter's path, or with it and one field more (a moment held
    as codes and scales: the codes), and has its shape gets that parameter's spec; every other
    leaf (step counts, scalars, per-block scales) is replicated.
    """
    by_path = {_path_key(path): (spec, np.shape(leaf)) for (path, spec), leaf in zip(
        jax.tree_util.tree_leaves_with_path(params_specs, is_leaf=_is_spec), jax.tree.leaves(params))}

    def spec(path, leaf):
        key = _path_key(path)
        for end in (len(key), len(key) - 1):
            for start in range(end):
                found = by_path.get(key[start:end])
                if found is not None and found[1] == np.shape(leaf):
                    return found[0]
        return P()

    return jax.tree_util.tree_map_with_path(spec, tree)


# ------------------------------------------------------------------------- data, caches

def batch_spec(mesh: MeshShape, batch_size: int, ndim: int = 2) -> P:
    """`[B, ...]` split over data x fsdp where that divides B (else replicated)."""
    return spec_for((BATCH,) + (None,) * (ndim - 1), (batch_size,) + (1,) * (ndim - 1), mesh)[0]


def cache_specs(cache: DecodeCache, config: ModelConfig, mesh: MeshShape) -> DecodeCache:
    """A `DecodeCache` of PartitionSpecs, by each field's logical axes (`jaxattn.cache.containers.CacheField`):
    rows over data x fsdp, kv heads over tensor (where they divide); a latent every head reads stays whole."""
    counts = logical_counts(config)
    fields = cache_fields(config)

    def spec(field, array):  # an int8 cache's scales by their own field (`CacheField.per_array`)
        axes = field.dense_axes()  # a scanned period's caches lead with [R], never split
        return spec_for((None,) * (array.ndim - len(axes)) + axes, array.shape, mesh, counts)[0]

    def layer(cache_layer):
        return type(cache_layer)(**{name: field.per_array(spec, getattr(cache_layer, name))
                                    for name, field in fields.items()})

    return DecodeCache(layers=tuple(layer(c) for c in cache.layers),
                       lengths=spec_for((BATCH,), cache.lengths.shape, mesh)[0], num_slots=cache.num_slots)


def pool_specs(pools: tuple, config: ModelConfig, mesh: MeshShape) -> tuple:
    """The page pools' PartitionSpecs: kv heads over tensor where they divide, pages whole."""
    counts = logical_counts(config)
    fields = cache_fields(config)

    def spec(field, array):  # int8 pools' scales by their own field (`CacheField.per_array`)
        return spec_for(field.paged_axes(), array.shape, mesh, counts)[0]

    return tuple(type(pool)(**{name: field.per_array(spec, getattr(pool, name)) for name, field in fields.items()})
                 for pool in pools)


def constrain(tree: Any, specs: Any, mesh: Mesh) -> Any:
    """`with_sharding_constraint` of every leaf of `tree` to its spec in `specs` on `mesh`."""
    shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs, is_leaf=_is_spec)
    return jax.lax.with_sharding_constraint(tree, shardings)


def place(tree: Any, shardings: Any) -> Any:
    """Host (numpy) or device arrays as global arrays with `shardings`, in every process.

    Each process supplies the slices its devices hold, from its own identical copy.
    """
    def put(x, sharding):
        if isinstance(x, jax.Array) and (sharding.is_fully_addressable or not x.is_fully_addressable):
            return jax.device_put(x, sharding)  # on this process's devices, or global to global
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.map(put, tree, shardings)


def per_device_bytes(tree: Any) -> int:
    """The bytes one device holds of `tree` (its largest share): what a mesh saves per device."""
    totals: dict = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            totals[shard.device] = totals.get(shard.device, 0) + math.prod(shard.data.shape) * leaf.dtype.itemsize
    return max(totals.values(), default=0)
