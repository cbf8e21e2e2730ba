"""The per-call attention rules behind "auto": which kernel takes a call, from its static shapes and features.

`Kernels.attention = "auto"` resolves, for a platform, to one of "auto_cpu",
"auto_gpu", "auto_tpu" (`jaxattn.kernels.select`); each is an attention
implementation that applies its rule to every call (shapes and dtypes are
static under `jit`, so the choice costs nothing at run time) and runs the
kernel it picks. The rules are pure functions of an `AttentionCall`, so they
are tested on any machine (tests/kernels/test_auto_attention.py):

- CPU: the dense path with the hand-written backward ("custom_vjp") below
  `CHUNKED_FROM_KEYS` keys, its causal self-attention in blocks of query rows over the keys
  each block sees ("causal_blocks"), blockwise ("chunked") from there; the reference for
  attention weights and dropout. Both take every other feature (masks, biases,
  two-sided windows, key lengths, soft caps, sinks, the residual, segment ids), so no other
  feature decides the kernel.
- GPU: cuDNN's fused kernel where it takes the call (not soft caps, sinks or segment ids), else
  the CPU's length rule with the reference as the dense path; each refusal is a
  one-line `KernelFallbackWarning`.
- TPU: Pallas's splash kernel likewise (it takes soft caps, not sinks or the residual).

Decoding on a CPU has a per-call rule too ("auto_cpu" for `Kernels.decode`): the
batch size and the cache's slots are static: reading only the filled cache blocks
("blocked") wins at batch 1, and at batch 8 in caches of thousands of slots, and
loses at batch 8 in small ones (bench/results/kernel_choices.md,
decode_cache_sweep_b8.md).

`choose` says what a call gets and why; the thresholds follow
bench/results/attention.md (docs/performance.md).
"""

from __future__ import annotations

import logging
import warnings
from typing import Callable

from jaxattn.kernels import blocked_decode, chunked, cudnn, custom_vjp, splash, xla, xla_cpu
from jaxattn.kernels._call import AttentionCall, KernelFallbackWarning, weights_or_dropout

# From this many keys the blockwise kernel beats the dense one forward and forward+backward on a CPU
# (docs/performance.md, "Long sequences"; bench/attention.py measures it on any machine); below it
# the logits of a head fit in cache.
CHUNKED_FROM_KEYS = 1024

CONCRETE: dict[str, Callable] = {"xla": xla.attention, "custom_vjp": custom_vjp.attention,
                                 "causal_blocks": custom_vjp.blocked_attention, "chunked": chunked.attention,
                                 "cudnn": cudnn.attention, "splash": splash.attention}
_log = logging.getLogger("jaxattn.kernels")


def _by_length(call: AttentionCall, dense: str) -> tuple[str, str]:
    """`dense` below `CHUNKED_FROM_KEYS` keys, "chunked" from there; the reference for the calls the
    hand-written kernels refuse (`weights_or_dropout`, the one statement of that refusal)."""
    refusal = weights_or_dropout(call)
    if refusal is not None:
        return "xla", refusal
    if call.S >= CHUNKED_FROM_KEYS:
        return "chunked", f"S={call.S} >= {CHUNKED_FROM_KEYS} keys: blockwise, O(T) memory, hidden blocks skipped"
    return dense, f"S={call.S} < {CHUNKED_FROM_KEYS} keys: the dense logits fit in cache"


def cpu_rule(call: AttentionCall) -> tuple[str, str]:
    """(kernel, reason) for `call` on a CPU: a causal self-attention of more rows than a block in blocks
    of query rows, each over the keys it sees."""
    name, reason = _by_length(call, "custom_vjp")
    rows = custom_vjp.block_rows(call.T)
    if name != "custom_vjp" or len(custom_vjp.causal_row_blocks(call.T, call.S, call.is_causal, rows)) == 1:
        return name, reason
    return "causal_blocks", (f"causal self-attention of T={call.T} < {CHUNKED_FROM_KEYS} rows: in blocks of "
                             f"{rows} rows, each over the keys it sees")


