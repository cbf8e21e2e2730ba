"""Which Hugging Face tensors hold which jaxattn parameter, per family, as data used both ways.

A layout is a list of `Entry`: one jaxattn parameter (its path in the Flax
tree), the Hugging Face tensor(s) it is stored as, their shapes, and a
`Codec` (a pair of inverse array maps). Loading reads an entry's tensors and
applies `to_jax`; exporting applies `to_hf` and writes them. Layouts are
built from the `ModelConfig` alone, so the same list validates a checkpoint
(names and shapes, before any data is read), loads it, and writes it.

Conventions: torch `nn.Linear` weights are `[out, in]`, jaxattn kernels
`[in, out]` (`LINEAR` transposes); GPT-2's `Conv1D` is already `[in, out]`.
Where an architecture always has a bias that a jaxattn config may lack
(GPT-2, GPT-NeoX's MLP and LayerNorms, `attention_bias` when only some
projections are biased), the entry is `zero_fill`: exporting writes zeros.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from jaxattn.config import ModelConfig

Shape = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Codec:
    """`to_jax(hf tensors) -> jaxattn array` and its inverse `to_hf(array) -> hf tensors`."""

    to_jax: Callable[[list[np.ndarray]], np.ndarray]
    to_hf: Callable[[np.ndarray], list[np.ndarray]]


SAME = Codec(lambda t: t[0], lambda a: [a])
LINEAR = Codec(lambda t: t[0].T, lambda a: [a.T])
# Gated MLPs: jaxattn's gate_up kernel is [D, 2F] = [gate | up]; biases [2F] likewise.
GATE_UP = Codec(lambda t: np.concatenate([t[0].T, t[1].T], axis=1), lambda a: [x.T for x in np.split(a, 2, axis=1)])
GATE_UP_BIAS = Codec(lambda t: np.concatenate(t), lambda a: np.split(a, 2))
# Stacked experts: E `[out, in]` tensors (one per expert) or one fused `[E, out, in]` <-> jaxattn's `[E, in, out]`.
STACKED = Codec(lambda t: np.stack(t).transpose(0, 2, 1), lambda a: list(a.transpose(0, 2, 1)))
FUSED = Codec(lambda t: t[0].transpose(0, 2, 1), lambda a: [a.transpose(0, 2, 1)])


def stacked_gate_up(experts: int) -> Codec:
    """E gate then E up projections `[F, D]` (one per expert) <-> `experts_gate_up [E, D, 2F]` = [gate | up]."""
    def to_hf(a):
        gate, up = np.split(a.transpose(0, 2, 1), 2, axis=1)  # [E, F, D] each
        return list(gate) + list(up)
    return Codec(lambda t: np.concatenate([np.stack(t[:experts]), np.stack(t[experts:])], axis=1).transpose(0, 2, 1),
                 to_hf)


def neox_qkv(heads: int, head_dim: int, *, bias: bool) -> Codec:
    """GPT-NeoX fuses q, k, v per head (rows `[N, 3, H]`); jaxattn's fused columns are `[3, N, H]`."""
    def to_jax(t):
        w = t[0].reshape(heads, 3, head_dim, -1).transpose(1, 0, 2, 3).reshape(3 * heads * head_dim, -1)
        return w[:, 0] if bias else w.T

    def to_hf(a):
        w = (a[:, None] if bias else a.T).reshape(3, heads, head_dim, -1).transpose(1, 0, 2, 3)
        w = w.reshape(3 * heads * head_dim, -1)
        return [w[:, 0] if bias else w]
    return Codec(to_jax, to_hf)


def kv_b(rank: int, heads: int, width: int) -> Codec:
    """DeepSeek's kv_b_proj `[N (P + V), R]` <-> jaxattn's 3-D `wkv_b` `[R, N, P + V]`."""
    return Codec(lambda t: t[0].T.reshape(rank, heads, width), lambda a: [a.reshape(rank, heads * width).T])


def permuted(codec: Codec, columns: np.ndarray | None) -> Codec:
    """`codec` with the jaxattn array's last axis permuted by `columns` on the way out (and back on the way in)."""
    if columns is None:
        return codec
    inverse = np.argsort(columns)
    return Codec(lambda t: codec.to_jax(t)[..., inverse], lambda a: codec.to_hf(a[..., columns]))


