"""LoRA: low-rank adapters on a model's frozen matmul weights (Hu et al. 2021; PEFT's conventions).

A targeted weight `W [in, out]` becomes `W + scale * A B` with `A [in, r]` and `B [r, out]`,
`scale = alpha / r` (`alpha / sqrt(r)` with rsLoRA). Only A and B train; W stays as it was, float or
a `jaxattn.quantization.QuantizedWeight` (QLoRA).

Letters: D model dim, N heads, K kv heads, H head dim, F mlp hidden, E experts, r rank, R stacked
layers (a scan's leading axis).

* `LoraWeight` replaces a parameter in the tree (a pytree, as `QuantizedWeight` is): the frozen `base`
  and, for each *part* of the weight's output columns, an optional adapter `a [..., in, r]`,
  `b [..., r, width]`. Parts follow jaxattn's column order: a fused `qkv` kernel has three (q, k, v:
  widths `N*H, K*H, K*H`), a gated MLP's `gate_up` two (gate, up: `F, F`), every other weight one. A
  part that is not targeted has `a = b = None` (no delta). Leading axes (layers stacked for a scan,
  `[R, in, out]`; experts, `[E, in, out]`) are on every leaf alike, so `nn.scan` slices them.
* `jaxattn.layers.primitives.Linear` runs a `LoraWeight` kernel as the base matmul (the float or the quantized
  kernel) plus `scale * (dropout(x) @ a) @ b` per part; the routed experts and MLA's `wkv_b` read
  theirs through `float_param`, merged (`base + scale * a @ b`, per expert).
* Dropout contract: the adapters' input dropout (PEFT's `lora_dropout`, on x) runs only when the module
  is applied with a "dropout" rng (`rngs={"dropout": key}`, what training passes when its dropout is
  on) and `LoraConfig.dropout > 0`; without the rng it is off, whatever `deterministic` says. Merged
  weights (experts, `wkv_b`) take no adapter dropout.

Targets (`TARGETS`) are logical names, mapped to weights by the module that holds them (`_ROLES`):

| target | weight |
| --- | --- |
| q, k, v | `attn/query`, `attn/key`, `attn/value`, or the parts of `attn/qkv`; MLA: q is `wq` or `wq_b` |
| o | `attn/out`; MLA: `wo` |
| gate, up | the parts of `mlp/gate_up` and of a mixture's `shared_gate_up`; up alone: a plain MLP's `mlp/c_fc` |
| down | `mlp/down`, `mlp/c_proj`, a mixture's `shared_down` |
| experts | the routed experts' `experts_gate_up [E, D, 2F]`, `experts_down [E, F, D]` (one part each, per expert) |

MLA computes keys and values from one up-projection of the latent, `wkv_b [R_lat, N, P + V]`
(W_UK and W_UV per head, side by side): "k" and "v" there both name `wkv_b` as one part (its columns
interleave them per head), so they are targeted together or not at all (naming one alone is a
ValueError). The shared latent compression `wkv_a` (and `wq_a`) is no target: it feeds every head.
The router, norms, embeddings and the head are never adapted.

Functions: `add_lora` (params -> params with `LoraWeight`s), `split_lora` / `combine_lora` (the
adapters alone, for the optimizer and checkpoints, and the frozen rest), `merge_lora` (plain float
params), `count_lora_params`. `jaxattn.hf.peft` reads and writes PEFT's adapter files.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import jax.scipy.linalg

from jaxattn.config import ModelConfig
from jaxattn.quantization import dequantize, float_param as quantized_float_param, is_quantized

TARGETS = ("q", "k", "v", "o", "gate", "up", "down", "experts")
KV = "kv"  # MLA's wkv_b: one part that "k" and "v" target together


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Which weights get adapters and how they scale.

    Attributes:
      rank: r > 0, the adapters' inner width.
      alpha: the scale's numerator (PEFT's `lora_alpha`).
      dropout: in [0, 1), the rate of the dropout on the adapters' input (see the module docstring
        for when it runs).
      rslora: scale by `alpha / sqrt(rank)` (rank-stabilised LoRA) instead of `alpha / rank`.
      targets: logical names from `TARGETS`, at least one.
    """

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    rslora: bool = False
    targets: tuple[str, ...] = ("q", "k", "v", "o")

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank <= 0:
            raise ValueError(f"LoraConfig.rank must be a positive integer, got {self.rank!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not math.isfinite(self.alpha):
            raise ValueError(f"LoraConfig.alpha must be a finite number, got {self.alpha!r}")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise ValueError(f"LoraConfig.dropout must be in [0, 1), got {self.dropout!r}")
        if not isinstance(self.rslora, bool):
            raise ValueError(f"LoraConfig.rslora must be a bool, got {self.rslora!r}")
        targets = (self.targets,) if isinstance(self.targets, str) else self.targets
        try:
            targets = tuple(targets)
        except TypeError:
            raise ValueError(f"LoraConfig.targets must be names from {TARGETS}, got {self.targets!r}") from None
        unknown = [t for t in targets if t not in TARGETS]
        if unknown or not targets:
            raise ValueError(f"LoraConfig.targets must be one or more of {TARGETS}, got {self.targets!r}")
        object.__setattr__(self, "targets", tuple(dict.fromkeys(targets)))  # a list is accepted; order kept, once each
        object.__setattr__(self, "alpha", float(self.alpha))
        object.__setattr__(self, "dropout", float(self.dropout))

    @property
    def scale(self) -> float:
        """`alpha / rank`, or `alpha / sqrt(rank)` with rsLoRA."""
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


@flax.struct.dataclass
class LoraWeight:
    """A frozen weight and low-rank adapters on parts of its output columns (a pytree; the rest static).

    Attributes:
      base: the frozen weight as the model stores it: a float array `[..., *weight_shape]` or a
        `QuantizedWeight` (`[..., in, out]`, out flattened).
      a: per part, `[..., in, r]` or None (the part is not adapted).
      b: per part, `[..., r, width]` or None (with its `a`).
      parts: the parts' names, e.g. ("q", "k", "v"), ("gate", "up"), ("out",).
      widths: the parts' widths; they sum to `out`, in column order.
      weight_shape: the float weight's shape the model reads, leading axes aside: `(in, out)`, or MLA's
        `wkv_b` `(R_lat, N, P + V)` (out = the product of all but the first).
      scale: alpha / r (or alpha / sqrt(r)).
      dropout: the rate of the dropout on the adapters' input.
    """

    base: Any
    a: tuple
    b: tuple
    parts: tuple[str, ...] = flax.struct.field(pytree_node=False, default=())
    widths: tuple[int, ...] = flax.struct.field(pytree_node=False, default=())
    weight_shape: tuple[int, ...] = flax.struct.field(pytree_node=False, default=())
    scale: float = flax.struct.field(pytree_node=False, default=1.0)
    dropout: float = flax.struct.field(pytree_node=False, default=0.0)

    @property
    def lead(self) -> tuple[int, ...]:
        """The leading axes (`[R]`, `[E]`, `[R, E]` or none)."""
        if is_quantized(self.base):
            return tuple(self.base.shape[:-2])
        return tuple(self.base.shape[:self.base.ndim - len(self.weight_shape)])

    @property
    def in_features(self) -> int:
        return self.weight_shape[0]

    @property
    def out_features(self) -> int:
        return math.prod(self.weight_shape[1:])

    @property
    def offsets(self) -> tuple[int, ...]:
        """Each part's first column."""
        return tuple(sum(self.widths[:j]) for j in range(len(self.widths)))

    def delta(self, dtype=jnp.float32) -> jax.Array:
        """`scale * [a_0 b_0 | a_1 b_1 | ...]` `[..., in, out]` (zeros for parts without adapters)."""
        lead, f32 = self.lead, jnp.float32
        cols = [jnp.zeros((*lead, self.in_features, w), f32) if a is None
                else jnp.matmul(a.astype(f32), b.astype(f32), precision=jax.lax.Precision.HIGHEST)
                for a, b, w in zip(self.a, self.b, self.widths)]
        return (self.scale * jnp.concatenate(cols, axis=-1)).astype(dtype)

    def base_float(self, dtype=None) -> jax.Array:
        """The base as a float `[..., in, out]` (a quantized one dequantized)."""
        w = dequantize(self.base, dtype or jnp.float32) if is_quantized(self.base) else self.base
        w = w if dtype is None else w.astype(dtype)
        return w.reshape(*self.lead, self.in_features, self.out_features)

    def merged(self, dtype=None) -> jax.Array:
        """`base + delta` `[..., *weight_shape]` in `dtype` (default: a float base's dtype; float32 if quantized)."""
        dtype = dtype or (jnp.float32 if is_quantized(self.base) else self.base.dtype)
        w = self.base_float(jnp.float32) + self.delta(jnp.float32)
        return w.reshape(*self.lead, *self.weight_shape).astype(dtype)


def is_lora(x: Any) -> bool:
    return isinstance(x, LoraWeight)


def lora_delta(rows: jax.Array, weight: LoraWeight, matmul: Callable, dropout_key: jax.Array | None) -> jax.Array:
    """`scale * [(drop(rows) a_j) b_j]_j` `[M, out]` for rows `[M, in]` of a 2-D `LoraWeight`, in rows' dtype.

    `matmul(x, w)` is the Linear's matmul kernel; `dropout_key` (None: no dropout) draws an independent
    mask per part, as PEFT's separate modules (q_proj, k_proj, ...) each drop their own input.
    """
    if dropout_key is not None and weight.dropout > 0:
        return _delta_per_part(rows, weight, matmul, dropout_key)
    return _delta_shared_input(rows, weight, matmul)


def _delta_shared_input(rows: jax.Array, weight: LoraWeight, matmul: Callable) -> jax.Array:
    """`lora_delta` when every part reads the same rows: two products for all parts, not two per part.

    `h = rows [a_0 | a_1 | ...]` `[M, sum r]`, then `h` times the block-diagonal `[sum r, out]` of the b's
    (zero columns for a part without adapters): the same sums as part by part, plus exact zeros. Small
    products cost their fixed overhead more than their flops (a fused q, k, v Linear: 2 dots, not 6).
    """
    dtype, adapted = rows.dtype, [a.astype(rows.dtype) for a in weight.a if a is not None]
    if not adapted:
        return jnp.zeros((rows.shape[0], weight.out_features), dtype)
    h = matmul(rows, jnp.concatenate(adapted, axis=-1)).astype(dtype)  # [M, sum r]
    # a part without adapters: a block of no rows, its width of zero columns
    diagonal = jax.scipy.linalg.block_diag(*(jnp.zeros((0, width), dtype) if a is None else b.astype(dtype)
                                             for a, b, width in zip(weight.a, weight.b, weight.widths)))  # [sum r, out]
    return matmul(h, diagonal).astype(dtype) * jnp.asarray(weight.scale, dtype)


def _delta_per_part(rows: jax.Array, weight: LoraWeight, matmul: Callable, dropout_key: jax.Array) -> jax.Array:
    """`lora_delta` with dropout: each part's own mask on its own copy of the rows."""
    M, dtype = rows.shape[0], rows.dtype
    cols = []
    for j, (a, b, width) in enumerate(zip(weight.a, weight.b, weight.widths)):
        if a is None:
            cols.append(jnp.zeros((M, width), dtype))
            continue
        keep = jax.random.bernoulli(jax.random.fold_in(dropout_key, j), 1.0 - weight.dropout, rows.shape)
        x = jnp.where(keep, rows / (1.0 - weight.dropout), 0.0).astype(dtype)
        h = matmul(x, a.astype(dtype)).astype(dtype)  # [M, r]
        cols.append(matmul(h, b.astype(dtype)).astype(dtype) * jnp.asarray(weight.scale, dtype))  # [M, width]
    return jnp.concatenate(cols, axis=-1)


def float_param(module: nn.Module, name: str, init, shape: tuple[int, ...], dtype) -> jax.Array:
    """`jaxattn.quantization.float_param` (a float parameter, a quantized one dequantized), and a
    `LoraWeight` merged on read: `base + scale * a @ b` (per expert) reshaped to `shape` in `dtype`.
    What the routed experts and MLA's `wkv_b` read (no matmul kernel of theirs takes an adapter)."""
    if module.has_variable("params", name):
        stored = module.get_variable("params", name)
        if is_lora(stored):
            return stored.merged(dtype).reshape(shape)
    return quantized_float_param(module, name, init, shape, dtype)


# ---------------------------------------------------------------- which weights each target names

# A Linear module's name -> the target of each part of its kernel's columns. The names are the
# modules' own (jaxattn.layers.gqa, jaxattn.layers.mla, jaxattn.layers.primitives.MLP, jaxattn.layers.moe.MoE); no two modules
# share a name, so the name alone says what a kernel is, wherever the block nests it.
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
