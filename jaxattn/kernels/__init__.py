"""The one seam between the maths and its implementations (docs/theory.md §15).

A `Kernels` value names, for each operation, which formulation runs. Every
formulation meets the contract of the function that dispatches to it and
equals the reference ("xla", the maths differentiated by JAX) in
tests/kernels/test_kernels.py:

| field | dispatched by | implementations (reference first) |
| --- | --- | --- |
| attention | `scaled_dot_product_attention` | "xla", "custom_vjp", "causal_blocks", "chunked", "cudnn", "splash"; per-call rules "auto_cpu", "auto_gpu", "auto_tpu" |
| decode | `cached_attention`, `cache.write_rows` | "xla", "xla_cpu", "blocked" (inference only); per-call rule "auto_cpu" |
| matmul | `Linear`, the tied lm_head | "xla", "bfloat16", "bfloat16_cpu", "native_cpu" (float32, a native loop for up to 64 rows) |
| mla | `MultiHeadLatentAttention.__call__` | "naive", "absorb" |
| moe | `jaxattn.layers.moe.MoE` (the routed experts) | "dense", "grouped", "grouped_cpu", "gathered"; per-call rule "auto_cpu" |
| quantized | `Linear` with a `QuantizedWeight` kernel (`jaxattn.quantization`) | "xla", "native_cpu" (a native loop for up to 32 rows), "native_cpu_q8act" (activations rounded to int8, integer dots) |
| paged | `AttentionLayer.attend_pages` (a paged cache, `jaxattn.serving`) | "gather", "ragged", "ragged_cpu" (inference only; the last a native loop on a CPU) |

Every attention implementation has the signature of `xla.attention` and returns
`(out, weights | None, residual | None)` (`jaxattn.kernels._call`), the residual in the
softmax's dtype (float32 for 16-bit inputs), which `scaled_dot_product_attention`
rounds to the query's dtype as jax.nn does. What each takes of
the features beyond masks and biases; what a fused kernel cannot take runs the
reference with a one-line `KernelFallbackWarning`:

| attention | soft cap | sinks | windows `(left, right)` | residual | segment ids | weights, dropout |
| --- | --- | --- | --- | --- | --- | --- |
| "xla" | yes | yes | yes | yes | yes | yes |
| "custom_vjp", "causal_blocks", "chunked" | yes | yes | yes | yes | yes ("chunked" skips other documents' blocks) | the reference |
| "cudnn" | no | no | left only (or causal), T == S | yes | no | no |
| "splash" | yes | no | yes | no | yes | no |

("chunked" is `jaxattn.kernels.chunked`, the block pairs it computes `jaxattn.kernels.chunked_blocks`.)

The choice is made once, when a program resolves a run for its platform
(`resolve_kernels`, which also says why); building or applying a model never
looks at the hardware, and a field left at "auto" raises until resolved. An
implementation that reads weights fastest in a layout of its own gets them so
from `prepare_weights(params, kernels)`, called once after loading. The library's
own callers given no kernels (`jaxattn.generate`, the serving `Engine`, `kernels=None`)
run `default_kernels(params)`: the reference, except a quantized model's `quantized`
field, which is the platform's fast path (its weights laid out for it); `Kernels()`
asks for the reference everywhere.

The modules, one formulation or one rule each:

* the table and the rules: `registry` (`IMPLEMENTATIONS`, `Kernels`), `select` (what "auto" means on a
  platform, and `host`, the one reader of the CPU's flags), `auto` (attention's per-call rules),
  `paged_select` (which paged attention runs a call, and why);
* attention: `xla` (the reference), `xla_cpu`, `custom_vjp`, `chunked` (with its block schedule,
  `chunked_blocks`), `cudnn`, `splash`, `pallas_flash` (the teaching kernel), `blocked_decode`;
* against pages: `paged` (the reference and the ragged loop), `native_paged` (the native decode loop);
* matmuls: `bf16_matmul`, `float_matmul` (float32 rows of a decode step, native), `quant_matmul` (quantized
  weights); the mixture of experts: `moe`; LoRA adapters in slots, each row its own: `lora_slots` (native,
  `jaxattn.lora.slot_delta`'s "native_cpu" form, which `select.lora_form` gives the serving engine);
* the native kernels' C++ (`native/`), built on first use by `native_build` with `-march=native`:
  the quantized matmul's integer dots take one path per instruction set (`native/quant_dot.h`:
  AVX512-VNNI, AVX-VNNI, AVX2, NEON with and without the dot-product extension, scalar), named by
  `quant_matmul.native_path()` and on the programs' `kernels:` line; the float32 matmul's register tiles
  one each for AVX-512, AVX2, NEON and scalar (`native/float_gemm.h`, `float_matmul.native_path()`;
  `lora_slots` runs them too).

Adding an implementation is a new module in this package and one entry in
`IMPLEMENTATIONS` (`jaxattn.kernels.registry`; plus, if it should be picked
automatically, a rule in `jaxattn.kernels.select`).
"""

from jaxattn.kernels._call import KernelFallbackWarning
from jaxattn.kernels.registry import (AUTO, IMPLEMENTATIONS, Kernels, attention_kernel, cache_writer,
                                      cached_attention_kernel, check_mla_path, check_paged, choices, matmul_kernel,
                                      moe_kernel, paged_attention_kernel, prepare_weights, quantized_matmul_kernel,
                                      transposed_matmul_kernel)
from jaxattn.kernels.select import Platform, call_kernels, default_kernels, exact_matmul, resolve_kernels

__all__ = ["AUTO", "IMPLEMENTATIONS", "KernelFallbackWarning", "Kernels", "Platform", "attention_kernel",
           "cache_writer", "cached_attention_kernel", "call_kernels", "check_mla_path", "check_paged", "choices",
           "default_kernels", "exact_matmul", "matmul_kernel", "moe_kernel", "paged_attention_kernel",
           "prepare_weights", "quantized_matmul_kernel", "resolve_kernels", "transposed_matmul_kernel"]
