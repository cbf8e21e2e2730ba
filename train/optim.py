"""The optimizer of the tiny LM: nanoGPT's AdamW, learning-rate schedule and weight-decay mask."""

from __future__ import annotations

import math
from functools import partial
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from train.config import TrainConfig


def lr_schedule(tc: TrainConfig) -> Callable[[jax.Array], jax.Array]:
    """nanoGPT's get_lr: linear warmup to lr, cosine decay to min_lr at lr_decay_iters, then min_lr."""
    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        warmup = tc.lr * (step + 1) / (tc.warmup_iters + 1)
        ratio = jnp.clip((step - tc.warmup_iters) / max(tc.lr_decay_iters - tc.warmup_iters, 1), 0.0, 1.0)
        cosine = tc.min_lr + 0.5 * (1.0 + jnp.cos(math.pi * ratio)) * (tc.lr - tc.min_lr)
        return jnp.where(step < tc.warmup_iters, warmup, cosine)
    return schedule


def _is_embedding(path) -> bool:
    names = [str(getattr(k, "key", getattr(k, "name", k))).lower() for k in path]
    return any("embed" in n or n in ("wte", "wpe") for n in names)


def decay_mask(params: Any, decay_embeddings: bool) -> Any:
    """True where weight decay applies: matrices (ndim >= 2), embeddings only if asked."""
    return jax.tree_util.tree_map_with_path(
        lambda path, p: p.ndim >= 2 and (decay_embeddings or not _is_embedding(path)), params)


def make_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
    """AdamW with nanoGPT's schedule, global-norm clipping and decay on matrices only."""
    adamw = optax.adamw(lr_schedule(tc), b1=tc.beta1, b2=tc.beta2, weight_decay=tc.weight_decay,
                        mask=partial(decay_mask, decay_embeddings=tc.decay_embeddings))
    if tc.grad_clip > 0:
        return optax.chain(optax.clip_by_global_norm(tc.grad_clip), adamw)
    return adamw
