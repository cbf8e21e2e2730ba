"""The implementation table behind `Kernels`: which names each field takes and what each name runs.

`IMPLEMENTATIONS` maps each field of `Kernels` to its implementation names and
what runs for each; `choices`, `Kernels` and the `*_kernel` accessors read it,
and `jaxattn.kernels.select` resolves "auto" against it. Re-exported by
`jaxattn.kernels` (the package docstring describes each field and implementation).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from jaxattn.kernels import (auto, bf16_matmul, blocked_decode, float_matmul, moe, paged_select, quant_matmul, xla,
                             xla_cpu)

AUTO = "auto"

# field -> implementation name -> what runs (None: handled inside the module that dispatches).
IMPLEMENTATIONS: dict[str, dict[str, object]] = {
    "attention": {**auto.CONCRETE, **{rule: auto.kernel(rule) for rule in auto.RULES}},
    "decode": {"xla": (xla.cached_attention, xla.write_rows),
               "xla_cpu": (xla_cpu.cached_attention, xla_cpu.write_rows),
               # xla_cpu's writes: the vmapped form copies the whole buffer, which "blocked" exists to avoid.
               "blocked": (blocked_decode.cached_attention, xla_cpu.write_rows),
               "auto_cpu": (auto.cpu_cached_attention, xla_cpu.write_rows)},  # blocked or xla_cpu per call
    "matmul": {"xla": xla.matmul, "bfloat16": bf16_matmul.matmul, "bfloat16_cpu": bf16_matmul.matmul_cpu,
               "native_cpu": float_matmul.matmul},
    "mla": {"naive": None, "absorb": None},
    # "gather": the layer's own cached attention; which kernel runs a call: paged_select.choose.
    "paged": dict(paged_select.IMPLEMENTATIONS),
    "moe": dict(moe.IMPLEMENTATIONS),
    "quantized": {"xla": quant_matmul.matmul, "native_cpu": quant_matmul.matmul_cpu,
                  "native_cpu_q8act": quant_matmul.matmul_cpu_q8act},
}


# The matmuls that read a weight stored `[N, K]` (the tied embedding as the head) without transposing it first:
# matmul name -> `(x [M, K], w [N, K]) -> x @ w.T`; the others are given `w.T`.
TRANSPOSED_MATMULS: dict[str, Callable] = {"native_cpu": float_matmul.matmul_transposed}


# The weight layout an implementation reads fastest, given when a run is resolved (`prepare_weights`):
# field -> implementation name -> params -> params (the same numbers; every implementation reads any layout).
WEIGHT_LAYOUTS: dict[str, dict[str, Callable]] = {
    "quantized": {"native_cpu_q8act": quant_matmul.prepare_weights},
}


def choices(field: str) -> tuple[str, ...]:
    """The implementation names of `field`, reference first."""
    return tuple(IMPLEMENTATIONS[field])


@dataclasses.dataclass(frozen=True)
class Kernels:
    """Which implementation runs each operation (the maths is the same; see `jaxattn.kernels`).

    Attributes:
      attention: "xla" (reference), "custom_vjp" (hand-written backward), "causal_blocks" (custom_vjp
        with a causal self-attention's query rows in blocks, each over the keys it sees), "chunked" (blockwise
        online softmax, O(T) memory, hidden causal/window blocks skipped), "cudnn" (cuDNN's fused
        kernel, CUDA GPUs), "splash" (Pallas's TPU kernel; interpret mode elsewhere), or a
        platform's per-call rule "auto_cpu", "auto_gpu", "auto_tpu" (`jaxattn.kernels.auto`:
        picks one of those from each call's shapes and features). All but "xla" are reverse mode
        only; the fused ones run the reference, with a warning, for calls they cannot take.
      decode: "xla" (reference), "xla_cpu" (cached attention and cache writes in XLA:CPU's fast forms),
        "blocked" (reads only the cache blocks the queries can see, with xla_cpu's writes;
        forward only, for inference) or "auto_cpu" (blocked at batch 1 or in caches of 4096
        slots or more, else xla_cpu).
      matmul: "xla" (reference: the compute dtype), "bfloat16" or "bfloat16_cpu" (bfloat16
        operands, float32 sums, reverse mode only; the latter in XLA:CPU's fast forms), or
        "native_cpu" (`jaxattn.kernels.float_matmul`: float32, up to 64 rows in a native loop built with
        the host's C++ compiler, more rows the float32 reference; CPU only).
      mla: "naive" (decompress keys and values) or "absorb" (attend in the latent space), for
        full-sequence passes; cached decoding always absorbs.
      paged: attention against a paged cache (`jaxattn.serving`): "gather" (reference: each row's pages
        gathered into the dense layout, then the layer's cached attention and the `decode` field's
        kernel), "ragged" (`jaxattn.kernels.paged`: reads only the pages that hold visible tokens,
        online softmax in float32; forward only) or "ragged_cpu" (`jaxattn.kernels.native_paged`:
        ragged, its decoding rows in a native loop built with the host's C++ compiler; CPU only). Which
        of these runs a call, and why, is `jaxattn.kernels.paged_select`'s one rule.
      moe: a mixture-of-experts layer's routed experts: "dense" (reference: every expert on every
        token, weighted by the sparse gates), "grouped" (tokens sorted by expert, `jax.lax.ragged_dot`),
        "grouped_cpu" (the same grouping in tiles of rows, batched matmuls), "gathered" (each
        (token, expert) pair with its expert's weights gathered: for a few tokens, as in decoding) or
        "auto_cpu" (per call: gathered, grouped_cpu or dense by the tokens, experts and k); all
        dropless and exact.
      quantized: `Linear` with a quantized kernel (`jaxattn.quantization`): "xla" (reference:
        dequantize, then a float32 dot), "native_cpu" (`jaxattn.kernels.quant_matmul`: up to 32
        rows in a native loop built with the host's C++ compiler, more rows the reference; CPU only)
        or "native_cpu_q8act" (as native_cpu, but the activations rounded to int8 in groups of 32
        and integer dots, for int4 and int8 weights in groups of 32 and per-channel int8 weights, as
        `quant_matmul` says which: an approximation of its own).

    Any field may be "auto" in a request; `resolve_kernels` replaces it for a platform.
    """

    attention: str = "xla"
    decode: str = "xla"
    matmul: str = "xla"
    mla: str = "naive"
    moe: str = "dense"
    paged: str = "gather"
    quantized: str = "xla"

    def __post_init__(self):
        for field in IMPLEMENTATIONS:
            value = getattr(self, field)
            if value != AUTO and value not in IMPLEMENTATIONS[field]:
                raise ValueError(f"Kernels.{field} must be one of {choices(field) + (AUTO,)}, got {value!r}")

    @classmethod
    def auto(cls) -> "Kernels":
        """Every field "auto": a request for `resolve_kernels`."""
        return cls(**{field: AUTO for field in IMPLEMENTATIONS})

    def replace(self, **changes) -> "Kernels":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, str]:
        return dataclasses.asdict(self)


def prepare_weights(params, kernels: Kernels):
    """`params` laid out as the chosen `kernels` read them fastest (once, after loading and quantizing, before
    sampling or serving: e.g. "native_cpu_q8act"'s quantized weights in panels,
    `jaxattn.quantization.to_panels`). The numbers stay the same and every implementation reads either
    layout, so a model prepared for one set of kernels still runs with another, only slower."""
    for field, table in WEIGHT_LAYOUTS.items():
        name = getattr(kernels, field)
        _lookup(field, name)
        if name in table:
            params = table[name](params)
    return params


def _lookup(field: str, name: str):
    if name == AUTO:
        raise ValueError(f'Kernels.{field} is "auto": resolve it for a platform first '
                         "(jaxattn.kernels.resolve_kernels), building a model never detects hardware")
    table = IMPLEMENTATIONS[field]
    if name not in table:
        raise ValueError(f"{field} implementation must be one of {choices(field)}, got {name!r}")
    return table[name]


def attention_kernel(name: str) -> Callable:
    """The scaled dot-product attention of implementation `name`."""
    return _lookup("attention", name)


def cached_attention_kernel(name: str) -> Callable:
    """The attention against a KV cache of decode implementation `name`."""
    return _lookup("decode", name)[0]


def cache_writer(name: str) -> Callable:
    """The per-row cache write of decode implementation `name`."""
    return _lookup("decode", name)[1]


def matmul_kernel(name: str) -> Callable:
    """The dense `[M, K] @ [K, N] -> float32` matmul of implementation `name`."""
    return _lookup("matmul", name)


def transposed_matmul_kernel(name: str) -> Callable:
    """`(x [M, K], w [N, K]) -> x @ w.T` float32 with matmul implementation `name` (the tied head): its own
    form where it has one (`TRANSPOSED_MATMULS`), else the kernel given `w.T`."""
    kernel = _lookup("matmul", name)
    return TRANSPOSED_MATMULS.get(name) or (lambda x, w: kernel(x, w.T))


def quantized_matmul_kernel(name: str) -> Callable:
    """The `[M, K] @ QuantizedWeight [K, N] -> float32` matmul of implementation `name`."""
    return _lookup("quantized", name)


def moe_kernel(name: str) -> Callable:
    """The routed-experts implementation `name` (`jaxattn.kernels.moe`'s contract)."""
    return _lookup("moe", name)


def paged_attention_kernel(name: str) -> Callable:
    """The paged attention of implementation `name` other than "gather" (`jaxattn.kernels.paged`'s contract)."""
    return _lookup("paged", name)


def check_paged(name: str) -> str:
    """`name` if it is a paged-attention implementation, else a ValueError."""
    _lookup("paged", name)
    return name


def check_mla_path(name: str) -> str:
    """`name` if it is an MLA path ("naive" or "absorb"), else a ValueError."""
    _lookup("mla", name)
    return name
