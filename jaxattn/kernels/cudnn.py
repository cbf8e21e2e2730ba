"""cuDNN's fused flash attention on NVIDIA GPUs ("cudnn"), through `jax.nn.dot_product_attention`.

Contract: `jaxattn.scaled_dot_product_attention`'s for the calls `refusal` accepts;
any other call runs the reference ("xla") with a one-line `KernelFallbackWarning`.
Takes the causal structure and windows (left only, with T == S) and the residual; refuses
soft caps and sinks, which the fused kernel has not, and the segment ids of packed rows (docs/theory.md
§27), which `jax.nn.dot_product_attention` does not take in JAX 0.10 (its `query_seq_lengths` and
`key_value_seq_lengths` describe one sequence per row, right-padded, not several). Needs a CUDA GPU backend (a clear
ValueError elsewhere). Reverse mode only, as cuDNN's backward is hand-written. Tested on
a GPU in tests/kernels/test_auto_attention.py (skipped where there is none).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxattn.kernels._call import AttentionCall, reference_unless

MAX_HEAD_DIM = 128  # cuDNN's limit before Hopper; 256 from compute capability 9.0


def refusal(call: AttentionCall) -> str | None:
    """Why cuDNN cannot take `call` here (None: it can)."""
    if call.dtype not in ("float16", "bfloat16"):
        return f"{call.dtype} inputs (cuDNN's fused kernel takes float16 and bfloat16)"
    if call.H > MAX_HEAD_DIM or call.H % 8:
        return f"head dim H={call.H} (cuDNN needs H <= {MAX_HEAD_DIM} and a multiple of 8)"
    if (call.is_causal or call.window is not None) and call.T != call.S:
        return f"a causal mask or window with T={call.T} != S={call.S} (cuDNN aligns them to the first key, " \
               "jaxattn to the last)"
    if call.window is not None and not call.is_causal and call.window[1] > 0:
        return f"a window {call.window} reaching right without is_causal (cuDNN's window looks left only)"
    if call.lengths:
        return "key_value_seq_lengths (a row of length 0 must give zeros, unverified through cuDNN)"
    if call.segments:  # the segment mask would be a dense mask, which cuDNN is not given here either
        return "segment ids of packed rows (jax.nn.dot_product_attention in this JAX takes none)"
    if call.soft_cap:
        return "a logit soft cap (cuDNN's fused kernel has none)"
    if call.sinks:
        return "attention sinks (cuDNN's fused kernel has none)"
    return call.common_refusal("cuDNN")


@reference_unless(refusal, warn_as="cuDNN")
def attention(query, key, value, *, mask, bias, is_causal, scale, dropout_rate, dropout_rng,
              return_weights, local_window_size=None, key_value_seq_lengths=None, logits_soft_cap=None,
              sinks=None, return_residual=False, segment_ids=None):
    """Same arguments and results as `jaxattn.kernels.xla.attention`.

    A window `(left, right)` reaches cuDNN as its sliding window of `left + 1` keys, causal: with
    `is_causal` the right side is cut to 0 anyway, and without it `refusal` lets only `right == 0`
    through (the query and `left` keys back, which is causal). The residual is jax.nn's
    `return_residual` (cuDNN's logsumexp, rounded to the input dtype by jax.nn), widened to
    float32 as the kernel contract has it; `scaled_dot_product_attention` rounds it back to the
    input dtype, exactly.
    """
    if jax.default_backend() != "gpu":
        raise ValueError(f'implementation "cudnn" needs a CUDA GPU; this process runs on '
                         f'{jax.default_backend()} (use "auto" or "chunked")')
    causal = is_causal or local_window_size is not None
    window = None if local_window_size is None else (int(local_window_size[0]), 0)
    out = jax.nn.dot_product_attention(query, key, value.astype(query.dtype), scale=scale,
                                       is_causal=causal, local_window_size=window,
                                       implementation="cudnn", return_residual=return_residual)
    residual = None
    if return_residual:
        out, residual = out
        residual = jax.lax.stop_gradient(residual.astype(jnp.float32))
    return jnp.asarray(out, query.dtype), None, residual
