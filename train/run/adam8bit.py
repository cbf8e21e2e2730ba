"""Adam's two moments held in 8 bits: block-wise quantization with a dynamic code, as bitsandbytes' 8-bit
Adam (Dettmers et al., 2022, "8-bit Optimizers via Block-wise Quantization").

Each moment of a parameter with at least `MIN_SIZE` values is kept as one byte per value. Its values,
flattened, are cut into blocks of `BLOCK`; each block is divided by its largest magnitude (one float32
per block) and each value rounded to the nearest of the 256 values of a dynamic code (`dynamic_code`:
magnitudes from 1e-7 to 1, with fewer fraction steps the smaller the decade). The first moment takes
the signed code, the second the unsigned one. A step dequantizes both, updates them in float32,
computes the update from the float32 moments, then rounds them again: the step's own arithmetic is
float32's. The code tables equal bitsandbytes' bit for bit, and a step from a state of
`bitsandbytes.optim.AdamW8bit` gives its parameters (tests/train/run/test_adam8bit.py).

Why not simpler formats: the second moment of one block spans orders of magnitude, which a linear
int8 code (steps of absmax / 127) rounds to zero, and a zero there divides the first moment by eps.
bfloat16 keeps the range, but the second moment's step at beta2 = 0.999 (0.1% of its value) is below
bfloat16's resolution (0.4%), so a decaying moment never decays. The dynamic code keeps 8-bit sizes
and the range; its resolution near a block's largest value is 0.35%, like bfloat16's, so the same
stalling falls on a block's largest values, as it does in bitsandbytes.

Smaller parameters (norms, biases) keep float32 moments: their bytes are negligible and their
blocks would be mostly one scale each. Per parameter of the rest the state is 2 bytes plus 8 per
`BLOCK`, against Adam's 8.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

BLOCK = 256  # values per scale (bitsandbytes' block-wise optimizers)
MIN_SIZE = 4096  # smaller parameters keep float32 moments (bitsandbytes' min_8bit_size)


def dynamic_code(signed: bool) -> np.ndarray:
    """The 256 sorted values of the dynamic 8-bit code in [-1, 1] (signed) or [0, 1]: for each decade
    10^-6 .. 10^0, the midpoints of an even split of [0.1, 1] times the decade, with 2^i (signed: per
    sign) or 2^(i+1) midpoints in the i-th decade from the smallest; then 0 and 1. Bit for bit
    bitsandbytes' `create_dynamic_map` (7 exponent bits): float32 arithmetic on torch's linspace."""
    values = [np.float32(0.0), np.float32(1.0)]
    for i in range(7):
        items = 2 ** i + 1 if signed else 2 ** (i + 1) + 1
        bounds = _torch_linspace(0.1, 1.0, items)
        means = np.float32(10.0 ** (i - 6)) * ((bounds[:-1] + bounds[1:]) / np.float32(2))
        values += list(means) + (list(-means) if signed else [])
    code = np.sort(np.asarray(values, np.float32))
    assert code.shape == (256,) and len(np.unique(code)) == 256
    return code


def _torch_linspace(start: float, end: float, steps: int) -> np.ndarray:
    """`torch.linspace(start, end, steps, dtype=torch.float32)` to the bit: a float32 step, each value
    computed in double from the nearer end and rounded to float32 (float64 `np.linspace` differs in
    the last bit of some, and so would the code)."""
    start32, end32 = np.float32(start), np.float32(end)
    step = np.float64((end32 - start32) / np.float32(steps - 1))
    index = np.arange(steps)
    from_start = np.float64(start32) + step * index
    from_end = np.float64(end32) - step * (steps - 1 - index)
    return np.where(index < steps // 2, from_start, from_end).astype(np.float32)


SIGNED, UNSIGNED = dynamic_code(True), dynamic_code(False)


class Quantized(NamedTuple):
    """A tensor in 8 bits: `codes` (uint8, the tensor's shape: indices into the code) and `scales`
    (float32 `[ceil(size / BLOCK)]`: each block's largest magnitude, in the flattened order)."""

    codes: jax.Array
    scales: jax.Array


def _blocks(x: jax.Array) -> jax.Array:
    """x flattened, zero-padded to whole blocks: `[ceil(size / BLOCK), BLOCK]`."""
    flat = x.reshape(-1)
    return jnp.pad(flat, (0, -flat.size % BLOCK)).reshape(-1, BLOCK)


def quantize(x: jax.Array, code: np.ndarray) -> Quantized:
    """x (float) rounded per block to the nearest value of `code` times the block's largest magnitude."""
    blocks = _blocks(x.astype(jnp.float32))
    scales = jnp.max(jnp.abs(blocks), axis=1)
    scaled = blocks / jnp.where(scales > 0, scales, 1.0)[:, None]
    table = jnp.asarray(code)
    above = jnp.clip(jnp.searchsorted(table, scaled), 1, code.size - 1)  # code[above - 1] < scaled <= code[above]
    nearer_below = scaled - table[above - 1] <= table[above] - scaled
    index = jnp.where(nearer_below, above - 1, above).astype(jnp.uint8)
    return Quantized(index.reshape(-1)[:x.size].reshape(x.shape), scales)


def dequantize(q: Quantized, code: np.ndarray) -> jax.Array:
    """The float32 tensor `q` stands for."""
    values = _blocks(jnp.asarray(code)[q.codes.astype(jnp.int32)])
    return (values * q.scales[:, None]).reshape(-1)[:q.codes.size].reshape(q.codes.shape)


def held_in_8bit(x) -> bool:
    """Whether a parameter's moments are kept in 8 bits (at least `MIN_SIZE` values)."""
    return np.size(x) >= MIN_SIZE


class ScaleByAdam8bitState(NamedTuple):
    """The step count and the two moments: per parameter a `Quantized` (`held_in_8bit`) or float32."""

    count: jax.Array
    mu: Any
    nu: Any


def _is_moment(x) -> bool:
    return isinstance(x, Quantized)


def scale_by_adam_8bit(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> optax.GradientTransformation:
    """`optax.scale_by_adam` with its moments held as this module says: the same update where the
    moments are exact (every parameter under `MIN_SIZE` values), close to it elsewhere."""

    def init(params):
        def zeros(p, code):  # a zero moment: every value the code's 0, every scale 0
            if not held_in_8bit(p):
                return jnp.zeros_like(p, jnp.float32)
            zero = int(np.flatnonzero(code == 0.0)[0])
            return Quantized(jnp.full(np.shape(p), zero, jnp.uint8), jnp.zeros(-(-np.size(p) // BLOCK), jnp.float32))
        return ScaleByAdam8bitState(count=jnp.zeros([], jnp.int32), mu=jax.tree.map(lambda p: zeros(p, SIGNED), params),
                                    nu=jax.tree.map(lambda p: zeros(p, UNSIGNED), params))

    def update(updates, state, params=None):
        del params
        count = optax.safe_increment(state.count)
        unbias1, unbias2 = 1 - b1 ** count.astype(jnp.float32), 1 - b2 ** count.astype(jnp.float32)

        def one(g, mu, nu):
            quantized = _is_moment(mu)
            mu = dequantize(mu, SIGNED) if quantized else mu
            nu = dequantize(nu, UNSIGNED) if quantized else nu
            g32 = g.astype(jnp.float32)
            mu, nu = b1 * mu + (1 - b1) * g32, b2 * nu + (1 - b2) * g32 * g32
            step = (mu / unbias1) / (jnp.sqrt(nu / unbias2) + eps)
            if quantized:
                mu, nu = quantize(mu, SIGNED), quantize(nu, UNSIGNED)
            return step.astype(g.dtype), mu, nu

        grads, tree = jax.tree.flatten(updates)  # a moment's subtree (a Quantized) sits where its gradient is a leaf
        steps, mu, nu = zip(*map(one, grads, tree.flatten_up_to(state.mu), tree.flatten_up_to(state.nu))) \
            if grads else ((), (), ())
        return tree.unflatten(steps), ScaleByAdam8bitState(count, tree.unflatten(mu), tree.unflatten(nu))

    return optax.GradientTransformation(init, update)


def adamw_8bit(learning_rate, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, weight_decay: float = 1e-4,
               mask: Any = None) -> optax.GradientTransformation:
    """`optax.adamw` with `scale_by_adam_8bit` in place of `scale_by_adam`."""
    return optax.chain(scale_by_adam_8bit(b1, b2, eps), optax.add_decayed_weights(weight_decay, mask),
                       optax.scale_by_learning_rate(learning_rate))
