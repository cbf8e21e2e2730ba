"""The routed experts of a mixture-of-experts MLP: the dense reference and two grouped formulations.

Contract (every implementation): `experts(x, expert_index, gate, weights, cfg) -> y`, with

* `x [M, D]` token rows in the compute dtype; `expert_index [M, K]` int32, the K distinct experts
  each row goes to; `gate [M, K]` float32, their weights (`jaxattn.layers.moe.route`);
* `weights`: an `ExpertWeights` (`gate_up [E, D, 2F]`, `down [E, F, D]`, their biases where
  `MoEConfig.expert_bias`);
* `cfg`: a `jaxattn.layers.moe.MoEConfig` (read here: `activation`, `swiglu_limit`, `swiglu_alpha`,
  `gate_up_interleaved`);
* `y [M, D]` in x's dtype: `y_m = sum_k gate[m, k] * expert_{index[m, k]}(x_m)`, where
  `expert_e(x) = glu(x gate_up_e (+ b_e)) down_e (+ c_e)`.

Every implementation is dropless (no capacity: each row reaches all K of its experts) and
exact: the same sums up to float32 order, values and gradients (tests/layers/test_moe.py).

| name | what runs |
| --- | --- |
| "dense" | the reference: every expert on every row, weighted by the sparse gate matrix `[M, E]` |
| "grouped" | the M*K (row, expert) pairs sorted by expert; `jax.lax.ragged_dot` (a grouped matmul) |
| "grouped_cpu" | the sorted pairs padded per expert to tiles of rows; one batched matmul over the tiles |
| "gathered" | each (row, expert) pair with its own copy of its expert's weights: reads only the experts used |
| "auto_cpu" | per call: "gathered", "dense" or "grouped_cpu" by M, E and k (`cpu_rule`) |

XLA:CPU has no grouped matmul: it lowers `ragged_dot` to a dense product masked per group
(every group against every one of the M*K rows), so "grouped" does about K times the dense
reference's work there (bench/results/moe.md); it is the form for backends with a native grouped matmul.
"grouped_cpu" does the grouped work, `(M*K + E*tile) * D * F`, in plain batched matmuls.
"gathered" does the least arithmetic, `M*K * D * F`, but copies an expert's weights per pair:
the form for a few rows (a decoding step), where the weights read dominate.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

# The thresholds of "auto_cpu" (`cpu_rule`): grouped_cpu from this many rows, and from this many experts
# with k/E <= 1/4 or this many rows with k/E <= 1/2 (bench/results/moe.md).
GROUPED_FROM_TOKENS = 32
GROUPED_FROM_EXPERTS = 8
GROUPED_FROM_TOKENS_HALF = 256


class ExpertWeights(NamedTuple):
    """The routed experts' parameters, stacked on a leading expert axis E.

    gate_up [E, D, 2F]: the gate's F columns, then the up's; or, with `MoEConfig.gate_up_interleaved`,
      gate in the even columns and up in the odd ones (GPT-OSS's layout, kept as stored).
    down [E, F, D]. gate_up_bias [E, 2F] and down_bias [E, D]: with `MoEConfig.expert_bias` (else None).
    """

    gate_up: jax.Array
    down: jax.Array
    gate_up_bias: jax.Array | None = None
    down_bias: jax.Array | None = None


def glu(gate_up: jax.Array, cfg) -> jax.Array:
    """`[..., 2F] -> [..., F]` in float32, the gate and up halves laid out as `cfg.gate_up_interleaved`
    says: silu(gate) * up ("swiglu"), or the clamped form ("clamped_swiglu"): gate <= limit,
    |up| <= limit, (up + 1) * gate * sigmoid(alpha * gate)."""
    gate_up = gate_up.astype(jnp.float32)
    if cfg.gate_up_interleaved:
        gate, up = gate_up[..., 0::2], gate_up[..., 1::2]
    else:
        gate, up = jnp.split(gate_up, 2, axis=-1)
    if cfg.activation == "swiglu":
        return jax.nn.silu(gate) * up
    gate = jnp.minimum(gate, cfg.swiglu_limit)  # the gate is clamped from above only
    up = jnp.clip(up, -cfg.swiglu_limit, cfg.swiglu_limit)
    return (up + 1.0) * (gate * jax.nn.sigmoid(cfg.swiglu_alpha * gate))


def gate_matrix(expert_index: jax.Array, gate: jax.Array, num_experts: int) -> jax.Array:
    """The sparse gates as a dense `[M, E]` float32 matrix (zero where a row does not go)."""
    rows = jnp.arange(expert_index.shape[0])[:, None]  # [M, 1]
    return jnp.zeros((expert_index.shape[0], num_experts), jnp.float32).at[rows, expert_index].add(gate)


def check_experts(x, expert_index, gate, weights: ExpertWeights) -> None:
    """ValueError/TypeError naming the argument whose shape or dtype breaks the contract (before tracing)."""
    if not isinstance(weights, ExpertWeights):
        raise TypeError(f"weights must be a jaxattn.kernels.moe.ExpertWeights, got {type(weights).__name__}")
    if getattr(x, "ndim", None) != 2 or getattr(expert_index, "ndim", None) != 2:
        raise ValueError(f"x must be [M, D] and expert_index [M, K], got shapes {getattr(x, 'shape', x)} and "
                         f"{getattr(expert_index, 'shape', expert_index)}")
    (M, D), K = x.shape, expert_index.shape[1]
    E, F2 = weights.gate_up.shape[0], weights.gate_up.shape[-1]
    wanted = {"expert_index": (expert_index, (M, K)), "gate": (gate, (M, K)),
              "weights.gate_up": (weights.gate_up, (E, D, F2)), "weights.down": (weights.down, (E, F2 // 2, D)),
              "weights.gate_up_bias": (weights.gate_up_bias, (E, F2)), "weights.down_bias": (weights.down_bias, (E, D))}
    for name, (value, shape) in wanted.items():
        if value is not None and tuple(value.shape) != shape:
            raise ValueError(f"{name} must have shape {shape} for x {(M, D)}, K={K}, E={E}, got {tuple(value.shape)}")
    if not jnp.issubdtype(expert_index.dtype, jnp.integer):
        raise TypeError(f"expert_index must be an integer array, got dtype {expert_index.dtype}")


def _dot(a, b, spec: str) -> jax.Array:
    return jnp.einsum(spec, a, b.astype(a.dtype), preferred_element_type=jnp.float32)


def experts_dense(x: jax.Array, gates: jax.Array, weights: ExpertWeights, cfg) -> jax.Array:
    """The reference: `y [M, D] = sum_e gates[:, e] * expert_e(x)` over all E experts.

    `gates [M, E]` float32 (`gate_matrix`). A scan over the experts: memory `[M, F]`, not `[E, M, F]`.
    """
    E = weights.gate_up.shape[0]
    if getattr(gates, "shape", None) != (x.shape[0], E):
        raise ValueError(f"gates must be [M, E] = {(x.shape[0], E)}, got {getattr(gates, 'shape', gates)}")
    biases = (jnp.zeros((E, 1), x.dtype) if weights.gate_up_bias is None else weights.gate_up_bias,
              jnp.zeros((E, 1), x.dtype) if weights.down_bias is None else weights.down_bias)

    def one_expert(y, per_expert):
        w1, w2, b1, b2, g = per_expert  # [D, 2F], [F, D], [2F] or [1], [D] or [1], [M]
        h = glu(_dot(x, w1, "md,df->mf") + b1[None, :].astype(jnp.float32), cfg).astype(x.dtype)  # [M, F]
        out = _dot(h, w2, "mf,fd->md") + b2[None, :].astype(jnp.float32)  # [M, D]
        return y + g[:, None] * out, None

    y, _ = jax.lax.scan(one_expert, jnp.zeros(x.shape, jnp.float32),
                        (weights.gate_up, weights.down, *biases, gates.T))
    return y.astype(x.dtype)


class _Sorted(NamedTuple):
    """The M*K (row, expert) pairs sorted by expert (stable: by row within an expert)."""

    token: jax.Array   # [N] int32, the row of each sorted pair (N = M*K)
    expert: jax.Array  # [N] int32, its expert, non-decreasing
    gate: jax.Array    # [N] float32
    sizes: jax.Array   # [E] int32, pairs per expert


def _sort_by_expert(expert_index, gate, num_experts: int) -> _Sorted:
    flat = expert_index.reshape(-1)  # [N]: pair n = (row n // K, slot n % K)
    order = jnp.argsort(flat, stable=True)
    return _Sorted(token=(order // expert_index.shape[1]).astype(jnp.int32), expert=flat[order],
                   gate=gate.reshape(-1)[order], sizes=jnp.bincount(flat, length=num_experts).astype(jnp.int32))


def _bias(bias, index) -> jax.Array | float:
    return 0.0 if bias is None else bias[index].astype(jnp.float32)


def experts_grouped(x: jax.Array, expert_index: jax.Array, gate: jax.Array, weights: ExpertWeights,
                    cfg) -> jax.Array:
    """The pairs sorted by expert, `jax.lax.ragged_dot` for gate/up and down (groups = pairs per
    expert, from a bincount), scattered back onto their rows weighted by their gates."""
    check_experts(x, expert_index, gate, weights)
    s = _sort_by_expert(expert_index, gate, weights.gate_up.shape[0])
    rows = x[s.token]  # [N, D]
    up = jax.lax.ragged_dot(rows, weights.gate_up.astype(x.dtype), s.sizes, preferred_element_type=jnp.float32)
    h = glu(up + _bias(weights.gate_up_bias, s.expert), cfg).astype(x.dtype)  # [N, F]
    out = jax.lax.ragged_dot(h, weights.down.astype(x.dtype), s.sizes, preferred_element_type=jnp.float32)
    out = (out + _bias(weights.down_bias, s.expert)) * s.gate[:, None]  # [N, D]
    return jnp.zeros(x.shape, jnp.float32).at[s.token].add(out).astype(x.dtype)


def tile_rows(num_pairs: int, num_experts: int) -> int:
    """Rows per tile of "grouped_cpu": the power of two nearest sqrt(64 * mean group), in [16, 256].

    Padding costs about E * b / 2 rows of matmul, and each overflow tile a copy of its expert's
    weights (about N / b copies): the sum is least at b = sqrt(2 * mean * copy / row), and
    copy / row ~ 32 fits a sweep of b on the CPU of bench/results/moe.md (fastest b: 16 to 32 at a
    mean group of 8 rows, 32 to 64 at 32, 64 at 64, 128 at 128 to 256, 256 at 1024)."""
    mean = max(num_pairs / num_experts, 1.0)
    return 1 << min(8, max(4, math.floor((6 + math.log2(mean)) / 2 + 0.5)))


class _Tiles(NamedTuple):
    """Where "grouped_cpu" puts the sorted pairs: tiles of b rows, tile e < E the first b rows of
    expert e (its "home", so most weights are used in place), then overflow tiles of one expert each."""

    slot: jax.Array         # [N] the padded row of each sorted pair
    over_expert: jax.Array  # [N // b] the expert of each overflow tile


def _tile_layout(s: _Sorted, b: int) -> _Tiles:
    E, N = s.sizes.shape[0], s.token.shape[0]
    rank = jnp.arange(N) - (jnp.cumsum(s.sizes) - s.sizes)[s.expert]  # [N] rank within its expert
    over_tiles = (jnp.maximum(s.sizes - b, 0) + b - 1) // b  # [E]; in all < N / b, so N // b bounds it
    first_over = E + jnp.cumsum(over_tiles) - over_tiles
    spill = jnp.maximum(rank - b, 0)
    slot = jnp.where(rank < b, s.expert * b + rank, (first_over[s.expert] + spill // b) * b + spill % b)
    over_expert = jnp.searchsorted(jnp.cumsum(over_tiles), jnp.arange(N // b), side="right")
    return _Tiles(slot, jnp.minimum(over_expert, E - 1))


def _per_tile(rows: jax.Array, w: jax.Array, bias, over_expert: jax.Array) -> jax.Array:
    """`rows [E + T, b, X]` times their tiles' experts' `w [E, X, Y]` (+ bias [E, Y]) -> float32 [E + T, b, Y]."""
    E = w.shape[0]
    home = _dot(rows[:E], w, "ebx,exy->eby")  # the experts' weights in place
    over = _dot(rows[E:], w[over_expert], "tbx,txy->tby")  # a copy per overflow tile
    if bias is not None:
        home = home + bias[:, None, :].astype(jnp.float32)
        over = over + bias[over_expert][:, None, :].astype(jnp.float32)
    return jnp.concatenate([home, over])


def experts_grouped_cpu(x: jax.Array, expert_index: jax.Array, gate: jax.Array, weights: ExpertWeights,
                        cfg) -> jax.Array:
    """The sorted pairs in tiles of `tile_rows` rows, one expert per tile (E + N // b tiles at most:
    a static bound, so dropless), then one batched matmul per projection over the tiles."""
    check_experts(x, expert_index, gate, weights)
    (M, D), N, E = x.shape, expert_index.size, weights.gate_up.shape[0]
    b = tile_rows(N, E)
    s = _sort_by_expert(expert_index, gate, E)
    tiles = _tile_layout(s, b)
    rows = (E + N // b) * b
    source = jnp.full((rows,), M, jnp.int32).at[tiles.slot].set(s.token)  # padding reads the zero row M
    padded_gate = jnp.zeros((rows,), jnp.float32).at[tiles.slot].set(s.gate)  # and has gate 0
    xs = jnp.concatenate([x, jnp.zeros((1, D), x.dtype)])[source].reshape(-1, b, D)  # [tiles, b, D]
    up = _per_tile(xs, weights.gate_up, weights.gate_up_bias, tiles.over_expert)  # [tiles, b, 2F]
    out = _per_tile(glu(up, cfg).astype(x.dtype), weights.down, weights.down_bias, tiles.over_expert)
    out = out.reshape(rows, D) * padded_gate[:, None]
    return jnp.zeros((M + 1, D), jnp.float32).at[source].add(out)[:M].astype(x.dtype)


def experts_gathered(x: jax.Array, expert_index: jax.Array, gate: jax.Array, weights: ExpertWeights,
                     cfg) -> jax.Array:
    """Each of the M*K (row, expert) pairs times its own gathered copy of its expert's weights:
    `[N, D, 2F]` and `[N, F, D]` for N = M*K pairs, so only the experts some row uses are read."""
    check_experts(x, expert_index, gate, weights)
    M, K = expert_index.shape
    flat = expert_index.reshape(-1)  # [N]: pair n = (row n // K, slot n % K)
    rows = jnp.repeat(x, K, axis=0)  # [N, D]
    up = _dot(rows, weights.gate_up[flat], "nd,ndf->nf") + _bias(weights.gate_up_bias, flat)  # [N, 2F]
    out = _dot(glu(up, cfg).astype(x.dtype), weights.down[flat], "nf,nfd->nd") + _bias(weights.down_bias, flat)
    out = out.reshape(M, K, -1) * gate[:, :, None]  # [M, K, D]
    return out.sum(axis=1).astype(x.dtype)


def cpu_rule(num_tokens: int, num_experts: int, k: int) -> tuple[str, str]:
    """(implementation, reason) of "auto_cpu" for `num_tokens` rows M routed to `k` of `num_experts` E.

    In order: a few rows (2Mk <= E: a decoding step) are "gathered", reading only the experts
    used; below two of the smallest tiles (M < 32) the dense product over so few rows costs less
    than a tile of at least 16 rows per expert; then "grouped_cpu" where the grouped work is a
    small share of dense's (E >= 8 with k/E <= 1/4, or M >= 256 with k/E <= 1/2), dense elsewhere
    (the forward and forward+backward sweeps of bench/results/moe.md)."""
    M, E = num_tokens, num_experts
    if 2 * M * k <= E:
        return "gathered", f"2*M*k = 2*{M}*{k} <= E = {E}: a few rows, read only the experts they use"
    if M < GROUPED_FROM_TOKENS:
        return "dense", f"M = {M} < {GROUPED_FROM_TOKENS} rows: tiles of 16 rows per expert cost more than dense"
    if (E >= GROUPED_FROM_EXPERTS and 4 * k <= E) or (M >= GROUPED_FROM_TOKENS_HALF and 2 * k <= E):
        return "grouped_cpu", f"M = {M}, E = {E}, k = {k}: the grouped work is a small share of dense's"
    return "dense", f"M = {M}, E = {E}, k = {k}: grouping saves too little to pay for the sort and the tiles"


def experts_auto_cpu(x, expert_index, gate, weights, cfg) -> jax.Array:
    """"auto_cpu": the implementation `cpu_rule` picks for these (static) shapes."""
    name = cpu_rule(x.shape[0], weights.gate_up.shape[0], expert_index.shape[1])[0]
    return IMPLEMENTATIONS[name](x, expert_index, gate, weights, cfg)


def _dense(x, expert_index, gate, weights, cfg) -> jax.Array:
    check_experts(x, expert_index, gate, weights)
    return experts_dense(x, gate_matrix(expert_index, gate, weights.gate_up.shape[0]), weights, cfg)


IMPLEMENTATIONS: dict[str, Callable] = {"dense": _dense, "grouped": experts_grouped,
                                        "grouped_cpu": experts_grouped_cpu, "gathered": experts_gathered,
                                        "auto_cpu": experts_auto_cpu}


def rule(platform) -> tuple[str, str]:
    """(implementation, reason) that "auto" means on a `jaxattn.kernels.Platform`."""
    if platform.is_cpu:
        return "auto_cpu", ("per call: gathered for a few rows (2Mk <= E), grouped_cpu from "
                            f"{GROUPED_FROM_TOKENS} rows where k/E is small, else dense (XLA:CPU lowers ragged_dot "
                            "densely)")
    return "grouped", f"{platform.backend}: ragged_dot, the backend's grouped matmul"
