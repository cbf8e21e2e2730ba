"""MXFP4 expert weights (GPT-OSS's hub checkpoints) back to floats, as transformers 5.23 dequantizes them.

The hub's gpt-oss-20b/120b store each expert projection `W [E, in, out]` as
`{name}_blocks` uint8 `[E, out, G, 16]` and `{name}_scales` uint8 `[E, out, G]`
(G = in / 32): row r of expert e holds `in` values in G groups of 32, each
group 16 bytes of two FP4 (e2m1) codes, low nibble first, and one E8M0 scale
s (the group's values times 2**(s - 127)). `dequantize` returns `W` in
transformers' module layout (`gate_up_proj [E, D, 2F]`, `down_proj [E, F, D]`),
equal to `transformers.integrations.mxfp4.convert_moe_packed_tensors` in
float32 (tests/hf/test_hf_gpt_oss.py), which is exact: every value is an FP4
number times a power of two.

`packed(path, name, E, d_in, d_out)` is the layout entry of such a
projection (`jaxattn.hf.weights.Entry.packed`), an alternative of the float
entry (GPT-OSS's `jaxattn.hf.families.gpt_oss`): loading dequantizes it (float32, then the model's dtype). It is
read-only: `CODEC.to_hf` raises, and export writes the float form.
"""

from __future__ import annotations

import numpy as np

from jaxattn.hf.weights import Codec, Entry

# The 16 FP4 e2m1 codes: sign bit 3, then 2 exponent bits and 1 mantissa bit.
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      np.float32)
SCALE_BIAS = 127  # E8M0: scale byte s means 2**(s - 127)
BLOCK_BYTES = 16  # 32 FP4 values per group


def _check(blocks: np.ndarray, scales: np.ndarray) -> None:
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.ndim != 4 or blocks.shape[-1] != BLOCK_BYTES or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks must be [E, rows, G, {BLOCK_BYTES}] and scales [E, rows, G], got "
                         f"{blocks.shape} and {scales.shape}")


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """`[E, rows, G, 16]` uint8 blocks and `[E, rows, G]` uint8 scales -> float32 `[E, G * 32, rows]`.

    ValueError for other dtypes or shapes. Scale bytes 0-254 are powers of two (254 may overflow float32
    to inf, as in transformers); 255, E8M0's NaN, is no scale (transformers gives NaN or inf there, this 0 or inf).
    """
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    _check(blocks, scales)
    E, rows, groups, _ = blocks.shape
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1)  # [E, rows, G, 16, 2]: low nibble first
    values = FP4_VALUES[codes].reshape(E, rows, groups, 2 * BLOCK_BYTES)
    exponents = scales.astype(np.int32)[..., None] - SCALE_BIAS
    with np.errstate(over="ignore"):
        out = np.ldexp(values, exponents).astype(np.float32, copy=False)
    return np.ascontiguousarray(out.reshape(E, rows, groups * 2 * BLOCK_BYTES).transpose(0, 2, 1))


def _no_export(array: np.ndarray) -> list[np.ndarray]:
    raise NotImplementedError("MXFP4 tensors are only read; export writes the float projection")


# `[blocks, scales]` -> the float32 `[E, in, out]` projection; read-only.
CODEC = Codec(lambda t: dequantize(t[0], t[1]), _no_export)


def packed(path: tuple[str, ...], name: str, experts: int, d_in: int, d_out: int) -> tuple[Entry, ...]:
    """The MXFP4 form of expert projection `name` (`[E, d_in, d_out]` as floats), as `Entry.alternatives`:
    `name_blocks` `[E, d_out, d_in / 32, 16]` and `name_scales` `[E, d_out, d_in / 32]`, both uint8;
    none when `d_in` is not a multiple of 32 (no MXFP4 form exists)."""
    if d_in % (2 * BLOCK_BYTES):
        return ()
    groups = d_in // (2 * BLOCK_BYTES)
    return (Entry(path, (f"{name}_blocks", f"{name}_scales"),
                  ((experts, d_out, groups, BLOCK_BYTES), (experts, d_out, groups)), CODEC, packed=True),)
