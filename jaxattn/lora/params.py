"""LoRA adapters over a model's params tree: which weight each target names, adding adapters
(`add_lora`), splitting them from the frozen rest and back (`split_lora`, `combine_lora`), merging
them into plain float params (`merge_lora`) and counting them (`count_lora_params`).

The targets' table is `jaxattn.lora`'s (the package docstring); the weight they become is
`jaxattn.lora.weight.LoraWeight`.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxattn.config import ModelConfig
from jaxattn.config.lora import LoraConfig
from jaxattn.lora.weight import LoraWeight, is_lora
from jaxattn.quantization import is_quantized

KV = "kv"  # MLA's wkv_b: one part that "k" and "v" target together


# ---------------------------------------------------------------- which weights each target names

# A Linear module's name -> the target of each part of its kernel's columns. The names are the modules' own
# (jaxattn.layers.gqa, jaxattn.layers.mla, jaxattn.layers.primitives.MLP, jaxattn.layers.moe.MoE); no two
# modules share a name, so the name alone says what a kernel is, wherever the block nests it.
_LINEAR_ROLES = {
    "qkv": ("q", "k", "v"), "query": ("q",), "key": ("k",), "value": ("v",), "out": ("o",),  # gqa
    "wq": ("q",), "wq_b": ("q",), "wo": ("o",),  # mla
    "gate_up": ("gate", "up"), "c_fc": ("up",), "down": ("down",), "c_proj": ("down",),  # MLP
    "shared_gate_up": ("gate", "up"), "shared_down": ("down",),  # MoE's shared experts
}
# A raw parameter's name -> (its part targets, its weight's axes past the leading ones: 2 for
# [in, out], 3 for wkv_b [R_lat, N, P + V]).
_PARAM_ROLES = {"experts_gate_up": (("experts",), 2), "experts_down": (("experts",), 2), "wkv_b": ((KV,), 3)}
# Part names of a several-part kernel (a one-part kernel's part is named by its module).
_PART_NAMES = {("q", "k", "v"): ("q", "k", "v"), ("gate", "up"): ("gate", "up")}


def roles_of(path: tuple[str, ...]) -> tuple[str, ...] | None:
    """The target of each part of the weight at parameter `path` (e.g. ("blocks_0", "attn", "qkv", "kernel")
    -> ("q", "k", "v")), or None for a parameter no target names. MLA's wkv_b has the one role `KV`."""
    if len(path) >= 2 and path[-1] == "kernel" and path[-2] in _LINEAR_ROLES:
        return _LINEAR_ROLES[path[-2]]
    if path and path[-1] in _PARAM_ROLES:
        return _PARAM_ROLES[path[-1]][0]
    return None


def role_targets(role: str) -> tuple[str, ...]:
    """The targets that adapt a part of role `role` (`KV`: "k" and "v" together)."""
    return ("k", "v") if role == KV else (role,)


def part_widths(path: tuple[str, ...], out: int, config: ModelConfig) -> tuple[int, ...]:
    """The widths of the parts of the weight at `path` whose output is `out` wide (`roles_of` it first)."""
    name = path[-2] if path[-1] == "kernel" else path[-1]
    return _widths(name, roles_of(path), out, config)


