"""The maths a `jaxattn.layers.primitives.Linear` reads for adapters in slots (`jaxattn.lora.slots.LoraSlots`,
passed as `weight`): `slot_delta` and its formulations.

Four formulations of `slot_delta` (`FORMS`), the same sums up to float32 order:

| form | what runs |
| --- | --- |
| "gather" | each row's adapter gathered (`a[s_m] [M, in, r]`, `b[s_m]`), then per-row products (Punica's BGMV) |
| "segment" | rows sorted by slot, `jax.lax.ragged_dot` over the S slots' segments as groups (Punica's SGMV, S-LoRA) |
| "segment_cpu" | the same segments, a loop over chunks of a few rows, each chunk's products with its own slot |
| "native_cpu" | the same segments in one native call per part (`jaxattn.kernels.lora_slots`), each slot's a and b read once |

`DEFAULT_FORM` is "segment_cpu", the fastest in XLA measured on a CPU at every shape (SmolLM2-135M's
projections, rank 16, 32 and 256 rows, 1 to 32 adapters: bench/lora_slots.py, bench/results/lora_slots_amx.md):
it reads each adapter a chunk uses once and copies none. "gather" copies an adapter per row (its `b` is
as wide as the weight's output), which XLA:CPU materializes. XLA:CPU has no grouped matmul: it lowers
`ragged_dot` to a product masked per group (every slot against every row, as `jaxattn.kernels.moe`
notes for the experts), so "segment" does S times the adapters' work there; it is the form for a
backend with a native grouped matmul. "native_cpu" is faster still on a CPU (its while loop, sort and
scatters gone: a few percent over the base matmuls at 32 rows and one adapter) and needs a C++ compiler
and float32 operands; the serving engine takes the platform's choice (`jaxattn.kernels.select.lora_form`).
A `LoraSlots` carries its form (static: `empty_slots(..., form=)`); `slot_delta`'s `form` overrides it.
"segment_cpu" and "native_cpu" are forward only (training adapts with `LoraWeight`s).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxattn.kernels import lora_slots

FORMS = ("gather", "segment", "segment_cpu", "native_cpu")
DEFAULT_FORM = "segment_cpu"  # the fastest in XLA measured on a CPU (the module docstring)


def _gather_delta(rows: jax.Array, weight, slots: jax.Array) -> jax.Array:
    """"gather": each row's own `a[s]`, `b[s]` gathered, per-row products -> float32 `[M, out]`."""
    dtype, f32 = rows.dtype, jnp.float32
    valid = slots >= 0
    index = jnp.where(valid, slots, 0)
    scale = jnp.where(valid, weight.scale[index], 0.0)  # [M]
    cols = []
    for a, b, width in zip(weight.a, weight.b, weight.widths):
        if a is None:
            cols.append(jnp.zeros((rows.shape[0], width), f32))
            continue
        h = jnp.einsum("mi,mir->mr", rows, a[index].astype(dtype), preferred_element_type=f32)  # [M, r]
        cols.append(jnp.einsum("mr,mro->mo", h.astype(dtype), b[index].astype(dtype), preferred_element_type=f32))
    return jnp.concatenate(cols, axis=-1) * scale[:, None]


