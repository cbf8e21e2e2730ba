"""The engine's LoRA adapters: the names it knows, which of them sit in the model's slots, which wait on the host.

With `EngineConfig.max_loras` > 0 the model runner's parameters carry `max_loras` slots of rank
`max_lora_rank` on every weight `EngineConfig.lora_targets` names (`jaxattn.lora.empty_slots`); a step's
token rows each choose one (`jaxattn.lora.with_token_slots`, -1 for none), so rows of different
adapters share a step and no program is compiled again when adapters come, go or change rows.

`LoraTable` is the bookkeeping (host only; the model runner writes the slots it names):

* `add(name, params)`: an adapter (a params tree with `LoraWeight`s, as `jaxattn.lora.add_lora` and
  `jaxattn.hf.peft.load_adapter` give) kept on the host, its bases dropped (`host_adapter`), and written
  into a free slot when there is one. Each add has a generation of its own: the prefix cache keys a
  request's pages from its adapter's `cache_root`, a hash of the name and the generation, so an
  adapter removed and added again under the same name never finds the pages of the one before.
* `acquire(name, busy)` at admission: the adapter's slot, written first where it has none: a free slot,
  else the least recently used slot no running request uses (`busy`), whose adapter stays on the host.
  None when every slot is busy: the request waits, as it waits for pages.
* `remove(name, in_use)`: refused (`LoraInUse`) while a request running or waiting names the adapter;
  else it is forgotten and its slot cleared. Refusing, rather than waiting for those requests, answers at
  once and never leaves an unload pending behind traffic that keeps naming the adapter; the caller
  stops sending it and unloads once the last such request has ended.

`SlotWriter` is what the model runner writes a slot with: one program, compiled when the engine is
built, the slots' stacks donated, so a swap writes one slot's numbers and compiles nothing.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import itertools
from typing import Any, Callable

import jax
import numpy as np
from flax.traverse_util import flatten_dict, unflatten_dict

from jaxattn.lora import is_lora, is_slots
from jaxattn.serving.validation import RequestError


class UnknownLora(RequestError):
    """An adapter name the engine does not hold (param "lora", code "model_not_found")."""

    def __init__(self, name: str, known: tuple[str, ...]):
        held = ", ".join(repr(n) for n in known) or "none"
        super().__init__(f"lora {name!r} is not loaded (loaded: {held})", param="lora", code="model_not_found")


class LoraInUse(ValueError):
    """An adapter that requests running or waiting still name cannot be removed."""


class LoraExists(ValueError):
    """An adapter name already held."""


@dataclasses.dataclass(frozen=True)
class HostAdapter:
    """An adapter kept on the host: its `LoraWeight`s (bases as shapes only, `a`, `b` as numpy arrays),
    its largest rank, its load's generation and the prefix cache's first key for its requests."""

    name: str
    params: Any
    rank: int
    generation: int

    @property
    def cache_root(self) -> bytes:
        return hashlib.sha256(f"lora\0{self.name}\0{self.generation}".encode()).digest()

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in jax.tree.leaves(self.params) if isinstance(x, np.ndarray))


def _host_weight(weight, rank: int):
    """A LoraWeight with its base as a shape (float32, the stored shape: the adapter alone is kept), its
    `a`, `b` numpy arrays zero-padded to `rank` (every slot write then has the same shapes)."""
    def padded(x, axis):
        if x is None:
            return None
        x = np.asarray(jax.device_get(x))
        width = [(0, 0)] * x.ndim
        width[axis] = (0, max(rank - x.shape[axis], 0))
        return np.pad(x, width)
    return weight.replace(base=jax.ShapeDtypeStruct(tuple(weight.base.shape), np.float32),
                          a=tuple(padded(a, -1) for a in weight.a), b=tuple(padded(b, -2) for b in weight.b))


def host_adapter(params: Any, rank: int) -> tuple[Any, int]:
    """`params`' LoraWeights alone (their frozen bases dropped, the adapters as numpy arrays zero-padded to
    `rank`: the same sums), and their largest rank before padding. ValueError (naming `adapter_params`)
    where `params` hold none."""
    inner = params.get("params", params) if hasattr(params, "get") else params
    if not hasattr(inner, "items"):
        raise ValueError(f"adapter_params must be a params tree with LoraWeights, got {type(params).__name__}")
    adapters = {path: w for path, w in flatten_dict(dict(inner)).items() if is_lora(w)}
    if not adapters:
        raise ValueError("adapter_params hold no LoraWeight (jaxattn.lora.add_lora or jaxattn.hf.peft.load_adapter "
                         "make them)")
    own = max(a.shape[-1] for w in adapters.values() for a in w.a if a is not None)
    return unflatten_dict({path: _host_weight(w, rank) for path, w in adapters.items()}), own


def _write_stacks(stacks: dict, slot, values: dict) -> dict:
    """Each slotted weight's `(a, b, scale)` stacks with slot `slot` set to `values`' (one program)."""
    put = lambda x, v: None if x is None else x.at[slot].set(v.astype(x.dtype))  # noqa: E731
    return {path: (tuple(map(put, a, values[path][0])), tuple(map(put, b, values[path][1])),
                   scale.at[slot].set(values[path][2]))
            for path, (a, b, scale) in stacks.items()}


class SlotWriter:
    """Writes an adapter into one slot of every `LoraSlots` of a params tree in one compiled program, the
    slots' stacks donated: only the slot's numbers are written, and the program is the same for every
    adapter and slot (compiled once, when the engine is built). The same values as
    `jaxattn.lora.write_slot` (and `clear_slot` for None): a part or weight the adapter leaves alone is
    zeros in the slot, scale 0."""

    def __init__(self, params: Any):
        self.slotted = {path: w for path, w in flatten_dict(params).items() if is_slots(w)}
        self._program = jax.jit(_write_stacks, donate_argnums=0)

    def values(self, adapter: Any | None) -> dict:
        """Per slotted weight, the slot's `(a parts, b parts, scale)` as numpy arrays (zeros where `adapter`,
        a `host_adapter` tree of the slots' rank, or None, leaves it)."""
        given = {} if adapter is None else {p: w for p, w in flatten_dict(adapter).items() if is_lora(w)}
        out = {}
        for path, slots in self.slotted.items():
            weight = given.get(path)
            new_a = weight.a if weight is not None else (None,) * len(slots.a)
            new_b = weight.b if weight is not None else (None,) * len(slots.b)
            a = tuple(None if x is None else np.zeros(x.shape[1:], x.dtype) if v is None else v
                      for x, v in zip(slots.a, new_a))
            b = tuple(None if x is None else np.zeros(x.shape[1:], x.dtype) if v is None else v
                      for x, v in zip(slots.b, new_b))
            out[path] = a, b, np.float32(0.0 if weight is None else weight.scale)
        return out

    def __call__(self, params: Any, slot: int, adapter: Any | None) -> Any:
        """`params` with slot `slot` holding `adapter` (None: emptied); `params`' slot stacks are donated."""
        flat = flatten_dict(params)
        stacks = {path: (flat[path].a, flat[path].b, flat[path].scale) for path in self.slotted}
        written = self._program(stacks, np.int32(slot), self.values(adapter))
        flat.update({path: flat[path].replace(a=a, b=b, scale=scale) for path, (a, b, scale) in written.items()})
        return unflatten_dict(flat)