def _widths(name: str, roles: tuple[str, ...], out: int, config: ModelConfig) -> tuple[int, ...]:
    if name == "qkv":
        N, K, H = config.num_heads, config.num_kv_heads, config.head_dim
        return (N * H, K * H, K * H)
    if len(roles) == 2:  # [gate | up]
        return (out // 2, out // 2)
    return (out,)


def _wanted(role: str, targets: tuple[str, ...]) -> bool:
    if role != KV:
        return role in targets
    named = [t for t in ("k", "v") if t in targets]
    if len(named) == 1:
        raise ValueError(f"LoraConfig.targets names {named[0]!r} without {'v' if named[0] == 'k' else 'k'!r}: this MLA "
                         "model computes keys and values from one up-projection (wkv_b), so they are adapted together")
    return bool(named)


def _unwrap(params: Any) -> tuple[Any, bool]:
    params = nn.unbox(params)
    outer = hasattr(params, "keys") and set(params.keys()) == {"params"}
    return (params["params"] if outer else params), outer


def _rewrap(inner: Any, outer: bool) -> Any:
    return {"params": inner} if outer else inner


def _is_dict(x: Any) -> bool:
    return isinstance(x, dict) or (hasattr(x, "items") and not is_lora(x))


def _walk(tree: Any, visit: Callable[[str, str, Any, tuple], Any], path: tuple = ()) -> Any:
    """`tree` with each weight a role table names replaced by `visit(kind, name, weight, path)`
    (kind "linear": a module's kernel; "param": a raw parameter)."""
    out = {}
    for key, value in tree.items():
        if key in _LINEAR_ROLES and _is_dict(value) and "kernel" in value:
            out[key] = {**value, "kernel": visit("linear", key, value["kernel"], path + (key, "kernel"))}
        elif key in _PARAM_ROLES and not _is_dict(value):
            out[key] = visit("param", key, value, path + (key,))
        elif _is_dict(value):
            out[key] = _walk(value, visit, path + (key,))
        else:
            out[key] = value
    return out


def _stored_shape(value: Any) -> tuple[int, ...]:
    return tuple(value.shape) if is_quantized(value) else tuple(jnp.shape(value))


# ---------------------------------------------------------------- the adapters over a params tree


def add_lora(params: Any, config: ModelConfig, lora: LoraConfig, key: jax.Array) -> Any:
    """`params` (a DecoderLM's, boxed or not; unboxed on return) with every weight `lora.targets` names
    a `LoraWeight` over it (see the module docstring's table).

    Initialised as PEFT does: each `a` uniform(-1/sqrt(in), 1/sqrt(in)) (PEFT's
    `kaiming_uniform_(a=sqrt(5))` on `lora_A.weight [r, in]`), each `b` zeros, so the model computes
    what it computed. Adapters are stored in `config.param_dtype`. The base is kept as it is (float or
    quantized: quantize first for QLoRA); leading axes (stacked layers, experts) give each slice its
    own adapter.

    Raises:
      TypeError: `config` is not a ModelConfig, `lora` not a LoraConfig, or a targeted weight is
        already a LoraWeight.
      ValueError: a target that names no weight of this model (the message names it), or MLA's "k"
        without "v" (or the reverse).
    """
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config must be a jaxattn.ModelConfig, got {type(config).__name__}")
    if not isinstance(lora, LoraConfig):
        raise TypeError(f"lora must be a jaxattn.lora.LoraConfig, got {type(lora).__name__}")
    inner, outer = _unwrap(params)
    dtype, r = jnp.dtype(config.param_dtype), lora.rank
    matched: set[str] = set()
    counter = iter(range(1 << 30))  # each weight its own key, in tree order

    def visit(kind, name, value, path):
        roles, axes = (_LINEAR_ROLES[name], 2) if kind == "linear" else _PARAM_ROLES[name]
        if is_lora(value):
            raise TypeError(f"{'/'.join(path)} already has LoRA adapters")
        wanted = [_wanted(role, lora.targets) for role in roles]
        for role, w in zip(roles, wanted):
            if w:
                matched.update(role_targets(role))
        if not any(wanted):
            return value
        stored = _stored_shape(value)
        if is_quantized(value):
            lead, (d_in, out) = stored[:-2], stored[-2:]
            weight_shape = (d_in, out) if axes == 2 else (d_in, config.num_heads, out // config.num_heads)
        else:
            lead, weight_shape = stored[:len(stored) - axes], stored[len(stored) - axes:]
        d_in, out = weight_shape[0], math.prod(weight_shape[1:])
        widths = _widths(name, roles, out, config)
        names = _PART_NAMES.get(roles, (name,))
        k = jax.random.fold_in(key, next(counter))
        bound = 1.0 / math.sqrt(d_in)
        a = tuple(jax.random.uniform(jax.random.fold_in(k, j), (*lead, d_in, r), dtype, -bound, bound) if w else None
                  for j, w in enumerate(wanted))
        b = tuple(jnp.zeros((*lead, r, width), dtype) if w else None for width, w in zip(widths, wanted))
        return LoraWeight(value, a, b, parts=names, widths=widths, weight_shape=tuple(weight_shape),
                          scale=lora.scale, dropout=lora.dropout)

    out = _walk(inner, visit)
    unmatched = [t for t in lora.targets if t not in matched]
    if unmatched:
        raise ValueError(f"LoraConfig.targets {unmatched} name no weight of this model (see jaxattn.lora's table: "
                         f"e.g. 'experts' needs a mixture of experts, 'gate' a gated MLP)")
    return _rewrap(out, outer)


def _map_lora(params: Any, fn: Callable[[LoraWeight], Any]) -> Any:
    return jax.tree.map(lambda x: fn(x) if is_lora(x) else x, params, is_leaf=is_lora)


def split_lora(params: Any) -> tuple[Any, Any]:
    """`(adapters, frozen)` of params with `LoraWeight`s (boxed or not).

    `adapters` holds only the adapters' arrays, what an optimizer and a checkpoint see: the params'
    nesting down to each LoraWeight, which becomes `{part: {"a": a, "b": b}}` for its adapted parts;
    subtrees without adapters are left out. `frozen` is `params` with each LoraWeight's `a` and `b`
    emptied (None): the base and everything else. `combine_lora(frozen, adapters)` undoes it.
    """
    inner, outer = _unwrap(params)

    def adapters(tree):
        if is_lora(tree):
            return {part: {"a": a, "b": b} for part, a, b in zip(tree.parts, tree.a, tree.b) if a is not None}
        if not _is_dict(tree):
            return None
        kept = {k: sub for k, v in tree.items() if (sub := adapters(v))}
        return kept or None

    frozen = _map_lora(inner, lambda w: w.replace(a=(None,) * len(w.a), b=(None,) * len(w.b)))
    return adapters(inner) or {}, _rewrap(frozen, outer)


def combine_lora(frozen: Any, adapters: Any) -> Any:
    """`split_lora`'s inverse: each LoraWeight of `frozen` with its parts' `a`, `b` from `adapters`.

    The base arrays are reused, not copied. ValueError when `adapters` lacks a LoraWeight's entry, or
    holds one `frozen` has no LoraWeight for (the message names the path)."""
    inner, outer = _unwrap(frozen)

    def walk(tree, ad, path):
        if is_lora(tree):
            if not ad:
                raise ValueError(f"adapters at {'/'.join(path)}: missing (the params hold a LoraWeight there)")
            if set(ad) - set(tree.parts):
                raise ValueError(f"adapters at {'/'.join(path)}: expected parts of {tree.parts}, got {sorted(ad)}")
            a = tuple(ad[p]["a"] if p in ad else None for p in tree.parts)
            b = tuple(ad[p]["b"] if p in ad else None for p in tree.parts)
            return tree.replace(a=a, b=b)
        if not _is_dict(tree):
            if ad is not None:
                raise ValueError(f"adapters at {'/'.join(path)}: the params hold no LoraWeight there")
            return tree
        ad = ad or {}
        extra = set(ad) - set(tree)
        if extra:
            raise ValueError(f"adapters at {'/'.join(path + (sorted(extra)[0],))}: the params have no such entry")
        return {k: walk(v, ad.get(k), path + (k,)) for k, v in tree.items()}

    return _rewrap(walk(inner, nn.unbox(adapters), ()), outer)


def merge_lora(params: Any) -> Any:
    """Plain float params: each LoraWeight replaced by `base + scale * a @ b` (`LoraWeight.merged`) in the
    base's dtype (a quantized base is dequantized first: the result is float32)."""
    inner, outer = _unwrap(params)
    return _rewrap(_map_lora(inner, lambda w: w.merged()), outer)


def count_lora_params(params: Any) -> int:
    """The number of adapter numbers (every `a` and `b`) in params with LoraWeights (for `split_lora`'s
    adapters, every leaf is one: count their sizes)."""
    inner, _ = _unwrap(params)
    return sum(x.size for leaf in jax.tree.leaves(inner, is_leaf=is_lora) if is_lora(leaf)
               for x in (*leaf.a, *leaf.b) if x is not None)
