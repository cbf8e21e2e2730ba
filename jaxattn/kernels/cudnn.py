"""cuDNN's fused flash attention on NVIDIA GPUs ("cudnn"), through `jax.nn.dot_product_attention`.

Contract: `jaxattn.scaled_dot_product_attention`'s for the calls `refusal` accepts;
any other call runs the reference ("xla") with a one-line `KernelFallbackWarning`.
Needs a CUDA GPU backend (a clear ValueError elsewhere). Reverse mode only, as
cuDNN's backward is hand-written. Tested on a GPU in tests/test_accelerator_kernels.py
(skipped where there is none).
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
    if call.is_causal and call.T != call.S:
        return f"causal with T={call.T} != S={call.S} (cuDNN aligns the causal mask to the first key, " \
               "jaxattn to the last)"
    if call.lengths:
        return "key_value_seq_lengths (a row of length 0 must give zeros, unverified through cuDNN)"
    return call.common_refusal("cuDNN")


@reference_unless(refusal, warn_as="cuDNN")
def attention(query, key, value, *, mask, bias, is_causal, scale, dropout_rate, dropout_rng,
              return_weights, local_window_size=None, key_value_seq_lengths=None):
    """Same arguments and results as `jaxattn.kernels.xla.attention`."""
    if jax.default_backend() != "gpu":
        raise ValueError(f'implementation "cudnn" needs a CUDA GPU; this process runs on '
                         f'{jax.default_backend()} (use "auto" or "chunked")')
    window = None if local_window_size is None else (local_window_size - 1, 0)
    out = jax.nn.dot_product_attention(query, key, value.astype(query.dtype), scale=scale,
                                       is_causal=is_causal, local_window_size=window,
                                       implementation="cudnn")
    return jnp.asarray(out, query.dtype), None
