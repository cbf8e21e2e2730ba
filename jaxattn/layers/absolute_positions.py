"""The absolute positions a model adds to its token embeddings, one module per kind, chosen once.

`absolute_positions(config)` picks the module for `ModelConfig.positions` (docs/theory.md §7):

| positions | module | adds to the embeddings `[B, T, D]` |
| --- | --- | --- |
| "learned" | `LearnedPositions` | GPT-2's `wpe`: a learned row `[D]` per absolute position |
| "sinusoidal" | `SinusoidalPositions` | Vaswani et al.'s fixed table (`jaxattn.positions.sinusoidal_positions`) |
| "rope", "none" | `NoAbsolutePositions` | nothing: RoPE rotates queries and keys in each attention layer |

Each has `add_to(x, positions)`, with positions `[B, T]` or `[T]`, and `max_positions`, the
length of its table (None without one). A table is indexed by absolute position; one past its
end is clamped to the last row (so the model refuses longer sequences first).
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from jaxattn.axes import EMBED, POSITION
from jaxattn.config import ModelConfig
from jaxattn.positions import sinusoidal_positions
from jaxattn.layers.primitives import leading_ones, logical


class LearnedPositions(nn.Embed):
    """GPT-2's `wpe`: `num_embeddings` learned rows of width `features` (logical axes "position", "embed")."""

    @property
    def max_positions(self) -> int:
        return self.num_embeddings

    def add_to(self, x, positions):
        """`x [B, T, D]` plus the rows of `positions` (`[B, T]` or `[T]`)."""
        return x + leading_ones(self(positions), x.ndim)


class SinusoidalPositions(nn.Module):
    """The fixed sine/cosine table `[num_positions, dim]` (not a parameter); `dim` must be even."""

    num_positions: int
    dim: int

    def setup(self):
        if self.dim % 2:
            raise ValueError(f"sinusoidal positions need an even d_model, got {self.dim}")
        self.table = sinusoidal_positions(self.num_positions, self.dim)  # [P, D] float32

    @property
    def max_positions(self) -> int:
        return self.num_positions

    def add_to(self, x, positions):
        """`x [B, T, D]` plus the table's rows of `positions` (`[B, T]` or `[T]`) in x's dtype."""
        return x + leading_ones(self.table[positions].astype(x.dtype), x.ndim)


class NoAbsolutePositions(nn.Module):
    """Adds nothing ("rope": each attention layer rotates its queries and keys; "none": no positions)."""

    @property
    def max_positions(self) -> None:
        return None

    def add_to(self, x, positions):
        return x


def _learned(c: ModelConfig) -> nn.Module:
    return LearnedPositions(c.max_seq_len, c.d_model, dtype=jnp.dtype(c.dtype), param_dtype=jnp.dtype(c.param_dtype),
                            embedding_init=logical(nn.initializers.normal(c.init_std), POSITION, EMBED))


KINDS = {"learned": _learned,
         "sinusoidal": lambda c: SinusoidalPositions(c.max_seq_len, c.d_model),
         "rope": lambda c: NoAbsolutePositions(),
         "none": lambda c: NoAbsolutePositions()}


def absolute_positions(config: ModelConfig) -> nn.Module:
    """The module that adds `config.positions` to a model's embeddings (the table above)."""
    return KINDS[config.positions](config)