def _fused_rule(call: AttentionCall, kernel: str, refusal: Callable) -> tuple[str, str]:
    reason = refusal(call)
    if reason is None:
        return kernel, f"{kernel} takes this call"
    name, why = _by_length(call, "xla")
    return name, f"{kernel} cannot: {reason}; {why}"


def gpu_rule(call: AttentionCall) -> tuple[str, str]:
    """(kernel, reason) for `call` on a GPU: cuDNN where it can."""
    return _fused_rule(call, "cudnn", cudnn.refusal)


def tpu_rule(call: AttentionCall) -> tuple[str, str]:
    """(kernel, reason) for `call` on a TPU: splash where it can."""
    return _fused_rule(call, "splash", splash.refusal)


RULES: dict[str, Callable[[AttentionCall], tuple[str, str]]] = {
    "auto_cpu": cpu_rule, "auto_gpu": gpu_rule, "auto_tpu": tpu_rule}
FUSED = {"auto_gpu": "cudnn", "auto_tpu": "splash"}  # a call these rules give another kernel warns


def choose(rule: str, query, key, value, **arguments) -> tuple[str, str]:
    """(kernel, reason) that `rule` ("auto_cpu", "auto_gpu" or "auto_tpu") picks for these arguments."""
    return RULES[rule](AttentionCall.of(query, key, value, **arguments))


def kernel(rule: str) -> Callable:
    """The attention implementation that applies `rule` to each call."""
    def attention(query, key, value, **arguments):
        name, reason = choose(rule, query, key, value, **arguments)
        if rule in FUSED and name != FUSED[rule]:
            warnings.warn(f"attention {rule} runs {name}: {reason}", KernelFallbackWarning, stacklevel=2)
        _log.debug("%s: %s (%s)", rule, name, reason)
        return CONCRETE[name](query, key, value, **arguments)
    attention.__name__ = attention.__qualname__ = rule
    return attention


# From this many cache slots the blocked read wins at any batch unless the cache is over half full.
BLOCKED_FROM_SLOTS = 4096


def cpu_decode_rule(batch: int, slots: int) -> tuple[str, str]:
    """(decode kernel, reason) for cached attention of `batch` rows over a cache of `slots` on a CPU.

    At batch 1 the blocked read is about as fast as the dense one in a full cache and faster the
    emptier the cache is. At larger batches it is faster in a large cache until it is about half
    full, and slower in a small one (docs/performance.md, "Decoding"; `bench/kernel_choices.py` and
    `bench/decode.py --cache-sweep` measure both on any machine).
    """
    if batch == 1:
        return "blocked", "batch 1: reads only the cache blocks that hold the row, so a step costs what the row holds"
    if slots >= BLOCKED_FROM_SLOTS:
        return "blocked", f"{slots} >= {BLOCKED_FROM_SLOTS} slots: reading only the filled blocks wins until half full"
    return "xla_cpu", f"batch {batch}, {slots} slots: XLA:CPU's in-place reads beat the blocked loop"


DECODE = {"xla_cpu": xla_cpu.cached_attention, "blocked": blocked_decode.cached_attention}


def cpu_cached_attention(query, key_cache, value_cache, query_positions, **arguments):
    """`cached_attention` by `cpu_decode_rule` (same arguments and result as the reference's)."""
    name, _ = cpu_decode_rule(query.shape[0], key_cache.shape[2])
    return DECODE[name](query, key_cache, value_cache, query_positions, **arguments)


__all__ = ["BLOCKED_FROM_SLOTS", "cpu_cached_attention", "cpu_decode_rule", "CHUNKED_FROM_KEYS", "KernelFallbackWarning", "RULES", "choose", "cpu_rule", "gpu_rule",
           "kernel", "tpu_rule"]