def half_split_columns(heads: int, head_dim: int, rotary_dim: int | None = None) -> np.ndarray:
    """Columns that turn interleaved RoPE pairs `(x[2p], x[2p+1])` into half-split `(y[p], y[p + R/2])`.

    Applied to the query and key projections (and their biases and norms),
    it leaves every `q . k` unchanged: the same rotation, dims renamed. Only
    the first `rotary_dim` R (default: all) dims of each head rotate (partial
    rotary, docs/theory.md §19); the others keep their place.
    """
    R = head_dim if rotary_dim is None else rotary_dim
    one = np.concatenate([np.arange(0, R, 2), np.arange(1, R, 2), np.arange(R, head_dim)])
    return np.concatenate([h * head_dim + one for h in range(heads)])


@dataclasses.dataclass(frozen=True)
class Entry:
    """One jaxattn parameter and the Hugging Face tensors it is stored as.

    Attributes:
      path: the parameter's path in the Flax tree, e.g. `("blocks_0", "attn", "query", "kernel")`.
      names: its Hugging Face tensor names.
      shapes: their shapes, in the checkpoint's layout.
      codec: the array maps between the two.
      zero_fill: the architecture always has this tensor; a jaxattn model without the
        parameter exports zeros (the same function).
      alternatives: other forms a checkpoint may store the parameter in (same path; e.g. experts
        fused into one tensor rather than one per expert): loading takes the first form whose
        tensors are all stored (`jaxattn.hf.layouts.stored_form`); exporting writes this one.
      packed: the tensors are quantized codes and scales (U8, e.g. MXFP4's `*_blocks`, `*_scales`),
        read raw and given to `codec.to_jax` uncast, which returns floats (then cast to the
        model's dtype and checked for non-finite values). Only an alternative is packed: its
        codec's `to_hf` is never called (export writes the entry's float form).
    """

    path: tuple[str, ...]
    names: tuple[str, ...]
    shapes: tuple[Shape, ...]
    codec: Codec = SAME
    zero_fill: bool = False
    alternatives: tuple["Entry", ...] = ()
    packed: bool = False


def linear(path: tuple[str, ...], name: str, d_in: int, d_out: int, *, bias: bool,
           conv1d: bool = False, columns: np.ndarray | None = None) -> list[Entry]:
    """A projection `name.weight` (+ `name.bias`) <-> `path/kernel` (+ `path/bias`)."""
    shape = (d_in, d_out) if conv1d else (d_out, d_in)
    entries = [Entry(path + ("kernel",), (f"{name}.weight",), (shape,),
                     permuted(SAME if conv1d else LINEAR, columns))]
    if bias:
        entries.append(Entry(path + ("bias",), (f"{name}.bias",), ((d_out,),), permuted(SAME, columns), True))
    return entries


def norm(path: tuple[str, ...], name: str, width: int, *, bias: bool = False,
         columns: np.ndarray | None = None) -> list[Entry]:
    """A norm's `name.weight` (+ `name.bias`) <-> `path/scale` (+ `path/bias`)."""
    entries = [Entry(path + ("scale",), (f"{name}.weight",), ((width,),), permuted(SAME, columns))]
    if bias:
        entries.append(Entry(path + ("bias",), (f"{name}.bias",), ((width,),), zero_fill=True))
    return entries


def gated_mlp(path: tuple[str, ...], name: str, c: ModelConfig, *, bias: bool) -> list[Entry]:
    """Llama/DeepSeek `gate_proj`, `up_proj`, `down_proj` <-> `gate_up`, `down`."""
    D, F = c.d_model, c.mlp_hidden
    entries = [Entry(path + ("gate_up", "kernel"), (f"{name}.gate_proj.weight", f"{name}.up_proj.weight"),
                     ((F, D), (F, D)), GATE_UP)]
    if bias:
        entries.append(Entry(path + ("gate_up", "bias"), (f"{name}.gate_proj.bias", f"{name}.up_proj.bias"),
                             ((F,), (F,)), GATE_UP_BIAS, True))
    return entries + linear(path + ("down",), f"{name}.down_proj", F, D, bias=bias)


def embeddings(c: ModelConfig, embed: str, head: str = "lm_head.weight") -> tuple[list[Entry], list[Entry]]:
    """Token embedding entries and, when untied, the output head's (`[V, D]` <-> `lm_head/kernel [D, V]`)."""
    first = [Entry(("wte", "embedding"), (embed,), ((c.vocab_size, c.d_model),))]
    last = [] if c.tie_embeddings else [Entry(("lm_head", "kernel"), (head,), ((c.vocab_size, c.d_model),), LINEAR)]
    return first, last