class LoraTable:
    """Adapter names -> host copies, and which sit in the `max_loras` slots (see the module docstring).

    Args:
      max_loras, max_rank: the slots, and their rank.
      write: `write(slot, params)` puts an adapter into a slot (None: clears it); it raises ValueError
        for an adapter that does not fit the slots (a rank above theirs, a weight without slots).
      check: `check(params)` raises that ValueError without writing anything.
    """

    def __init__(self, max_loras: int, max_rank: int, write: Callable[[int, Any], None],
                 check: Callable[[Any], None]):
        self.max_loras, self.max_rank, self._write, self._check = max_loras, max_rank, write, check
        self.adapters: dict[str, HostAdapter] = {}
        self.holder: list[str | None] = [None] * max_loras  # each slot's adapter
        self._used: collections.OrderedDict[int, None] = collections.OrderedDict((s, None) for s in range(max_loras))
        self._generations = itertools.count(1)
        self.names: tuple[str, ...] = ()  # replaced whole on each change: other threads read it as it is
        self.swaps = 0  # adapters written into a slot at admission

    def slot_of(self, name: str) -> int | None:
        return self.holder.index(name) if name in self.holder else None

    def get(self, name: str) -> HostAdapter:
        """The adapter named; `UnknownLora` where none is."""
        adapter = self.adapters.get(name)
        if adapter is None:
            raise UnknownLora(name, self.names)
        return adapter

    def add(self, name: str, params: Any) -> HostAdapter:
        """Keeps an adapter under `name` (written into a free slot if there is one). ValueError for a
        name that is not a non-empty string, `LoraExists` for one already held, ValueError for an
        adapter that does not fit the slots (nothing is kept then)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty str, got {name!r}")
        if name in self.adapters:
            raise LoraExists(f"lora {name!r} is already loaded: remove it first")
        kept, rank = host_adapter(params, self.max_rank)
        self._check(kept)
        adapter = HostAdapter(name, kept, rank, next(self._generations))
        free = next((s for s, held in enumerate(self.holder) if held is None), None)
        if free is not None:
            self._put(free, adapter)
        self.adapters[name] = adapter
        self.names = tuple(self.adapters)
        return adapter

    def remove(self, name: str, in_use: int) -> None:
        """Forgets an adapter and clears its slot. `UnknownLora` for a name not held; `LoraInUse` while
        `in_use` (the requests running or waiting that name it) is not 0."""
        self.get(name)
        if in_use:
            raise LoraInUse(f"lora {name!r} is in use by {in_use} running or waiting request"
                            f"{'s' if in_use > 1 else ''}: unload it once they end")
        slot = self.slot_of(name)
        if slot is not None:
            self._write(slot, None)
            self.holder[slot] = None
            self._used.move_to_end(slot, last=False)  # a free slot is taken first
        del self.adapters[name]
        self.names = tuple(self.adapters)

    def acquire(self, name: str, busy: set[str]) -> int | None:
        """The slot holding adapter `name`, written first if it sits on the host only: into a free slot,
        else over the least recently used slot whose adapter no request in `busy` names. None when
        every slot is busy (the request waits)."""
        slot = self.slot_of(name)
        if slot is None:
            slot = next((s for s in self._used if self.holder[s] is None), None)
            if slot is None:
                slot = next((s for s in self._used if self.holder[s] not in busy), None)
            if slot is None:
                return None
            self._put(slot, self.get(name))
            self.swaps += 1
        self._used.move_to_end(slot)
        return slot

    def _put(self, slot: int, adapter: HostAdapter) -> None:
        self._write(slot, adapter.params)
        self.holder[slot] = adapter.name
        self._used.move_to_end(slot)
