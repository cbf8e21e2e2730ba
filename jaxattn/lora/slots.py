"""Adapters in slots: many LoRA adapters on one frozen base, chosen per token row (S-LoRA; Punica's kernels).

Letters: S slots, r the slots' rank (the most an adapter written into one may have), M token rows,
`in` and `out` a weight's input and output widths (out split into parts as `jaxattn.lora.LoraWeight`'s).

A targeted weight becomes a `LoraSlots` in the params tree, where a `LoraWeight` would be: the frozen
base (float or `jaxattn.quantization.QuantizedWeight`), per part a stack of S adapters `a [S, in, r]`,
`b [S, r, width]` (None for a part no slot adapts) with one scale per slot `scale [S]`, and each token
row's slot `token_slots [M]` (-1: none). `jaxattn.layers.primitives.Linear` runs it as the base matmul
plus `slot_delta`, which adds to row m, for s = token_slots[m] >= 0, `scale[s] * (x_m a[s]) b[s]`
per part (ranks below r are zero-padded: the padding adds exact zeros). The slot count, the rank and the
dtypes are shapes, so static; every value (an adapter's numbers, its scale, each row's slot) is an array,
so filling a slot (`write_slot`), emptying it (`clear_slot`) and choosing the rows' slots
(`with_token_slots`) change no compiled program.

Functions: `empty_slots` (params -> params with zeroed slots on the weights the targets name),
`write_slot` (one adapter, as `jaxattn.lora.add_lora` or `jaxattn.hf.peft.load_adapter` return it, into a
slot), `clear_slot`, `with_token_slots`, `slot_delta` (the maths a Linear reads), `is_slots`.

The formulations of `slot_delta` (`FORMS`: gather, segments in XLA, segments in a native loop) and why
each: `jaxattn.lora.slot_forms`.

Not slotted: layers stacked for a scan (`ModelConfig.scan_layers`: the leading `[R]` axis would slice
`token_slots` too; unroll first, as the serving engine runs), and the weights read merged as one float
array (`jaxattn.lora.weight.float_param`: a mixture's routed experts, MLA's `wkv_b`): `empty_slots`
refuses a target that names them with a ValueError naming the weight.
"""

from __future__ import annotations

import operator
from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
from flax.traverse_util import flatten_dict

from jaxattn.config import ModelConfig
from jaxattn.config.lora import TARGETS
from jaxattn.lora.params import _rewrap, _stored_shape, _unwrap, part_widths, role_targets, roles_of
from jaxattn.lora.slot_forms import DEFAULT_FORM, FORMS, slot_delta
from jaxattn.lora.weight import LoraWeight, PerRowWeight, is_lora

__all__ = ["DEFAULT_FORM", "FORMS", "LoraSlots", "clear_slot", "empty_slots", "is_slots", "slot_delta",
           "with_token_slots", "write_slot"]



@flax.struct.dataclass
class LoraSlots(PerRowWeight):
    """A frozen weight and S slots of low-rank adapters on parts of its columns, chosen per token row (a pytree).

    Attributes:
      base: the frozen `[in, out]` weight as the model stores it: a float array or a `QuantizedWeight`.
      a: per part, `[S, in, r]`, or None (no slot adapts the part).
      b: per part, `[S, r, width]`, or None (with its `a`).
      scale: `[S]` float32, each slot's alpha / r (0 for an empty slot).
      token_slots: `[M]` int32, each token row's slot (-1: no adapter); None until `with_token_slots` sets it.
      parts, widths, weight_shape: as `LoraWeight`'s (static).
      form: the `slot_delta` formulation a Linear runs, one of `FORMS` (static).
    """

    base: Any
    a: tuple
    b: tuple
    scale: jax.Array
    token_slots: jax.Array | None = None
    parts: tuple[str, ...] = flax.struct.field(pytree_node=False, default=())
    widths: tuple[int, ...] = flax.struct.field(pytree_node=False, default=())
    weight_shape: tuple[int, ...] = flax.struct.field(pytree_node=False, default=())
    form: str = flax.struct.field(pytree_node=False, default=DEFAULT_FORM)

    @property
    def slots(self) -> int:
        return self.scale.shape[0]

    @property
    def rank(self) -> int:
        return next(a.shape[-1] for a in self.a if a is not None)

    @property
    def in_features(self) -> int:
        return self.weight_shape[0]

    @property
    def out_features(self) -> int:
        return self.weight_shape[1]


