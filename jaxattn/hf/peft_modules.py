"""Which Hugging Face module of a family's layout holds which part of which jaxattn weight, for PEFT's
LoRA adapter files (`jaxattn.hf.peft`).

`modules(family, config)` reads the mapping off the family's layout (`jaxattn.hf.weights.Entry`: path,
names, codec): an Entry whose path is a weight `jaxattn.lora.roles_of` names holds one Hugging Face
module per tensor name. The codec's `to_hf` applied to probe arrays (each column's index, each row's)
says, per tensor, which of our columns each of its output rows is and whether it is stored `[out, in]`
or `[in, out]` (GPT-2's Conv1D); a tensor that holds several of our parts, or mixes rows and columns,
gets the reason it cannot hold a PEFT adapter (`Module.why`).
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

from jaxattn.config import ModelConfig
from jaxattn.hf.checkpoint import flat_abstract_params
from jaxattn.hf.export import export_family
from jaxattn.hf.family import Family
from jaxattn.hf.layouts import layout
from jaxattn.hf.weights import Entry
from jaxattn.lora.params import part_widths, role_targets, roles_of

QKV = ("query", "key", "value")
EXPERTS_WHY = ("routed experts: PEFT 0.21 adapts them as per-expert modules or fused parameters "
               "(target_parameters), which jaxattn does not read or write")


@dataclasses.dataclass(frozen=True)
class Module:
    """One Hugging Face linear module of a family's layout that a LoRA target names.

    Attributes:
      name: its name in the transformers model, e.g. "model.layers.0.self_attn.q_proj".
      path: the layout's parameter path (unrolled, in the family's q/k/v form).
      part: which part of that weight it holds (None: several, or none to speak of; see `why`).
      columns: per Hugging Face output row, its column within the part (Hugging Face's order).
      conv1d: stored `[in, out]` (GPT-2's Conv1D) rather than `[out, in]`.
      targets: the `jaxattn.lora.TARGETS` that adapt it.
      why: why it cannot hold a PEFT adapter here (None: it can).
    """

    name: str
    path: tuple[str, ...]
    part: int | None
    columns: np.ndarray | None
    conv1d: bool
    targets: tuple[str, ...]
    why: str | None = None


def _module_name(tensor: str) -> str:
    return tensor[:-len(".weight")] if tensor.endswith(".weight") else tensor


def _probe(entry: Entry, shape: tuple[int, ...]) -> list[tuple[np.ndarray, bool] | None]:
    """Per tensor of `entry`: (our column of each Hugging Face output row, stored [in, out]?), or None
    where the codec moves rows and columns together (no per-row column to speak of)."""
    d_in, outs = shape[0], shape[1:]
    columns = np.broadcast_to(np.arange(math.prod(outs), dtype=np.int64).reshape(outs), shape).copy()
    rows = np.broadcast_to(np.arange(d_in, dtype=np.int64).reshape((d_in,) + (1,) * len(outs)), shape).copy()
    found = []
    for c, r in zip(entry.codec.to_hf(columns), entry.codec.to_hf(rows), strict=True):
        c, r = np.asarray(c), np.asarray(r)
        if c.ndim == 2 and r.shape[1] == d_in and (r == np.arange(d_in)[None, :]).all() and (c == c[:, :1]).all():
            found.append((c[:, 0], False))
        elif c.ndim == 2 and r.shape[0] == d_in and (r == np.arange(d_in)[:, None]).all() and (c == c[:1]).all():
            found.append((c[0], True))
        else:
            found.append(None)
    return found


def modules(family: Family, config: ModelConfig) -> dict[str, Module]:
    """`{module name: Module}` for every module of `family`'s layout of `config` (unrolled, in the
    family's q/k/v form) that a LoRA target names. One probe per kind of module: the layers' codecs
    are built alike, so a probe is shared by the same tensor names in every layer."""
    shapes = flat_abstract_params(config)
    probes: dict[tuple, list] = {}
    found: dict[str, Module] = {}
    for entry in layout(family, config):
        roles = roles_of(entry.path)
        if roles is None:
            continue
        names = [_module_name(name) for name in entry.names]
        if "experts" in roles:
            found.update((name, Module(name, entry.path, None, None, False, ("experts",), EXPERTS_WHY))
                         for name in names)
            continue
        shape = tuple(shapes[entry.path].shape)
        widths = part_widths(entry.path, math.prod(shape[1:]), config)
        offsets = np.cumsum((0,) + widths)
        kind = (tuple(re.sub(r"\.\d+\.", ".#.", name) for name in entry.names), shape)
        if kind not in probes:
            probes[kind] = _probe(entry, shape)
        for name, probe in zip(names, probes[kind]):
            if probe is None:
                found[name] = Module(name, entry.path, None, None, False, (),
                                     "its tensor mixes the weight's rows and columns")
                continue
            cols, conv1d = probe
            part = int(np.searchsorted(offsets, cols.min(), side="right") - 1)
            within = cols - offsets[part]
            if len(cols) != widths[part] or not np.array_equal(np.sort(within), np.arange(widths[part])):
                parts = sorted({roles[int(np.searchsorted(offsets, c, side="right") - 1)] for c in cols})
                found[name] = Module(name, entry.path, None, None, conv1d, (),
                                     f"one tensor holds the parts {parts} of {'/'.join(entry.path[-2:])}: PEFT gives "
                                     "it one lora_A, jaxattn one per part")
                continue
            found[name] = Module(name, entry.path, part, within, conv1d, role_targets(roles[part]))
    return found


def family_config(config: ModelConfig) -> tuple[Family, ModelConfig]:
    """The export family of `config` (unrolled) and `config` in that family's q/k/v form."""
    family = export_family(config)
    return family, (config if config.mla is not None else config.replace(fused_qkv=family.fused_qkv))


def locate(path: tuple[str, ...], part: int, config: ModelConfig) -> tuple[tuple[str, ...], int]:
    """Where the layout's (path, part) is in params of `config`'s q/k/v form: a separate projection is a
    part of a fused `qkv` and the reverse."""
    if config.mla is None and path[-1] == "kernel":
        if path[-2] in QKV and config.fused_qkv:
            return path[:-2] + ("qkv", "kernel"), QKV.index(path[-2])
        if path[-2] == "qkv" and not config.fused_qkv:
            return path[:-2] + (QKV[part], "kernel"), 0
    return path, part


def target_modules(written: list[str], every: set[str]) -> list[str]:
    """PEFT's `target_modules` for the `written` modules: each short name (the last component) when PEFT's
    suffix match on it picks exactly written modules out of `every` module, else the full names."""
    out = []
    for short in sorted({name.rsplit(".", 1)[-1] for name in written}):
        hits = {name for name in every if name == short or name.endswith("." + short)}
        mine = {name for name in written if name.rsplit(".", 1)[-1] == short}
        out.extend([short] if hits == mine else sorted(mine))
    return out


def every_module(entries: list[Entry]) -> set[str]:
    """The name of every module whose tensors the layout `entries` lists (a tensor name minus its last part)."""
    return {name.rsplit(".", 1)[0] for entry in entries for name in entry.names}
