"""Which paged attention runs, and why: the one place that decides it, for a platform and for each call.

Both rules return `(implementation, reason)`, as `jaxattn.kernels.select`'s and `jaxattn.kernels.auto`'s do:

* `platform_rule(platform)`: what `Kernels.paged = "auto"` resolves to (`jaxattn.kernels.select.RULES`):
  "ragged_cpu" on a CPU with a C++ compiler, "ragged" on one without, "gather" on a GPU or TPU.
* `choose(name, queries, key_pages, value_pages)`: what a resolved name runs for one call of
  `jaxattn.layers.attention_layer.AttentionLayer.attend_pages`, from the call's static shapes and dtypes
  (`jaxattn.kernels.paged.PagedCall`; static under `jit`, so the choice costs nothing at run time):

  | name | what runs |
  | --- | --- |
  | "gather" | "gather": the layer gathers each row's pages into its dense cache and runs its own cached attention (the reference) |
  | "ragged" | "ragged": `jaxattn.kernels.paged.ragged_paged_attention`, only the blocks of pages that hold a visible slot |
  | "ragged_cpu" | "native" (`jaxattn.kernels.native_paged.native_paged_attention`) where the native loop takes the call (`native_paged.refusal`: decoding rows), else "ragged" |

`KERNELS` maps "ragged" and "native" to their functions (`jaxattn.kernels.paged`'s contract);
`IMPLEMENTATIONS` maps the names `Kernels.paged` takes to what runs (`jaxattn.kernels.registry` reads it).
"""

from __future__ import annotations

import logging
from typing import Callable

from jaxattn.kernels import native_paged, paged
from jaxattn.kernels.paged import PagedCall

GATHER, RAGGED, NATIVE = "gather", "ragged", "native"
KERNELS: dict[str, Callable] = {RAGGED: paged.ragged_paged_attention, NATIVE: native_paged.native_paged_attention}
_log = logging.getLogger("jaxattn.kernels")


def platform_rule(platform) -> tuple[str, str]:
    """(implementation, reason) that "auto" means on a `jaxattn.kernels.Platform`."""
    if platform.is_cpu and platform.cxx:
        return "ragged_cpu", "decoding rows in a native loop: XLA:CPU runs them as many tiny batched dots"
    if platform.is_cpu:
        return "ragged", "no C++ compiler for the native loop; gathering would copy every page a row may hold"
    return "gather", f"{platform.backend}: one gather beats a loop whose every trip checks its bound on the host"


def _gather(call: PagedCall) -> tuple[str, str]:
    return GATHER, "each row's pages gathered into the dense cache, then the layer's cached attention (the reference)"


def _ragged(call: PagedCall) -> tuple[str, str]:
    return RAGGED, "only the blocks of pages that hold a visible slot, online softmax in float32"


def _ragged_cpu(call: PagedCall) -> tuple[str, str]:
    refusal = native_paged.refusal(call)
    if refusal is None:
        return NATIVE, (f"{call.queries_per_kv_head} queries per row and kv head <= {native_paged.NATIVE_UP_TO}, "
                        "one key part, float32: decoding rows in the native loop")
    return RAGGED, f"the native loop should not take it: {refusal}"


CALL_RULES: dict[str, Callable[[PagedCall], tuple[str, str]]] = {
    "gather": _gather, "ragged": _ragged, "ragged_cpu": _ragged_cpu}


def choose(name: str, queries, key_pages, value_pages) -> tuple[str, str]:
    """(kernel, reason) that `Kernels.paged = name` runs for a call with these operands (`jaxattn.kernels.paged`'s
    arguments): "gather", "ragged" or "native". ValueError for a name it does not know, "auto" included."""
    if name == "auto":  # the registry's words for every field
        raise ValueError('Kernels.paged is "auto": resolve it for a platform first (jaxattn.kernels.resolve_kernels), '
                         "building a model never detects hardware")
    if name not in CALL_RULES:
        raise ValueError(f"paged implementation must be one of {tuple(CALL_RULES)}, got {name!r}")
    kernel, reason = CALL_RULES[name](PagedCall.of(queries, key_pages, value_pages))
    _log.debug("paged %s: %s (%s)", name, kernel, reason)
    return kernel, reason


def ragged_cpu_paged_attention(queries, key_pages, value_pages, block_table, query_positions, *, scale,
                               window=None, logits_soft_cap=None, sinks=None, pages_per_block=4):
    """"ragged_cpu" as one function of `jaxattn.kernels.paged`'s contract: the kernel `choose` picks for the call."""
    kernel, _ = choose("ragged_cpu", queries, key_pages, value_pages)
    return KERNELS[kernel](queries, key_pages, value_pages, block_table, query_positions, scale=scale, window=window,
                           logits_soft_cap=logits_soft_cap, sinks=sinks, pages_per_block=pages_per_block)


# What each name runs, for `jaxattn.kernels.registry` ("gather": the layer's own cached attention, no kernel).
IMPLEMENTATIONS: dict[str, Callable | None] = {
    "gather": None, "ragged": paged.ragged_paged_attention, "ragged_cpu": ragged_cpu_paged_attention}
