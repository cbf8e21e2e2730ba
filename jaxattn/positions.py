"""Absolute position encodings that are not learned (Vaswani et al., 2017).

Learned absolute positions (GPT-2's `wpe`, docs/theory.md §7) are an `nn.Embed` in the
model; RoPE lives in `jaxattn.rope`.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxattn._validate import require_positive_int


def sinusoidal_positions(num_positions: int, dim: int, *, base: float = 10000.0) -> jnp.ndarray:
    """`[num_positions, dim]` float32 table.

    `PE[pos, 2i] = sin(pos / base^(2i/dim))`, `PE[pos, 2i+1] = cos(pos / base^(2i/dim))`.
    """
    require_positive_int("num_positions", num_positions)
    require_positive_int("dim", dim)
    if dim % 2:
        raise ValueError(f"sinusoidal_positions needs an even dim, got dim={dim}")
    pos = jnp.arange(num_positions, dtype=jnp.float32)[:, None]  # [P, 1]
    inv_freq = base ** (-jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)  # [dim/2]
    angles = pos * inv_freq[None, :]  # [P, dim/2]
    return jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1).reshape(num_positions, dim)