def _sorted_rows(slots: jax.Array, count: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`(order [M], sizes [S], starts [S])`: the rows sorted by slot (stable; rows of none, -1, last and
    in no segment), and each slot's segment of the sorted rows (its length and first row)."""
    key = jnp.where(slots >= 0, slots, count)  # [M]
    sizes = jnp.bincount(key, length=count + 1)[:count].astype(jnp.int32)
    return jnp.argsort(key, stable=True), sizes, jnp.cumsum(sizes) - sizes


def _segment_delta(rows: jax.Array, weight, slots: jax.Array) -> jax.Array:
    """"segment": the sorted rows' segments as `ragged_dot`'s groups, unsorted -> float32 `[M, out]`."""
    dtype, f32, S = rows.dtype, jnp.float32, weight.slots
    order, sizes, starts = _sorted_rows(slots, S)
    x, row = rows[order], jnp.arange(rows.shape[0])
    owner = jnp.minimum(jnp.searchsorted(starts + sizes, row, side="right"), S - 1)  # [M] each sorted row's slot
    valid = row < jnp.sum(sizes)  # rows past the segments have no adapter
    cols = []
    for a, b, width in zip(weight.a, weight.b, weight.widths):
        if a is None:
            cols.append(jnp.zeros((rows.shape[0], width), f32))
            continue
        h = jax.lax.ragged_dot(x, a.astype(dtype), sizes, preferred_element_type=f32)  # [M, r]
        cols.append(jax.lax.ragged_dot(h.astype(dtype), b.astype(dtype), sizes, preferred_element_type=f32))
    delta = jnp.where(valid[:, None], jnp.concatenate(cols, axis=-1) * weight.scale[owner][:, None], 0.0)
    return jnp.zeros_like(delta).at[order].set(delta)


def chunk_rows(rows: int) -> int:
    """The rows of a "segment_cpu" chunk for a call of `rows` rows: few where a segment is likely a row or
    two (a decode step of many adapters), more where segments are long (a prompt chunk)."""
    return 4 if rows <= 64 else 16


def _segment_cpu_delta(rows: jax.Array, weight, slots: jax.Array) -> jax.Array:
    """"segment_cpu": a loop over the sorted rows' segments in chunks of `chunk_rows` rows (a segment
    spans `ceil(size / chunk)` chunks, the last one's rows past the segment masked), each chunk's products
    with its slot's `a`, `b` -> float32 `[M, out]`. Each used adapter is read once a chunk; none is copied."""
    dtype, f32, S, (M, d_in) = rows.dtype, jnp.float32, weight.slots, rows.shape
    W = chunk_rows(M)
    order, sizes, starts = _sorted_rows(slots, S)
    chunks = (sizes + W - 1) // W  # [S]
    ends = jnp.cumsum(chunks)  # slot g's chunks are ends[g] - chunks[g] .. ends[g] - 1
    x = jnp.concatenate([rows[order], jnp.zeros((W, d_in), dtype)])  # a last chunk may read past row M

    def chunk(state):
        c, out = state
        g = jnp.searchsorted(ends, c, side="right")
        first = starts[g] + (c - ends[g] + chunks[g]) * W
        window = jax.lax.dynamic_slice_in_dim(x, first, W)  # [W, in]
        keep = first + jnp.arange(W) < starts[g] + sizes[g]  # [W]
        cols = [jnp.zeros((W, width), f32) if a is None else
                jnp.dot(jnp.dot(window, a[g].astype(dtype), preferred_element_type=f32).astype(dtype),
                        b[g].astype(dtype), preferred_element_type=f32)
                for a, b, width in zip(weight.a, weight.b, weight.widths)]
        delta = jnp.where(keep[:, None], jnp.concatenate(cols, axis=-1) * weight.scale[g], 0.0)  # [W, out]
        return c + 1, jax.lax.dynamic_update_slice_in_dim(out, jax.lax.dynamic_slice_in_dim(out, first, W) + delta,
                                                          first, 0)

    init = (jnp.int32(0), jnp.zeros((M + W, weight.out_features), f32))
    _, out = jax.lax.while_loop(lambda state: state[0] < ends[-1], chunk, init)
    return jnp.zeros((M, weight.out_features), f32).at[order].set(out[:M])


def _native_cpu_delta(rows: jax.Array, weight, slots: jax.Array) -> jax.Array:
    """"native_cpu": each part's products in one native call (`jaxattn.kernels.lora_slots`) -> float32 `[M, out]`."""
    cols = [jnp.zeros((rows.shape[0], width), jnp.float32) if a is None else
            lora_slots.part_delta(rows, slots, a, b, weight.scale)
            for a, b, width in zip(weight.a, weight.b, weight.widths)]
    return jnp.concatenate(cols, axis=-1) if len(cols) > 1 else cols[0]


_DELTAS = {"gather": _gather_delta, "segment": _segment_delta, "segment_cpu": _segment_cpu_delta,
           "native_cpu": _native_cpu_delta}


def slot_delta(rows: jax.Array, weight, form: str | None = None) -> jax.Array:
    """`[M, out]` in rows' dtype: row m gets, for s = token_slots[m] >= 0, `scale[s] * (rows[m] a[s]) b[s]`
    per part in column order (zeros for parts without slots), zeros where s = -1.

    `rows [M, in]` in the compute dtype; products in it, summed in float32. `form` (default: the weight's
    own, `DEFAULT_FORM` unless `empty_slots` was told otherwise) picks the formulation (the module
    docstring); the forms agree up to float32 summation order. ValueError where `token_slots` is unset
    or not one per row, rows do not fit the weight, or `form` is not in `FORMS`.
    """
    form = weight.form if form is None else form
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    if rows.ndim != 2 or rows.shape[1] != weight.in_features:
        raise ValueError(f"rows must be [M, {weight.in_features}], got {rows.shape}")
    if weight.token_slots is None:
        raise ValueError("LoraSlots.token_slots is not set: jaxattn.lora.with_token_slots gives each token row its "
                         "slot (-1 for none) before the model runs")
    if weight.token_slots.shape != (rows.shape[0],):
        raise ValueError(f"token_slots has shape {weight.token_slots.shape}, rows {rows.shape}: one slot per row "
                         f"({rows.shape[0]}), a [B, T] call's B*T")
    return _DELTAS[form](rows, weight, weight.token_slots).astype(rows.dtype)