def is_slots(x: Any) -> bool:
    return isinstance(x, LoraSlots)


def _map_leaves(tree: Any, visit: Callable[[tuple, Any], Any], path: tuple = ()) -> Any:
    """`tree`'s dicts as they are, each other value replaced by `visit(path, value)`."""
    if hasattr(tree, "items"):
        return {key: _map_leaves(value, visit, path + (key,)) for key, value in tree.items()}
    return visit(path, tree)


def _check_empty_slots_args(config, max_loras, max_rank, targets, form) -> None:
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config must be a jaxattn.ModelConfig, got {type(config).__name__}")
    for name, value in (("max_loras", max_loras), ("max_rank", max_rank)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if isinstance(targets, str) or not targets or any(t not in TARGETS for t in targets):
        raise ValueError(f"targets must be one or more of {TARGETS}, got {targets!r}")
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")


def empty_slots(params: Any, config: ModelConfig, max_loras: int, max_rank: int, targets: tuple[str, ...], *,
                form: str = DEFAULT_FORM) -> Any:
    """`params` (a DecoderLM's, float or quantized, boxed or not; unboxed on return) with a `LoraSlots` of
    `max_loras` slots of rank `max_rank` on every weight `targets` names (the targets of `jaxattn.lora`'s
    table), every slot empty (zeros, scale 0). A part of a weight that `targets` does not name has no
    slots (None). Adapters are stored in `config.param_dtype`.

    Raises:
      TypeError: `config` is not a ModelConfig.
      ValueError: `max_loras` or `max_rank` not a positive int; a target outside `TARGETS`, or one that
        names no weight of this model; a target naming a weight read as one float array (routed
        experts, MLA's `wkv_b`), a weight already adapted, or layers stacked for a scan (each names the
        weight); `form` not in `FORMS`.
    """
    _check_empty_slots_args(config, max_loras, max_rank, targets, form)
    inner, outer = _unwrap(params)
    dtype, matched = jnp.dtype(config.param_dtype), set()

    def visit(path, value):
        roles = roles_of(path)
        wanted = [bool(set(role_targets(role)) & set(targets)) for role in roles or ()]
        if not any(wanted):
            return value
        where = "/".join(path)
        if path[-1] != "kernel":
            raise ValueError(f"targets {tuple(targets)} name {where}, which the model reads as one float array "
                             "(jaxattn.lora.float_param): adapters in slots need a Linear's matmul")
        if is_lora(value) or is_slots(value):
            raise ValueError(f"{where} already has LoRA adapters ({type(value).__name__})")
        shape = _stored_shape(value)
        if len(shape) != 2:
            raise ValueError(f"{where} has shape {shape}: adapters in slots take [in, out] weights, not layers "
                             "stacked for a scan (load the model with scan_layers=False)")
        d_in, out = shape
        matched.update(t for role, w in zip(roles, wanted) if w for t in role_targets(role))
        a = tuple(jnp.zeros((max_loras, d_in, max_rank), dtype) if w else None for w in wanted)
        b = tuple(jnp.zeros((max_loras, max_rank, width), dtype) if w else None
                  for w, width in zip(wanted, part_widths(path, out, config)))
        return LoraSlots(value, a, b, jnp.zeros((max_loras,), jnp.float32), parts=roles if len(roles) > 1
                         else (path[-2],), widths=part_widths(path, out, config), weight_shape=(d_in, out), form=form)

    out = _map_leaves(inner, visit)
    unmatched = [t for t in targets if t not in matched]
    if unmatched:
        raise ValueError(f"targets {unmatched} name no weight of this model (see jaxattn.lora's table)")
    return _rewrap(out, outer)


def _slot_index(slot: Any, count: int) -> jax.Array:
    """`slot` as an int32 index into `count` slots. A concrete one out of range is a ValueError; a traced
    one out of range becomes `count`, which `.at[...].set(..., mode="drop")` writes nowhere."""
    try:
        value = operator.index(slot)
    except jax.errors.TracerIntegerConversionError:
        slot = jnp.asarray(slot)
        if slot.ndim or not jnp.issubdtype(slot.dtype, jnp.integer):
            raise ValueError(f"slot must be a scalar int, got shape {slot.shape} {slot.dtype}") from None
        return jnp.where((slot >= 0) & (slot < count), slot, count).astype(jnp.int32)
    except TypeError:
        raise ValueError(f"slot must be an int, got {slot!r}") from None
    if not 0 <= value < count:
        raise ValueError(f"slot {value} is out of range: there are {count} slots (0 to {count - 1})")
    return jnp.asarray(value, jnp.int32)


def _put(stack: jax.Array, index: jax.Array, value: jax.Array) -> jax.Array:
    return stack.at[index].set(value.astype(stack.dtype), mode="drop")


def _cleared(weight: LoraSlots, index: jax.Array) -> LoraSlots:
    """`weight` with slot `index` zeros and scale 0."""
    zero = lambda x: None if x is None else _put(x, index, jnp.zeros(x.shape[1:], x.dtype))  # noqa: E731
    return weight.replace(a=tuple(map(zero, weight.a)), b=tuple(map(zero, weight.b)),
                          scale=_put(weight.scale, index, jnp.zeros((), jnp.float32)))


def _padded(where: str, part: str, slots: LoraSlots, width: int, a: jax.Array, b: jax.Array):
    """An adapter part's `a [in, k]`, `b [k, width]` zero-padded to the slots' rank r (k <= r)."""
    k, r = a.shape[-1], slots.rank
    if k > r:
        raise ValueError(f"{where} part {part!r}: the adapter's rank {k} is more than the slots' max rank {r}")
    if a.shape != (slots.in_features, k) or b.shape != (k, width):
        raise ValueError(f"{where} part {part!r}: the adapter's a {a.shape} and b {b.shape} do not fit "
                         f"the slots' [{slots.in_features}, {r}] and [{r}, {width}]")
    return jnp.pad(a, ((0, 0), (0, r - k))), jnp.pad(b, ((0, r - k), (0, 0)))


def _written(where: str, slots: LoraSlots, index: jax.Array, adapter: LoraWeight | None) -> LoraSlots:
    """`slots` with slot `index` holding `adapter` (None: nothing, the slot cleared)."""
    if adapter is None:
        return _cleared(slots, index)
    if adapter.lead or adapter.parts != slots.parts:
        raise ValueError(f"{where}: the adapter's parts {adapter.parts} (leading axes {adapter.lead}) do not fit "
                         f"the slots' {slots.parts} (no leading axes)")
    a, b = [], []
    for part, width, slot_a, slot_b, new_a, new_b in zip(slots.parts, slots.widths, slots.a, slots.b,
                                                          adapter.a, adapter.b):
        if slot_a is None:
            if new_a is not None:
                raise ValueError(f"{where} part {part!r}: the adapter adapts it, and it has no slots "
                                 "(empty_slots's targets do not name it)")
            a.append(None)
            b.append(None)
            continue
        if new_a is None:  # a part the adapter leaves alone: zeros in its slot
            new_a, new_b = jnp.zeros(slot_a.shape[1:], slot_a.dtype), jnp.zeros(slot_b.shape[1:], slot_b.dtype)
        else:
            new_a, new_b = _padded(where, part, slots, width, new_a, new_b)
        a.append(_put(slot_a, index, new_a))
        b.append(_put(slot_b, index, new_b))
    scale = _put(slots.scale, index, jnp.asarray(adapter.scale, jnp.float32))
    return slots.replace(a=tuple(a), b=tuple(b), scale=scale)


def write_slot(slotted: Any, slot: Any, adapter_params: Any) -> Any:
    """`slotted` (params from `empty_slots`) with slot `slot` holding the adapter of `adapter_params` (a
    params tree with `LoraWeight`s: `add_lora`'s, `load_adapter`'s; only its LoraWeights are read).

    Each LoraWeight's parts go into the slot zero-padded to the slots' rank, its scale into `scale[slot]`;
    parts and weights with slots that the adapter does not adapt are zeros in that slot. Pure (new
    arrays) and jittable with `slot` traced: an adapter's rank and scale are static fields of a
    LoraWeight, so a jitted call compiles once per (rank, scale); eagerly, `slot` goes in as an array
    and no slot value compiles anything new.

    Raises ValueError: `slot` not an int or (concrete) out of range (a traced one out of range writes
    nothing); an adapter rank above the slots'; a LoraWeight (or a part of one) where `slotted` has no
    slots; an adapter whose shapes or parts do not fit; `slotted` holding no LoraSlots.
    """
    inner, outer = _unwrap(slotted)
    slotted_paths = {path: w for path, w in flatten_dict(inner).items() if is_slots(w)}
    if not slotted_paths:
        raise ValueError("slotted holds no LoraSlots (jaxattn.lora.empty_slots makes them)")
    adapters = {path: w for path, w in flatten_dict(_unwrap(adapter_params)[0]).items() if is_lora(w)}
    stray = sorted(set(adapters) - set(slotted_paths))
    if stray:
        raise ValueError(f"adapter_params adapt {'/'.join(stray[0])}, which has no slots (empty_slots's targets "
                         "do not name it)")
    index = _slot_index(slot, next(iter(slotted_paths.values())).slots)
    visit = lambda path, w: _written("/".join(path), w, index, adapters.get(path)) if is_slots(w) else w  # noqa: E731
    return _rewrap(_map_leaves(inner, visit), outer)


def clear_slot(slotted: Any, slot: Any) -> Any:
    """`slotted` with slot `slot` emptied on every LoraSlots (zeros, scale 0): rows choosing it run the
    base. Pure and jittable as `write_slot`; the same ValueErrors for `slot`."""
    inner, outer = _unwrap(slotted)
    found = [w for w in flatten_dict(inner).values() if is_slots(w)]
    if not found:
        raise ValueError("slotted holds no LoraSlots (jaxattn.lora.empty_slots makes them)")
    index = _slot_index(slot, found[0].slots)
    return _rewrap(_map_leaves(inner, lambda path, w: _cleared(w, index) if is_slots(w) else w), outer)


def with_token_slots(slotted: Any, token_slots: Any) -> Any:
    """`slotted` with `token_slots` (`[M]` int, each token row's slot, -1 for none; stored as int32) on
    every LoraSlots. M is the rows a Linear multiplies: a `[B, T]` call's B*T, row-major (token t of
    sequence b is row b*T + t). Jittable; ValueError for a `token_slots` that is not `[M]` int."""
    token_slots = jnp.asarray(token_slots)
    if token_slots.ndim != 1 or not jnp.issubdtype(token_slots.dtype, jnp.integer):
        raise ValueError(f"token_slots must be [M] int (one slot per token row), got shape {token_slots.shape} "
                         f"{token_slots.dtype}")
    token_slots = token_slots.astype(jnp.int32)
    inner, outer = _unwrap(slotted)
    return _rewrap(_map_leaves(inner, lambda path, w: w.replace(token_slots=token_slots) if is_slots(w) else w),
                   outer)
