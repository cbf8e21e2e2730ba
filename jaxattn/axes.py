"""The names of axes: the device mesh's, the logical ones every array gives its axes, and the one table
that maps the second onto the first (docs/theory.md §16).

The mesh has three axes, `MESH_AXES` (`DATA`, `FSDP`, `TENSOR`), each of any size (1 = unused):

* `data`: the batch is split; parameters and optimizer state are replicated.
* `fsdp`: the batch is split too, and parameters and optimizer state are split
  along their "embed" (or "latent") axis; XLA gathers a layer's weights where
  the layer runs and reduce-scatters its gradients (ZeRO-3 / FSDP).
* `tensor`: attention heads, MLP hidden units and the vocabulary are split
  (Megatron's column/row split); XLA's SPMD partitioner adds the all-reduces.

A mixture-of-experts layer's experts (logical axis "expert") go over `fsdp` first:
each device holds whole experts (expert parallelism) where fsdp divides their number,
and their "embed" axis stays whole; otherwise they split along "embed" like the rest.

Every parameter and every constrained activation names its axes with the constants
below (`EMBED`, `HEADS`, ...; parameters through `jaxattn.layers.primitives.logical`,
activations through `nn.with_logical_constraint`), and one table, `RULES`, maps each
name to mesh axes: `spec_for` for arrays, `activation_rules` for the activations while
a model is traced. Where a mesh axis does not divide what a name counts (GQA's 2 kv
heads on a tensor axis of 4, a 65-character vocabulary, MLA's latent), that axis is
replicated instead and `spec_for` says so. The batch, the query heads, the MLP hidden
size and d_model are never left to that: `check_mesh` names the mesh axis and the size
that do not divide.

This module is a floor the layers stand on: it knows no model. Where a whole model's
parameters, optimizer state and caches go on a mesh is `jaxattn.sharding`, above the model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from jaxattn._validate import is_int
from jaxattn.config import ModelConfig

# ------------------------------------------------------------------------- the vocabulary

# The mesh axes.
DATA, FSDP, TENSOR = "data", "fsdp", "tensor"
MESH_AXES = (DATA, FSDP, TENSOR)

# The logical axes: every name the model's parameters, caches and activations give their axes.
BATCH = "batch"  # a batch's rows (activations, data, caches)
LENGTH = "length"  # a sequence's positions, a cache's slots
EMBED = "embed"  # a parameter's model width, d_model
HEADS = "heads"  # query heads (N, or their N x H columns)
KV_HEADS = "kv_heads"  # key/value heads (K, or their K x H columns)
QKV = "qkv"  # the fused [Q | K | V] columns
HEAD_DIM = "head_dim"  # the H dimensions of one head
MLP = "mlp"  # MLP hidden units
VOCAB = "vocab"  # a token table's rows, the logits' columns
LATENT = "latent"  # MLA's compressed widths
EXPERT = "expert"  # MoE experts
POSITION = "position"  # a learned position table's rows
LAYERS = "layers"  # the repeats of a scanned period of layers (`jaxattn.scan_plan`), never split
# The activations' own names where their layout differs from the parameters' of the same meaning:
ACTIVATION_EMBED = "activation_embed"  # the residual stream's width: whole, while the parameters' "embed" splits
ACTIVATION_VOCAB = "activation_vocab"  # a table's rows gathered whole for a lookup, while "vocab" splits

# Logical axis -> the mesh axes it is split over, in order (none: replicated). The one table
# behind parameters (`spec_for`, which also replicates what a mesh axis cannot divide) and
# activations (`activation_rules`).
RULES: dict[str, tuple[str, ...]] = {
    BATCH: (DATA, FSDP),
    EMBED: (FSDP,),
    LATENT: (FSDP,),  # stored split, never split over tensor: every head reads all of it
    HEADS: (TENSOR,),
    KV_HEADS: (TENSOR,),
    QKV: (TENSOR,),
    MLP: (TENSOR,),
    VOCAB: (TENSOR,),
    HEAD_DIM: (),
    POSITION: (),
    LAYERS: (),
    LENGTH: (),
    EXPERT: (FSDP,),  # whole experts per device (expert parallelism over fsdp)
    ACTIVATION_EMBED: (),
    ACTIVATION_VOCAB: (),
}


def _spec_entry(axes) -> str | tuple[str, ...] | None:
    """A PartitionSpec entry for splitting one array axis over `axes` (in order)."""
    return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


@contextlib.contextmanager
def activation_rules(mesh: Mesh):
    """While tracing a model on `mesh`: its constrained activations lie as `RULES` says (the
    residual stream, `jaxattn.layers.block.RESIDUAL_AXES`, split by rows and whole along its width)."""
    rules = tuple((name, _spec_entry(axes)) for name, axes in RULES.items())
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), nn.logical_axis_rules(rules):
        yield


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """The size of each mesh axis; the product is the number of devices."""

    data: int = 1
    fsdp: int = 1
    tensor: int = 1

    def __post_init__(self):
        for axis in MESH_AXES:
            size = getattr(self, axis)
            if not is_int(size, numpy=False) or size < 1:
                raise ValueError(f"mesh axis {axis} must have a positive integer size, got {size!r}")

    @classmethod
    def parse(cls, text: str) -> "MeshShape":
        """'data:2,fsdp:2,tensor:2' (any axis may be left out, sizes default to 1)."""
        sizes = {}
        for item in filter(None, (part.strip() for part in str(text).split(","))):
            match = re.fullmatch(r"(\w+)\s*[:=]\s*(\d+)", item)
            if not match or match[1] not in MESH_AXES:
                raise ValueError(f"mesh {text!r}: each item must be AXIS:SIZE with AXIS one of {MESH_AXES}, "
                                 f"got {item!r}")
            if match[1] in sizes:
                raise ValueError(f"mesh {text!r} names axis {match[1]} twice")
            sizes[match[1]] = int(match[2])
        if not sizes:
            raise ValueError(f"mesh {text!r} names no axis; e.g. data:2,fsdp:2,tensor:2")
        return cls(**sizes)

    @classmethod
    def of(cls, mesh: Mesh) -> "MeshShape":
        return cls(**{axis: mesh.shape.get(axis, 1) for axis in MESH_AXES})

    def __str__(self) -> str:
        return ",".join(f"{axis}:{getattr(self, axis)}" for axis in MESH_AXES)

    @property
    def size(self) -> int:
        return self.data * self.fsdp * self.tensor

    @property
    def batch_ways(self) -> int:
        """How many pieces the batch is split into (data x fsdp)."""
        return self.data * self.fsdp


def make_mesh(shape: MeshShape, devices=None) -> Mesh:
    """A mesh with axes `MESH_AXES` over `devices` (default: all of JAX's, every process's).

    Devices are laid out process-major, so each process holds whole rows of the data axis
    where it can. ValueError unless the mesh uses exactly the devices given.
    """
    devices = jax.devices() if devices is None else list(devices)
    if shape.size != len(devices):
        raise ValueError(f"mesh {shape} uses {shape.size} device(s) but there are {len(devices)} "
                         "(on a CPU, setting JAX's `jax_num_cpu_devices` before JAX starts makes that many "
                         "host devices)")
    grid = np.asarray(devices, dtype=object).reshape(shape.data, shape.fsdp, shape.tensor)
    return Mesh(grid, MESH_AXES)


def check_mesh(config: ModelConfig | None, shape: MeshShape, batch_size: int | None = None) -> None:
    """ValueError naming the mesh axis and the size it does not divide (the batch, and `config`'s
    query heads, MLP hidden size and d_model where given)."""
    needs = [(f"{DATA} x {FSDP}", shape.batch_ways, "the batch size", batch_size)]
    if config is not None:
        needs += [(TENSOR, shape.tensor, "num_heads", config.num_heads),
                  (TENSOR, shape.tensor, "the MLP hidden size", config.mlp_hidden),
                  (FSDP, shape.fsdp, "d_model", config.d_model)]
    for axis, ways, what, size in needs:
        if size is not None and size % ways:
            raise ValueError(f"mesh {shape}: {axis} = {ways} does not divide {what} = {size}")


# ------------------------------------------------------------------------- logical names -> specs

def logical_counts(config: ModelConfig) -> dict[str, int]:
    """What each logical name counts, where that differs from the axis length (heads, not N x H)."""
    return {HEADS: config.num_heads, KV_HEADS: config.num_kv_heads, QKV: config.num_heads + 2 * config.num_kv_heads}


def spec_for(names, shape, mesh: MeshShape, counts: dict[str, int] | None = None) -> tuple[P, list[str]]:
    """The PartitionSpec of an array whose axes are named `names`, and why any axis was replicated."""
    counts, used, entries, notes = counts or {}, set(), [], []
    for name, length in zip(names, shape):
        if name is not None and name not in RULES:
            raise ValueError(f"no sharding rule for the logical axis {name!r}; rules: {sorted(RULES)}")
        axes, ways = [], 1
        for axis in RULES.get(name, ()) if name is not None else ():
            size = getattr(mesh, axis)
            if size == 1 or axis in used:
                continue
            count = counts.get(name, length)
            if length % (ways * size) or count % (ways * size):
                notes.append(f"{name} ({count}) is replicated over {axis} ({size}), which does not divide it")
                continue
            axes.append(axis)
            used.add(axis)
            ways *= size
        entries.append(_spec_entry(axes))
    return P(*entries), notes
