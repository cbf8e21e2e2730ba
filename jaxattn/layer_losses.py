"""Losses a layer adds to the training objective beside next-token prediction, sown where they arise.

A layer with such losses (a mixture of experts' router losses, `jaxattn.layers.moe`) sows each one,
a float32 scalar, into the `COLLECTION` under its name. A model applied with
`mutable=[COLLECTION]` returns them; `mean_over_layers` reduces them to one value per name,
the mean over the layers that sowed it (the mean, not the sum, so a coefficient means the same
at any depth), and `add_objective` adds the one named `OBJECTIVE` to a loss. A dense model
sows nothing: its means are an empty dict and its loss is left as it is. So a training step
reads whatever the layers sowed and never asks what kind of layer they were.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

COLLECTION = "layer_losses"
OBJECTIVE = "aux_loss"  # the sown loss a training step adds to its own (already weighted by its layer)


def mean_over_layers(state) -> dict[str, jax.Array]:
    """`{name: mean over the layers that sowed it}` from the mutable variables `state` returned by
    `apply(..., mutable=[COLLECTION])` (a float32 scalar each; `{}` when no layer sowed)."""
    sown: dict[str, list[jax.Array]] = {}
    for path, value in jax.tree_util.tree_leaves_with_path(state.get(COLLECTION, {})):
        names = [key.key for key in path if isinstance(key, jax.tree_util.DictKey)]
        sown.setdefault(str(names[-1]), []).append(value)
    # A scanned period's layers sow one [R] array (one value per repeat): each value is one layer's.
    return {name: jnp.mean(jnp.concatenate([jnp.ravel(v) for v in values])) for name, values in sorted(sown.items())}


def add_objective(loss: jax.Array, means: dict[str, jax.Array]) -> jax.Array:
    """`loss` plus the layers' mean `OBJECTIVE`, where some layer sowed one."""
    return loss + means[OBJECTIVE] if OBJECTIVE in means else loss
