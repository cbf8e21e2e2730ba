"""Embeddings of a decoder: its last layer's hidden state, after the final norm, pooled over a text and
normalised.

    embedder = Embedder(engine.base_params, engine.config, kernels=engine.kernels, max_len=engine.max_model_len)
    vector = embedder.embed([5, 6, 7])        # float32 [d_model], unit length

The pooling is vLLM's for a decoder served as an embedding model without a pooling config of its own:
the last token's hidden state (a causal model's only state that has read the whole text), L2-normalised
(`pooling="mean"` averages every token's state instead). It is the model's whole-sequence forward
(`DecoderLM.hidden`, then `final_norm`), not the paged step: embeddings read no cache and write none.

Each text runs alone, right-padded to the smallest length bucket that holds it (`buckets`: a few
lengths growing four times, the last `max_len`), so at most `len(buckets)` programs are compiled, each
the first time a text of its length comes. Padding changes nothing before it (the attention is causal).
An `Embedder` holds no state between calls; it uses the device, so a server runs it on the thread that
runs the engine's steps (`jaxattn.serving.api.runner.EngineRunner.call`), between two steps.
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn.config import ModelConfig
from jaxattn.kernels import Kernels
from jaxattn.model import DecoderLM

Pooling = Literal["last", "mean"]
POOLINGS = ("last", "mean")
SMALLEST_BUCKET = 64
NORM_EPS = 1e-12  # torch.nn.functional.normalize's, as vLLM normalises


def buckets(max_len: int) -> tuple[int, ...]:
    """The padded lengths: 64, 256, 1024, ... while shorter than `max_len`, then `max_len`."""
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    lengths, size = [], SMALLEST_BUCKET
    while size < max_len:
        lengths.append(size)
        size *= 4
    return (*lengths, max_len)


def final_hidden(model: DecoderLM, tokens):
    """`[B, T] -> [B, T, D]`: the last layer's state after the final norm (what the head reads)."""
    return model.final_norm(model.hidden(tokens))


class Embedder:
    """A decoder's text embeddings (see the module docstring).

    Args:
      params: `DecoderLM(config)` parameters (an engine's, placed where they run, will do).
      config: the model.
      kernels: which implementations run it.
      max_len: the longest text, in tokens.
      pooling: "last" (vLLM's default for a decoder) or "mean".
    """

    def __init__(self, params, config: ModelConfig, *, kernels: Kernels = Kernels(), max_len: int,
                 pooling: Pooling = "last"):
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
        self.params, self.config, self.pooling = params, config, pooling
        self.max_len, self.buckets = max_len, buckets(max_len)
        self.dim = config.d_model
        self._program = jax.jit(functools.partial(_pooled, DecoderLM(config, kernels), pooling))

    def embed(self, ids, *, normalize: bool = True) -> np.ndarray:
        """The float32 `[d_model]` embedding of one text's ids (unit length when `normalize`).

        ValueError for no ids, ids outside the vocabulary, or more than `max_len` of them.
        """
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            raise ValueError("an embedding needs at least one token")
        if ids.size > self.max_len:
            raise ValueError(f"{ids.size} tokens, more than the {self.max_len} this model reads")
        if ids.min() < 0 or ids.max() >= self.config.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.config.vocab_size}), got {ids.min()}..{ids.max()}")
        size = next(b for b in self.buckets if b >= ids.size)
        tokens = np.zeros((1, size), np.int32)
        tokens[0, :ids.size] = ids
        pooled = self._program(self.params, jnp.asarray(tokens), jnp.int32(ids.size))
        pooled = np.asarray(pooled, dtype=np.float32)
        return pooled / max(float(np.linalg.norm(pooled)), NORM_EPS) if normalize else pooled


def _pooled(model: DecoderLM, pooling: Pooling, params, tokens, length):
    """The pooled float32 state `[D]` of `tokens [1, T]`, whose first `length` are the text."""
    states = model.apply({"params": params}, tokens, method=final_hidden)[0].astype(jnp.float32)  # [T, D]
    if pooling == "last":
        return jax.lax.dynamic_index_in_dim(states, length - 1, axis=0, keepdims=False)
    inside = (jnp.arange(states.shape[0]) < length)[:, None]
    return jnp.sum(jnp.where(inside, states, 0.0), axis=0) / length
