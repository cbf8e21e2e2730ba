"""Rotary position embeddings (RoPE), with context-extension scalings.

Pair p of a head vector is rotated by the angle `position * inv_freq[p]`,
`inv_freq[p] = theta^(-2p/H)` (docs/theory.md §8). Two pairings exist in the wild:

* interleaved: pairs `(x[2p], x[2p+1])`, as in Meta's Llama;
* half-split: pairs `(x[p], x[p + H/2])`, as in GPT-NeoX and Hugging Face Llama.

They are the same rotation up to a fixed permutation of the head dimensions.
RoPE is applied to queries and keys, never to values, identically on every head.

Partial rotary (GPT-NeoX's `rotary_pct`, Phi-3's `partial_rotary_factor`,
docs/theory.md §19): only the first R = `rotary_dims(H, f)` dims of each head are
rotated, with frequencies computed over those R dims (`rope_frequencies(R)`, as
transformers computes them with dim = R), and the other H - R pass through.
Both pairings apply within the first R dims.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import jax.numpy as jnp
import numpy as np

from jaxattn._validate import is_int, require_integer, require_rank

ScalingKind = Literal["linear", "ntk", "llama3", "yarn"]


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """How to stretch RoPE beyond the context length a model was trained on.

    Attributes:
      kind: "linear" (position interpolation: every frequency / factor),
        "ntk" (NTK-aware: theta * factor^(H / (H - 2))), "llama3" (Llama 3.1:
        low frequencies / factor, high kept, a smooth ramp between) or "yarn"
        (YaRN: per-frequency ramp between interpolation and extrapolation,
        plus an attention temperature, see `rope_attention_factor`).
      factor: the context-extension factor (> 1 extends).
      original_max_position: training context length (llama3, yarn).
      low_freq_factor, high_freq_factor: llama3's wavelength thresholds.
      beta_fast, beta_slow: yarn's ramp bounds in rotations.
      mscale, mscale_all_dim: yarn's temperature coefficients (DeepSeek-V2/V3).
      attention_factor: yarn's attention factor given outright (None = derived
        from factor, mscale and mscale_all_dim, see `rope_attention_factor`).
      truncate: yarn rounds its ramp bounds to whole dims (the paper's and
        Hugging Face's default); False keeps them fractional.
    """

    kind: ScalingKind
    factor: float
    original_max_position: int = 4096
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self):
        if self.kind not in ("linear", "ntk", "llama3", "yarn"):
            raise ValueError(
                f"RopeScaling.kind must be 'linear', 'ntk', 'llama3' or 'yarn', got {self.kind!r}"
            )
        if not self.factor > 0:
            raise ValueError(f"RopeScaling.factor must be positive, got {self.factor}")
        if self.attention_factor is not None and not self.attention_factor > 0:
            raise ValueError(f"RopeScaling.attention_factor must be positive or None, got {self.attention_factor}")


def rotary_dims(head_dim: int, fraction: float = 1.0) -> int:
    """R, how many of a head's dims RoPE rotates: int(head_dim * fraction), rounded down to even."""
    return int(head_dim * fraction) // 2 * 2


def _check_head_dim(head_dim: int) -> None:
    if not is_int(head_dim) or head_dim <= 0 or head_dim % 2:
        raise ValueError(f"RoPE needs an even, positive head dim, got head_dim={head_dim}")


def _llama3(inv_freq: np.ndarray, s: RopeScaling) -> np.ndarray:
    low_freq_wavelen = s.original_max_position / s.low_freq_factor
    high_freq_wavelen = s.original_max_position / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
    out = np.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(is_medium, smoothed, out)


def _yarn(inv_freq: np.ndarray, head_dim: int, theta: float, s: RopeScaling) -> np.ndarray:
    def correction_dim(num_rotations):
        return (head_dim * math.log(s.original_max_position / (num_rotations * 2 * math.pi))
                ) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    high = high + 0.001 if low == high else high
    ramp = np.clip((np.arange(head_dim // 2) - low) / (high - low), 0.0, 1.0)
    extrapolate = 1.0 - ramp  # 1 keeps the original (high) frequency
    return inv_freq / s.factor * (1 - extrapolate) + inv_freq * extrapolate


def rope_frequencies(head_dim: int, *, theta: float = 10000.0,
                     scaling: RopeScaling | None = None) -> jnp.ndarray:
    """`[H/2]` float32 angular frequencies `theta^(-2p/H)`, scaled if asked."""
    _check_head_dim(head_dim)
    if scaling is not None and scaling.kind == "ntk" and head_dim > 2:
        # (With H = 2 the only frequency is theta^0 = 1, whatever theta is.)
        theta = theta * scaling.factor ** (head_dim / (head_dim - 2))
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling is None or scaling.kind == "ntk":
        pass
    elif scaling.kind == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling.kind == "llama3":
        inv_freq = _llama3(inv_freq, scaling)
    else:
        inv_freq = _yarn(inv_freq, head_dim, theta, scaling)
    return jnp.asarray(inv_freq, jnp.float32)


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(scaling: RopeScaling | None) -> float:
    """YaRN's attention temperature, which multiplies the rotated queries and keys.

    Hugging Face multiplies cos and sin by it, so the logits of the rotary dims
    scale by its square; with every dim rotated (standard attention) that is
    the softmax scale times its square. `attention_factor` when given, else
    `mscale(factor, mscale) / mscale(factor, mscale_all_dim)` when both are
    non-zero (DeepSeek), else `mscale(factor, 1)`. 1.0 for every other scaling.
    """
    if scaling is None or scaling.kind != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return float(scaling.attention_factor)
    if scaling.mscale and scaling.mscale_all_dim:
        return _yarn_mscale(scaling.factor, scaling.mscale) / _yarn_mscale(
            scaling.factor, scaling.mscale_all_dim)
    return _yarn_mscale(scaling.factor, 1.0)


def apply_rope(x, positions, *, theta: float = 10000.0, interleaved: bool,
               scaling: RopeScaling | None = None, inv_freq=None, rotary_dim: int | None = None):
    """Rotates each head vector of x by its position.

    Args:
      x: `[B, T, N, H]` queries or keys.
      positions: `[B, T]` or `[T]` integer positions.
      theta: the RoPE base.
      interleaved: True pairs `(x[2p], x[2p+1])` (Meta Llama);
        False pairs `(x[p], x[p + R/2])` (GPT-NeoX, Hugging Face Llama).
      scaling: optional context-extension scaling of the frequencies.
      inv_freq: precomputed `rope_frequencies(R, theta=..., scaling=...)`;
        overrides theta and scaling when given. R = 2 * len(inv_freq) <= H
        dims are rotated (partial rotary), the rest passed through unchanged.
      rotary_dim: R when inv_freq is not given (default H); even, 2 <= R <= H.

    Returns:
      x rotated, same shape and dtype (computed in float32).
    """
    require_rank("x", x, 4, "[B, T, N, H]")
    B, T, N, H = x.shape
    positions = _checked_positions(positions, x.shape)
    inv_freq = _frequencies(x.shape, theta, scaling, inv_freq, rotary_dim)
    R = 2 * jnp.shape(inv_freq)[0]
    positions = positions.reshape((-1, T)).astype(jnp.float32)  # [B or 1, T]
    angles = positions[:, :, None] * inv_freq[None, None, :]  # [B or 1, T, R/2]
    cos = jnp.cos(angles)[..., None, :]  # [B or 1, T, 1, R/2]
    sin = jnp.sin(angles)[..., None, :]
    xf = x.astype(jnp.float32)
    rotary = xf if R == H else xf[..., :R]  # [B, T, N, R]
    out = _rotate(rotary, cos, sin, interleaved)
    if R < H:  # partial rotary: the other dims pass through
        out = jnp.concatenate([out, xf[..., R:]], axis=-1)
    return out.astype(x.dtype)


def _checked_positions(positions, x_shape: tuple[int, ...]):
    """`positions` as an array once it is known to be integers `[B, T]` or `[T]` for x `[B, T, N, H]`."""
    B, T = x_shape[:2]
    positions = jnp.asarray(positions)
    require_integer("positions", positions)
    if positions.shape not in ((B, T), (T,)):
        raise ValueError(
            f"positions must be [B, T] = {(B, T)} or [T] = {(T,)} for x {x_shape}, "
            f"got {positions.shape}"
        )
    return positions


def _frequencies(x_shape: tuple[int, ...], theta: float, scaling: RopeScaling | None, inv_freq, rotary_dim):
    """`[R/2]` frequencies for x `[B, T, N, H]`: `inv_freq` once it is known to fit the head (2 <= R <= H), or
    `rope_frequencies(R)` of `rotary_dim` (default H; even, 2 <= R <= H), theta and scaling."""
    H = x_shape[3]
    if inv_freq is None:
        R = H if rotary_dim is None else rotary_dim
        if rotary_dim is None:
            _check_head_dim(H)
        elif not is_int(R) or not 0 < R <= H or R % 2:
            raise ValueError(f"rotary_dim must be an even integer in [2, H={H}], got {rotary_dim!r}")
        return rope_frequencies(R, theta=theta, scaling=scaling)
    if len(jnp.shape(inv_freq)) != 1 or not 0 < 2 * jnp.shape(inv_freq)[0] <= H:
        raise ValueError(
            f"inv_freq must be [R/2] with 2 <= R <= H = {H} (R = H: every dim rotated) for x {x_shape}, "
            f"got {jnp.shape(inv_freq)}"
        )
    return inv_freq


def _rotate(rotary, cos, sin, interleaved: bool):
    """`rotary [B, T, N, R]` (float32) rotated by the angles' `cos`, `sin` `[B or 1, T, 1, R/2]`, in either pairing."""
    if interleaved:
        x1, x2 = rotary[..., 0::2], rotary[..., 1::2]
        out = jnp.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
        return out.reshape(rotary.shape)
    # The halves as an axis of 2: [x1 cos - x2 sin, x2 cos + x1 sin] = halves * cos + flipped * [-sin, sin],
    # the same numbers as concatenating the two, as one elementwise loop (a concatenation of two
    # computed halves ran about twice as slowly on XLA:CPU, forward and backward).
    # The cosines stacked twice like the sines: XLA:CPU computes a stacked table once, where it fused a
    # lone broadcast cos into the loop, one cosine per element of x (a training step's rotation of q:
    # 3.6 against 1.3 ms a layer).
    B, T, N, R = rotary.shape
    halves = rotary.reshape(B, T, N, 2, R // 2)
    cosines = jnp.stack([cos, cos], axis=-2)  # [B or 1, T, 1, 2, R/2]
    signed_sin = jnp.stack([-sin, sin], axis=-2)
    return (halves * cosines + jnp.flip(halves, axis=-2) * signed_sin).reshape(rotary.shape)


def yarn_softmax_mscale(scaling: RopeScaling | None) -> float:
    """DeepSeek's softmax temperature under YaRN: `mscale(factor, mscale_all_dim)`.

    MLA multiplies its softmax scale `1/sqrt(P+E)` by its square, on every dim
    (the rotary dims get `rope_attention_factor` squared on top). 1.0 without
    YaRN or without `mscale_all_dim`.
    """
    if scaling is None or scaling.kind != "yarn" or not scaling.mscale_all_dim:
        return 1.0
    return _yarn_mscale(scaling.factor, scaling.mscale_all_dim)
