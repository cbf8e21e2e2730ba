"""Which implementation "auto" means on a platform: the rules, and the one place that reads the hardware.

`resolve_kernels(requested, platform)` is a pure function of a `Platform`
(backend name and CPU feature flags), so every rule is testable on any
machine; only `Platform.detect()` looks at the real one, and only programs
call it (`python -m train.tiny_lm` prints the result and the reasons), besides
a direct `scaled_dot_product_attention(..., implementation="auto")` and a library
call given no kernels on a quantized model (`default_kernels`: `generate`, the
serving `Engine`), each once per process (`this_platform`); models take resolved names. The CPU
rules follow side-by-side measurements on x86 CPUs with and without AVX-512
and AMX-BF16 (docs/performance.md; `bench/kernel_choices.py` and
`bench/attention.py` repeat them on any machine). Attention resolves to its
platform's per-call rule (`jaxattn.kernels.auto`: dense or blockwise by length
on a CPU, cuDNN on a GPU, splash on a TPU, where each takes the call); paged attention's
rules, for a platform and for each call, are `jaxattn.kernels.paged_select`'s. For the
other fields on a GPU or TPU, where no side-by-side comparison backs a rule,
"auto" is the reference except for bfloat16 matmul operands, the usual practice
there (torch.autocast).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp

from jaxattn.kernels import auto, moe, native_paged, paged_select
from jaxattn.kernels.host import read_cpu_flags
from jaxattn.kernels.registry import AUTO, IMPLEMENTATIONS, Kernels, prepare_weights
from jaxattn.quantization import is_quantized

ACCELERATORS = ("gpu", "cuda", "rocm", "tpu")


@dataclasses.dataclass(frozen=True)
class Platform:
    """What the kernel rules look at.

    Attributes:
      backend: JAX's default backend, e.g. "cpu", "gpu", "tpu".
      cpu_flags: the host CPU's feature flags (`/proc/cpuinfo`), e.g. {"avx2", "amx_bf16"}.
      cxx: a C++ compiler for the native kernels was found (`native_paged.compiler()`).
    """

    backend: str
    cpu_flags: frozenset[str] = frozenset()
    cxx: bool = False

    @classmethod
    def detect(cls, cpuinfo: str = "/proc/cpuinfo") -> "Platform":
        """This process's platform. Starts JAX's backends: set device counts and XLA flags first."""
        return cls(backend=jax.default_backend(), cpu_flags=read_cpu_flags(cpuinfo),
                   cxx=native_paged.compiler() is not None)

    @property
    def is_cpu(self) -> bool:
        return self.backend not in ACCELERATORS

    @property
    def family(self) -> str:
        """"cpu", "gpu" or "tpu"."""
        return "tpu" if self.backend == "tpu" else "cpu" if self.is_cpu else "gpu"

    def describe(self) -> str:
        if not self.is_cpu:
            return f"{self.backend} backend"
        simd = [f for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if f in self.cpu_flags]
        return f"cpu backend ({', '.join(simd) or 'no AVX2'})"


@functools.cache
def this_platform() -> Platform:
    """`Platform.detect()`, once per process (for `implementation="auto"` in direct calls)."""
    return Platform.detect()


def attention_rule_here() -> str:
    """The attention rule that "auto" means in this process (`this_platform`), for direct calls."""
    return _attention(this_platform())[0]


def _attention(platform: Platform) -> tuple[str, str]:
    rule = f"auto_{platform.family}"
    return rule, {"auto_cpu": "per call: custom_vjp below {n} keys (causal self-attention in blocks of query "
                              "rows: causal_blocks), chunked from {n}",
                  "auto_gpu": "per call: cuDNN where it takes the call, else xla below {n} keys, chunked from {n}",
                  "auto_tpu": "per call: splash where it takes the call, else xla below {n} keys, chunked from {n}",
                  }[rule].format(n=auto.CHUNKED_FROM_KEYS)


def _decode(platform: Platform) -> tuple[str, str]:
    if platform.is_cpu:
        return "auto_cpu", "per call: blocked (reads only the filled cache blocks) at batch 1 or from " \
                           f"{auto.BLOCKED_FROM_SLOTS} slots, else xla_cpu (in-place reads)"
    return "xla", f"{platform.backend}: the CPU operand orders do not apply"


def _matmul(platform: Platform) -> tuple[str, str]:
    if not platform.is_cpu:
        return "bfloat16", f"{platform.backend}: bfloat16 matrix units, as torch.autocast"
    if "amx_bf16" in platform.cpu_flags:
        return "bfloat16_cpu", "this CPU has AMX-BF16: bfloat16 dots run several times faster"
    exact, why = exact_matmul(platform)
    return exact, f"this CPU has no AMX-BF16: bfloat16 matmuls are slower than float32 here; {why}"


# CPU flags -> the vector path of the native float32 matmul's tiles (native/float_gemm.h), in its order; without
# one, its plain loops are slower than XLA's dot.
FLOAT_TILES = {frozenset({"avx512f"}): "AVX-512", frozenset({"avx2", "fma"}): "AVX2", frozenset({"asimd"}): "NEON"}


def exact_matmul(platform: Platform) -> tuple[str, str]:
    """The fastest float32 matmul on `platform` (the products of a float32 model as the reference computes
    them, up to the order of additions): "native_cpu" on a CPU with a C++ compiler and a vector path for its
    tiles (`FLOAT_TILES`), else "xla"."""
    tiles = next((name for flags, name in FLOAT_TILES.items() if flags <= platform.cpu_flags), None)
    if platform.is_cpu and platform.cxx and tiles:
        return "native_cpu", (f"float32, a decode step's rows (up to 64) in a native loop of {tiles} tiles: XLA:CPU's "
                              "float32 dot runs those shapes at a fraction of the cores' arithmetic "
                              "(docs/performance.md §26)")
    where = "no C++ compiler for the native loop" if platform.is_cpu else f"{platform.backend}: no native kernel"
    return "xla", f"float32 in XLA ({where})"


def lora_form(platform: Platform, param_dtype) -> tuple[str, str]:
    """The formulation of adapters in slots (`jaxattn.lora.slot_delta`'s forms) for a model whose adapters are
    stored in `param_dtype`, on `platform`: `(form, reason)`. The forms compute the same sums; the serving
    engine asks this when `EngineConfig.lora_form` is "auto"."""
    if platform.is_cpu and platform.cxx and jnp.dtype(param_dtype) == jnp.float32:
        return "native_cpu", ("each projection's adapters in one native call that groups the rows by slot: "
                              "XLA:CPU has no grouped matmul, and its loop over segments costs more than the "
                              "arithmetic of a decode step (docs/performance.md §27)")
    if platform.is_cpu:
        why = "no C++ compiler for the native loop" if not platform.cxx else "adapters not stored in float32"
        return "segment_cpu", f"{why}: XLA's loop over the rows' segments, each adapter read once"
    return "segment", f"{platform.backend}: ragged_dot, a grouped matmul on accelerators (Punica's SGMV)"


def _mla(platform: Platform) -> tuple[str, str]:
    return "naive", "one decompression matmul per layer suits full sequences; decoding always absorbs"


# CPU flags (x86's /proc/cpuinfo names, ARM's Features) -> the integer-dot path quant_dot.h compiles for them,
# beside AVX512-VNNI's (the first rule); in the order the compiler's macros choose.
INTEGER_DOTS = {"avx_vnni": "AVX-VNNI", "avx2": "AVX2", "asimddp": "NEON dot-product", "asimd": "NEON"}


def _quantized(platform: Platform) -> tuple[str, str]:
    if platform.is_cpu and platform.cxx and "avx512_vnni" in platform.cpu_flags:
        return "native_cpu_q8act", ("up to 32 rows in a native loop, the activations rounded to int8 in groups of "
                                    "32 (as llama.cpp's Q8_0) for AVX512-VNNI integer dots: converting each "
                                    "weight to float32 is the bottleneck otherwise")
    dots = next((name for flag, name in INTEGER_DOTS.items() if flag in platform.cpu_flags), None)
    if platform.is_cpu and platform.cxx and dots:
        return "native_cpu_q8act", (f"up to 32 rows in a native loop, the activations rounded to int8 in groups of "
                                    f"32 for {dots} integer dots on the weights in panels (on an AVX2 EPYC twice "
                                    f"the tokens/s of float activations: docs/performance.md §21)")
    if platform.is_cpu and platform.cxx:
        return "native_cpu", "up to 32 rows in a native loop: XLA:CPU converts the whole weight to float32 first"
    where = "no C++ compiler for the native loop" if platform.is_cpu else f"{platform.backend}: no native kernel"
    return "xla", f"{where}; dequantize and multiply"


RULES: dict[str, Callable[[Platform], tuple[str, str]]] = {
    "attention": _attention, "decode": _decode, "matmul": _matmul, "mla": _mla, "moe": moe.rule,
    "paged": paged_select.platform_rule, "quantized": _quantized}
assert set(RULES) == set(IMPLEMENTATIONS)


def resolve_kernels(requested: Kernels | None = None,
                    platform: Platform | None = None) -> tuple[Kernels, dict[str, str]]:
    """`requested` with every "auto" field replaced by its rule's choice for `platform`.

    Args:
      requested: the kernels asked for (default: all "auto").
      platform: where they run (default: `Platform.detect()`, which starts JAX).

    Returns:
      `(kernels, reasons)`: concrete kernels, and for each field a short reason
      ("asked for" when it was not "auto").
    """
    requested = Kernels.auto() if requested is None else requested
    platform = Platform.detect() if platform is None else platform
    chosen, reasons = {}, {}
    for field, rule in RULES.items():
        value = getattr(requested, field)
        if value == AUTO:
            value, reason = rule(platform)
        else:
            reason = "asked for"
        chosen[field], reasons[field] = value, reason
    return Kernels(**chosen), reasons


def default_kernels(params, platform: Platform | None = None) -> Kernels:
    """The kernels `jaxattn.generate` and the serving `Engine` run when given none (`kernels=None`).

    The reference (`Kernels()`) for every field, except that where `params` hold a `QuantizedWeight`
    (`jaxattn.quantize`), `quantized` is what "auto" resolves it to on `platform` (default: this
    process's, `this_platform`): the native loop on a CPU with a C++ compiler, so that quantized
    weights are faster than float ones without asking. A model without quantized weights gets exactly
    `Kernels()` (the same programs as before); `Kernels()` given explicitly runs the reference.
    """
    if not any(is_quantized(leaf) for leaf in jax.tree_util.tree_leaves(params, is_leaf=is_quantized)):
        return Kernels()
    return Kernels(quantized=_quantized(this_platform() if platform is None else platform)[0])


def call_kernels(params, kernels: Kernels | None, on_mesh: bool = False):
    """`(kernels, params)` that a library call given `kernels` runs: those and `params` as they are; for
    None, `default_kernels(params)` (`Kernels()` `on_mesh`: the native loops run on one device) with
    `params` laid out for them (`prepare_weights`: a copy of the quantized weights whose layout moves,
    none where the layout is already theirs)."""
    if kernels is not None:
        return kernels, params
    kernels = Kernels() if on_mesh else default_kernels(params)
    return kernels, prepare_weights(params, kernels)
