"""Weight-only quantization: the model's matmul weights stored as int8 or int4 values with float32 scales.

* int8 ("int8", or "int8:32"), in groups of 32 consecutive input rows, as llama.cpp's Q8_0:
  `values [in, out]` int8 in [-127, 127], `scales [in / 32, out]`, `scale = max|group| / 127`; each
  weight is off by at most half its group's scale. "int8:channel": one scale per output channel
  instead, `scales [1, out]`, `scale = max|W[:, j]| / 127` (any `in`; one large weight coarsens its
  whole column, so a model's outputs move more).
* int4, in groups of `group` (32 or 64) consecutive input rows: values in [-8, 7], as llama.cpp's Q4_0:
  the group's value of largest magnitude maps to -8 (`scale = -that value / 8`, so a scale may be
  negative; all 16 levels are used), stored as unsigned nibbles `u = v + 8` eight to a 32-bit word
  along the input axis: `values [in / 8, out]` int32, word `[t, j]` holds rows `8t .. 8t + 7` of
  column j, row `8t + i` in bits `4i .. 4i + 3` (so that one 32-bit lane of a SIMD integer dot holds
  rows of one column); `scales [in / group, out]`; each weight is off by at most half its group's |scale|.
* "int4:asym", groups of 32 with a minimum, as llama.cpp's Q4_1: `W = scale * u + minimum` with the
  nibble `u` in [0, 15], `minimum` the group's smallest value, `scale = (max - min) / 15` rounded to
  float16 (as the file stores it); `minimums [in / 32, out]` beside the scales. A Q4_1 file's weights
  quantized so give back its own nibbles, scales and minimums (`jaxattn.gguf`).

A weight may also be laid out in "panels" of `PANEL` (16) columns, each panel's rows contiguous (`to_panels`;
the layout the native int8-activation kernel reads as one stream, `jaxattn.kernels.prepare_weights`):
int8 `values [N / 16, in / 4, 64]`, byte `4c + i` of row `t` of panel `p` holding `W[4t + i, 16p + c]`;
int4 `values [N / 16, in / 8, 16]`, word `c` of row `t` of panel `p` the rows layout's word `[t, 16p + c]`;
`scales [N / 16, in / group, 16]` (and minimums so). The same numbers: `dequantize`, `unpack` and `to_rows` read either.

A weight with leading axes (`[..., in, out]`: layers stacked for a scan, a mixture's experts) is
quantized slice by slice; its values and scales keep the leading axes (`[..., in / 8, out]`,
`[..., in / group, out]`), so a scan step or an expert sees a 2-D `QuantizedWeight`.

`quantize(params, config, mode)` quantizes:
* every `Linear` kernel (a parameter named "kernel" of 2 or more axes: the attention and MLA
  projections, the MLP, shared experts and an untied lm_head);
* a mixture of experts' routed experts (`experts_gate_up [E, D, 2F]`, `experts_down [E, F, D]`), per
  expert, and MLA's `wkv_b [R, N, P + V]` as the `[R, N(P + V)]` matmul it is; these two are read back
  through `float_param`, which dequantizes (the reference: no native kernel runs them yet);
* a tied head: a new parameter `tied_head`, the embedding table transposed (`[D, V]`) and quantized,
  beside the float table (the lookup reads one row per token; the head reads all of it, every token).
It leaves as they are: embeddings (the lookup tables), norms, biases, the router of a mixture of experts
(its choice of experts should not move), position and value-embedding tables.
`Linear` and the model's head hand a `QuantizedWeight` to the kernel seam (`Kernels.quantized`),
whose reference dequantizes and multiplies.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from jaxattn.config import ModelConfig

MODES = ("int8", "int8:32", "int8:channel", "int4", "int4:32", "int4:64", "int4:asym")
LAYOUTS = ("rows", "panels")
PANEL = 16  # columns per panel of the "panels" layout
TIED_HEAD = "tied_head"  # the quantized copy of a tied head, beside "wte" at the top of the params
# Parameters that are matmul weights but no Linear kernel: name -> the axis (from the end) that is `in`.
OTHER_WEIGHTS = {"experts_gate_up": 2, "experts_down": 2, "wkv_b": 3}

@flax.struct.dataclass
class QuantizedWeight:
    """A `[..., in, out]` weight as integer values and float32 scales (a pytree; `bits` and `group` are static).

    Attributes:
      values: int8 `[..., in, out]` for bits 8; int32 `[..., in / 8, out]` (eight unsigned nibbles a
        word, see the module docstring) for bits 4.
      scales: float32 `[..., in / group, out]` (`[..., 1, out]` per output channel).
      bits: 8 or 4.
      group: input rows per scale (`in` for per-channel).
      layout: "rows" (as above) or "panels" (the module docstring: values `[..., N / 16, in / 4, 64]`
        int8 or `[..., N / 16, in / 8, 16]` int32, scales `[..., N / 16, in / group, 16]`).
      minimums: None (symmetric: `W = scale * v`), or, bits 4 only, float32 shaped as `scales`:
        `W = scale * u + minimum` with `u = v + 8` the stored nibble ("int4:asym", llama.cpp's Q4_1).
    """

    values: jax.Array
    scales: jax.Array
    bits: int = flax.struct.field(pytree_node=False, default=8)
    group: int = flax.struct.field(pytree_node=False, default=0)
    layout: str = flax.struct.field(pytree_node=False, default="rows")
    minimums: jax.Array | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        """The float weight's shape `[..., in, out]`."""
        if self.layout == "panels":  # each row of a panel holds 4 (int8) or 8 (int4) input rows
            *lead, panels, rows, _ = self.values.shape
            return (*lead, rows * (8 if self.bits == 4 else 4), panels * PANEL)
        *lead, rows, N = self.values.shape
        return (*lead, rows * (8 if self.bits == 4 else 1), N)

    @property
    def nbytes(self) -> int:
        arrays = (self.values, self.scales) + (() if self.minimums is None else (self.minimums,))
        return sum(a.size * a.dtype.itemsize for a in arrays)


def parse_mode(mode: str) -> tuple[int, int | None]:
    """`(bits, group)` for a mode: "int8" / "int8:32" -> (8, 32), "int8:channel" -> (8, None: per output
    channel), "int4" / "int4:32" / "int4:asym" -> (4, 32), "int4:64" -> (4, 64); ValueError for anything else."""
    if mode not in MODES:
        raise ValueError(f"quantization mode must be one of {MODES}, got {mode!r}")
    bits, _, group = mode.partition(":")
    if group == "channel":
        return 8, None
    group = group.removesuffix("asym")  # "int4:asym": groups of 32
    return (8 if bits == "int8" else 4), int(group or 32)


def quantize_weight(w: jax.Array, mode: str) -> QuantizedWeight:
    """One `[..., in, out]` weight quantized as `mode` (see `parse_mode`), each `[in, out]` slice alone."""
    bits, group = parse_mode(mode)
    w = jnp.asarray(w, jnp.float32)
    if w.ndim < 2:
        raise ValueError(f"a quantized weight is [..., in, out], got shape {w.shape}")
    *lead, K, N = w.shape
    group = K if group is None else group
    if K % group:
        raise ValueError(f"{mode} quantizes in groups of {group} input rows: the in-dimension {K} is not a multiple")
    grouped = w.reshape(*lead, K // group, group, N)  # [..., G, group, N]
    if mode.endswith(":asym"):
        return _quantize_asymmetric(grouped, group)
    if bits == 8:  # symmetric, the largest magnitude at +-127
        scales = jnp.max(jnp.abs(grouped), axis=-2) / 127.0  # [..., G, N]
    else:  # Q4_0's rule: the value of largest magnitude at -8
        extreme = jnp.take_along_axis(grouped, jnp.argmax(jnp.abs(grouped), axis=-2)[..., None, :], axis=-2)[..., 0, :]
        scales = -extreme / 8.0
    low, high = (-127.0, 127.0) if bits == 8 else (-8.0, 7.0)
    values = _rounded(grouped, scales, low, high).reshape(*lead, K, N)
    if bits == 8:
        return QuantizedWeight(values.astype(jnp.int8), scales, bits=8, group=group)
    return QuantizedWeight(pack_int4(values), scales, bits=4, group=group)


# One compiled program per weight shape and mode (a model has a handful): op by op, quantizing a model's
# weights dispatches thousands of small operations.
_quantize_compiled = jax.jit(quantize_weight, static_argnums=1)


def _rounded(grouped: jax.Array, scales: jax.Array, low: float, high: float) -> jax.Array:
    """`round(w / scale)` clipped to [low, high] (int32; 0 where a group's scale is 0)."""
    safe = jnp.where(scales != 0, scales, 1.0)
    return jnp.clip(jnp.round(grouped / safe[..., None, :]), low, high).astype(jnp.int32)


def _quantize_asymmetric(grouped: jax.Array, group: int) -> QuantizedWeight:
    """"int4:asym" (llama.cpp's Q4_1): the group's minimum at nibble 0, its maximum at 15, the scale a
    float16 value (so a Q4_1 file's dequantized weights give back the file's own numbers)."""
    *lead, G, _, N = grouped.shape
    low, high = jnp.min(grouped, axis=-2), jnp.max(grouped, axis=-2)  # [..., G, N]
    scales = ((high - low) / 15.0).astype(jnp.float16).astype(jnp.float32)
    nibbles = _rounded(grouped - low[..., None, :], scales, 0.0, 15.0)
    values = pack_int4(nibbles.reshape(*lead, G * group, N) - 8)
    return QuantizedWeight(values, scales, bits=4, group=group, minimums=low)


def pack_int4(values: jax.Array) -> jax.Array:
    """Signed int4 values `[..., in, out]` (in [-8, 7]) as the words `[..., in / 8, out]` int32."""
    *lead, K, N = values.shape
    nibbles = ((values.astype(jnp.int32) + 8) & 0xF).astype(jnp.uint32).reshape(*lead, K // 8, 8, N)
    words = jnp.sum(nibbles << _shifts(len(lead)), axis=-2, dtype=jnp.uint32)  # disjoint bits: a sum is an or
    return jax.lax.bitcast_convert_type(words, jnp.int32)


def _shifts(leading: int) -> jax.Array:
    """The nibbles' shifts `4i`, shaped `[1.., 1, 8, 1]` against words `[..., T, 8, N]`."""
    return (4 * jnp.arange(8, dtype=jnp.uint32)).reshape((1,) * (leading + 1) + (8, 1))


def to_panels(weight: QuantizedWeight) -> QuantizedWeight:
    """`weight` in the "panels" layout (the module docstring); ValueError unless `out` is a multiple of
    `PANEL` (and, int8, `in` of 4)."""
    if weight.layout == "panels":
        return weight
    *lead, K, N = weight.shape
    if N % PANEL or K % 4:
        raise ValueError(f"the panels layout takes a weight [..., in, out] with out a multiple of {PANEL} and in of 4, "
                         f"got {weight.shape}")
    n = len(lead)
    if weight.bits == 8:  # [..., K/4, 4, N/16, 16] (t, i, p, c) -> [..., p, t, c, i]
        values = weight.values.reshape(*lead, K // 4, 4, N // PANEL, PANEL).transpose(*range(n), n + 2, n, n + 3, n + 1)
        values = values.reshape(*lead, N // PANEL, K // 4, 4 * PANEL)
    else:  # [..., K/8, N/16, 16] (t, p, c) -> [..., p, t, c]
        values = weight.values.reshape(*lead, K // 8, N // PANEL, PANEL).transpose(*range(n), n + 1, n, n + 2)
    minimums = None if weight.minimums is None else _scales_to_panels(weight.minimums)
    return QuantizedWeight(values, _scales_to_panels(weight.scales), bits=weight.bits, group=weight.group,
                           layout="panels", minimums=minimums)


def _scales_to_panels(scales: jax.Array) -> jax.Array:
    """`[..., G, N]` -> `[..., N / 16, G, 16]`."""
    *lead, G, N = scales.shape
    n = len(lead)
    return scales.reshape(*lead, G, N // PANEL, PANEL).transpose(*range(n), n + 1, n, n + 2)


def to_rows(weight: QuantizedWeight) -> QuantizedWeight:
    """`weight` in the "rows" layout (the inverse of `to_panels`)."""
    if weight.layout == "rows":
        return weight
    *lead, K, N = weight.shape
    n = len(lead)
    if weight.bits == 8:  # [..., p, t, c, i] -> [..., t, i, p, c]
        values = weight.values.reshape(*lead, N // PANEL, K // 4, PANEL, 4).transpose(*range(n), n + 1, n + 3, n, n + 2)
        values = values.reshape(*lead, K, N)
    else:  # [..., p, t, c] -> [..., t, p, c]
        values = weight.values.transpose(*range(n), n + 1, n, n + 2).reshape(*lead, K // 8, N)
    return QuantizedWeight(values, _scales_to_rows(weight.scales), bits=weight.bits, group=weight.group,
                           minimums=None if weight.minimums is None else _scales_to_rows(weight.minimums))


def _scales_to_rows(scales: jax.Array) -> jax.Array:
    """`[..., N / 16, G, 16]` -> `[..., G, N]`."""
    *lead, P, G, _ = scales.shape
    n = len(lead)
    return scales.transpose(*range(n), n + 1, n, n + 2).reshape(*lead, G, P * PANEL)


def unpack(weight: QuantizedWeight) -> jax.Array:
    """The integer values as int8 `[..., in, out]` (int4 unpacked to [-8, 7])."""
    weight = to_rows(weight)
    if weight.bits == 8:
        return weight.values
    *lead, T, N = weight.values.shape
    words = jax.lax.bitcast_convert_type(weight.values, jnp.uint32)[..., :, None, :]  # [..., T, 1, N]
    nibbles = ((words >> _shifts(len(lead))) & 0xF).astype(jnp.int32) - 8  # [..., T, 8, N]
    return nibbles.astype(jnp.int8).reshape(*lead, 8 * T, N)


def dequantize(weight: QuantizedWeight, dtype=jnp.float32) -> jax.Array:
    """The float weight `[..., in, out]` the values and scales stand for."""
    weight = to_rows(weight)
    *lead, K, N = weight.shape
    values = unpack(weight).astype(jnp.float32).reshape(*lead, K // weight.group, weight.group, N)
    if weight.minimums is None:
        return (values * weight.scales[..., :, None, :]).reshape(*lead, K, N).astype(dtype)  # [..., G, group, N]
    # scale * u + minimum, u = v + 8 the nibble: the order of operations of llama.cpp's (and gguf's) Q4_1
    w = (values + 8.0) * weight.scales[..., :, None, :] + weight.minimums[..., :, None, :]
    return w.reshape(*lead, K, N).astype(dtype)


def take_columns(weight: QuantizedWeight, ids: jax.Array) -> jax.Array:
    """Columns `ids` (int `[M]`) of a 2-D `weight [in, out]` as float32 rows `[M, in]`: a tied head's
    quantized copy `[D, V]` read as the embedding table it stands for, one row per token, without
    dequantizing the rest (either layout)."""
    if weight.layout == "panels":  # the ids' panels, then each id's lanes within its panel
        panel, lane = ids // PANEL, ids % PANEL
        # [M, rows, 16 * width] -> [M, rows * width]: an int8 panel row's lane holds 4 input rows (width 4)
        pick = lambda a, width: jnp.take_along_axis(  # noqa: E731
            a.reshape(*a.shape[:2], PANEL, width), lane[:, None, None, None], axis=2)[:, :, 0].reshape(len(ids), -1)
        values = pick(weight.values[panel], 4 if weight.bits == 8 else 1).T  # [in or in / 8, M]
        scales = pick(weight.scales[panel], 1).T
        minimums = None if weight.minimums is None else pick(weight.minimums[panel], 1).T
    else:
        values, scales = jnp.take(weight.values, ids, axis=-1), jnp.take(weight.scales, ids, axis=-1)
        minimums = None if weight.minimums is None else jnp.take(weight.minimums, ids, axis=-1)
    columns = QuantizedWeight(values, scales, bits=weight.bits, group=weight.group, minimums=minimums)
    return dequantize(columns).T


def drop_tied_table(params: Any) -> Any:
    """`params` without the float embedding table `wte` where a quantized tied head `tied_head` holds it (the
    model then looks tokens up in the head's columns, `take_columns`): for a head that holds the table's
    own numbers (a GGUF file's quantized token embedding), the float copy is memory for nothing."""
    outer = "params" in params and len(params) == 1
    inner = params["params"] if outer else params
    if not is_quantized(inner.get(TIED_HEAD)) or "wte" not in inner:
        return params
    inner = {key: value for key, value in inner.items() if key != "wte"}
    return {"params": inner} if outer else inner


def is_quantized(x: Any) -> bool:
    return isinstance(x, QuantizedWeight)


def float_param(module: nn.Module, name: str, init, shape: tuple[int, ...], dtype) -> jax.Array:
    """`module.param(name, init, shape, dtype)`, or, where the stored parameter is a `QuantizedWeight`
    (`quantize`), it dequantized to `shape` in `dtype`: the reference for weights without a quantized
    kernel of their own (a mixture's experts, MLA's `wkv_b`). Flax's `param` would compare the packed
    shape with `shape`, so a quantized one is read as stored."""
    if module.has_variable("params", name):
        stored = module.get_variable("params", name)
        if is_quantized(stored):
            return dequantize(stored, dtype).reshape(shape)
    return module.param(name, init, shape, dtype)


SAME = "same"  # `quantize`'s head: the layers' mode
HEAD = "lm_head"  # the untied head's Linear, at the top of the params


def quantize(params: Any, config: ModelConfig, mode: str, *, head: str | None = SAME) -> Any:
    """`params` (a DecoderLM's, boxed or not) with its matmul weights quantized as `mode` (see the module
    docstring for which), and with a tied head, its quantized copy `tied_head`.

    Args:
      params: the model's parameters (`{"params": ...}` or the inner tree); returned unboxed. A
        parameter with leading axes (layers stacked for a scan) is quantized slice by slice.
      config: the model's config (checked to be a `ModelConfig`).
      mode: "int8" (groups of 32, as llama.cpp's Q8_0; "int8:32" the same), "int8:channel" (a scale per
        output channel), "int4" (groups of 32; "int4:32" the same), "int4:64" or "int4:asym" (Q4_1's
        groups of 32 with a minimum).
      head: the head's mode (an untied `lm_head`, or a tied head's copy): the layers' by default, None
        to leave it float (a GGUF file's head may be stored otherwise than its layers: `jaxattn.gguf`).

    Raises:
      ValueError: an unknown mode, or a weight whose in-dimension is not a multiple of the group
        (the message names the parameter).
    """
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config must be a jaxattn.ModelConfig, got {type(config).__name__}")
    parse_mode(mode)
    head = mode if head == SAME else head
    if head is not None:
        parse_mode(head)
    params = nn.unbox(params)

    def one(value, path, in_axis, how=mode):
        w = jnp.asarray(value)
        if in_axis == 3:  # wkv_b [..., R, N, P + V]: the [R, N(P + V)] matmul it is
            w = w.reshape(*w.shape[:-2], -1)
        try:
            return _quantize_compiled(w, how)
        except ValueError as err:
            raise ValueError(f"{'/'.join(path)}: {err}") from None

    def walk(tree, path):
        if not isinstance(tree, dict) and not hasattr(tree, "items"):
            return tree
        out = {}
        for key, value in tree.items():
            if isinstance(value, QuantizedWeight) or isinstance(value, dict) or hasattr(value, "items"):
                out[key] = walk(value, path + (key,))
            elif key == "kernel" and jnp.ndim(value) >= 2 and path == (HEAD,):
                out[key] = value if head is None else one(value, path + (key,), 2, head)
            elif key == "kernel" and jnp.ndim(value) >= 2:
                out[key] = one(value, path + (key,), 2)
            elif key in OTHER_WEIGHTS and jnp.ndim(value) >= OTHER_WEIGHTS[key]:
                out[key] = one(value, path + (key,), OTHER_WEIGHTS[key])
            else:
                out[key] = value
        return type(tree)(out) if isinstance(tree, dict) else out

    outer = "params" in params and len(params) == 1
    inner = walk(params["params"] if outer else params, ())
    if config.tie_embeddings and "wte" in inner and TIED_HEAD not in inner and head is not None:
        inner = dict(inner)
        inner[TIED_HEAD] = one(jnp.swapaxes(jnp.asarray(inner["wte"]["embedding"]), -1, -2), (TIED_HEAD,), 2, head)
    return {"params": inner} if outer else inner


def with_layout(params: Any, layout: str, fits=lambda weight: True) -> Any:
    """`params` with each quantized `Linear` kernel and tied head's copy for which `fits(weight)` holds in
    `layout` ("rows" or "panels"); everything else as it is (the weights read through `float_param` stay
    in rows: they are dequantized whole)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    convert = to_panels if layout == "panels" else to_rows

    def one(path, leaf):
        name = getattr(path[-1], "key", None) if path else None
        if is_quantized(leaf) and name in ("kernel", TIED_HEAD) and fits(leaf):
            return convert(leaf)
        return leaf

    return jax.tree_util.tree_map_with_path(one, params, is_leaf=is_quantized)


def weight_bytes(params: Any) -> int:
    """Bytes of all parameters as stored (a quantized weight: its values and scales)."""
    leaves = jax.tree_util.tree_leaves(nn.unbox(params))
    return sum(x.size * x.dtype.itemsize for x in leaves)
