"""The KV pool's size, checked against the memory the machine has before any of it is taken.

A pool is the engine's one large allocation. Sized to let every running sequence reach the context, it
can be most of a machine (SmolLM2-135M at 32 rows of 8,192 tokens: 11.25 GiB), so:

* given no size (`EngineConfig.num_pages` and `kv_memory_gib` None), the pool is the smaller of that full
  need and a share of the memory available now: on a CPU a quarter of the host's available memory and at
  most 4 GiB (vLLM's default CPU KV space); on an accelerator 70% of the device's free memory (the rest is
  the programs' scratch). It is never less than one sequence of `max_model_len`;
* a size asked for that is more than the memory available is refused (`ValueError`, naming both figures)
  before anything is allocated;
* where the memory available cannot be read (a device without memory statistics), the pool is what was
  asked, or the full need.

`pool_plan` says which, and what the pool guarantees: the tokens each of `max_seqs` rows can reach at once.
"""

from __future__ import annotations

import dataclasses

import jax
import psutil

from jaxattn.serving.engine_config import EngineConfig

CPU_SHARE, CPU_CAP = 0.25, 4 * 2**30
DEVICE_SHARE = 0.7


def available_bytes(device: jax.Device) -> int | None:
    """The memory a pool on `device` may come from, now: the host's available memory for a CPU, the
    device's limit less what it holds for an accelerator; None where the device does not say."""
    if device.platform == "cpu":
        return int(psutil.virtual_memory().available)
    stats = device.memory_stats() or {}
    if "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))


@dataclasses.dataclass(frozen=True)
class PoolPlan:
    """The pool's pages, and why that many.

    Attributes:
      pages: pages in the pool.
      reason: where the size comes from ("num_pages given", "kv_memory_gib given", "the full need", or the
        share of the memory available that bounded it).
      per_row: the tokens each of `max_seqs` rows can hold at once (at most `max_model_len`).
    """

    pages: int
    reason: str
    per_row: int


def _gib(size: float) -> str:
    return f"{size / 2**30:.1f} GiB"


def pool_plan(ec: EngineConfig, token_bytes: int, max_model_len: int, available: int | None,
              platform: str = "cpu") -> PoolPlan:
    """The pool for engine config `ec` (see the module docstring); ValueError for a size asked for that
    `available` bytes cannot hold, or a `kv_memory_gib` that holds less than one sequence."""
    page_bytes = token_bytes * ec.page_size
    pages_per_seq = -(-max_model_len // ec.page_size)
    if ec.num_pages is not None or ec.kv_memory_gib is not None:
        pages, asked = ((ec.num_pages, f"num_pages={ec.num_pages}") if ec.num_pages is not None else
                        (int(ec.kv_memory_gib * 2**30 // page_bytes), f"kv_memory_gib={ec.kv_memory_gib}"))
        if ec.num_pages is None and pages < pages_per_seq:
            raise ValueError(f"kv_memory_gib={ec.kv_memory_gib} holds {pages} pages of {ec.page_size} tokens "
                             f"({page_bytes} bytes each); one sequence of {max_model_len} tokens needs {pages_per_seq}")
        if available is not None and pages * page_bytes > available:
            raise ValueError(f"{asked} is a KV cache of {_gib(pages * page_bytes)}, more than the "
                             f"{_gib(available)} this machine has available; ask for less")
        reason = f"{asked.split('=')[0]} given"
    else:
        full = ec.max_seqs * pages_per_seq
        share = (None if available is None else
                 min(CPU_SHARE * available, CPU_CAP) if platform == "cpu" else DEVICE_SHARE * available)
        if share is None or full * page_bytes <= share:
            pages, reason = full, "the full need: every row can reach the context"
        else:
            pages = max(int(share // page_bytes), pages_per_seq)
            reason = (f"{CPU_SHARE:.0%} of the {_gib(available)} available, at most {_gib(CPU_CAP)}" if platform == "cpu"
                      else f"{DEVICE_SHARE:.0%} of the device's {_gib(available)} free")
            if pages * page_bytes > available:
                raise ValueError(f"one sequence of {max_model_len} tokens needs a KV cache of "
                                 f"{_gib(pages * page_bytes)}, more than the {_gib(available)} available; "
                                 f"lower max_model_len")
    return PoolPlan(pages, reason, min(pages // ec.max_seqs * ec.page_size, max_model_len))
