"""Adapters in slots in the native loop (jaxattn/kernels/lora_slots.py, native/lora_slots.cc): each row's
product with its own slot's adapter, equal to the float32 reference up to the order of additions, on shapes
that leave every kind of remainder (rows past a tile and a phase-1 piece, ranks below and past a vector,
columns past a vector and across the workers' pieces); rows of no slot (-1, or out of range) zeros; which
form the serving engine takes on each platform (`jaxattn.kernels.select.lora_form`). The whole model with
the form, against an adapter merged alone: tests/test_lora_slots.py (every form)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxattn.kernels import lora_slots, native_build
from jaxattn.kernels.select import Platform, lora_form

needs_cxx = pytest.mark.skipif(native_build.compiler() is None, reason="no C++ compiler for the native kernel")


def _data(M, K, r, W, S, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(M, K)).astype(np.float32), rng.normal(size=(S, K, r)).astype(np.float32),
            rng.normal(size=(S, r, W)).astype(np.float32), rng.uniform(0.5, 2.0, S).astype(np.float32))


@needs_cxx
@pytest.mark.parametrize("M", (1, 9, 40, 300))
def test_each_row_gets_its_own_slot_s_product(M):
    native = jax.jit(lora_slots.part_delta)
    for K, r, W, S in ((7, 3, 5, 2), (64, 16, 300, 5), (130, 24, 49, 3), (576, 8, 1000, 32)):
        x, a, b, scale = _data(M, K, r, W, S, seed=M + K)
        slots = np.random.default_rng(M).integers(-1, S, size=M).astype(np.int32)  # -1: none
        expected = np.asarray(lora_slots.reference_part_delta(x, slots, a, b, scale))
        got = np.asarray(native(x, slots, a, b, scale))
        # float32 sums of K, then r, products in another order: a few ulps of the largest value times sqrt(K r).
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6 * np.sqrt(K * r) * np.abs(expected).max())
        assert not got[slots < 0].any()


@needs_cxx
def test_rows_of_one_slot_rows_of_none_and_slots_out_of_range():
    x, a, b, scale = _data(20, 33, 4, 70, 3)
    native = jax.jit(lora_slots.part_delta)
    for slots in (np.full(20, 1), np.full(20, -1), np.array([3, -2, 0] * 6 + [2, 2])):
        slots = slots.astype(np.int32)
        got, expected = np.asarray(native(x, slots, a, b, scale)), np.asarray(
            lora_slots.reference_part_delta(x, slots, a, b, scale))
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-4)
        assert not got[(slots < 0) | (slots >= 3)].any()  # out of range: no adapter, as -1


@needs_cxx
def test_shapes_that_do_not_fit_are_one_clear_error():
    x, a, b, scale = _data(4, 8, 2, 6, 3)
    with pytest.raises(ValueError, match=r"a \[S, K, r\].*got x \(4, 8\), slots \(4,\), a \(3, 9, 2\)"):
        lora_slots.part_delta(x, np.zeros(4, np.int32), np.zeros((3, 9, 2), np.float32), b, scale)
    with pytest.raises(ValueError, match="slots must be int"):
        lora_slots.part_delta(x, np.zeros(4, np.float32), a, b, scale)


@pytest.mark.parametrize("platform, dtype, expected", [
    (Platform("cpu", frozenset({"avx2"}), cxx=True), "float32", "native_cpu"),
    (Platform("cpu", frozenset({"amx_bf16"}), cxx=True), "float32", "native_cpu"),
    (Platform("cpu", frozenset({"avx2"}), cxx=True), "bfloat16", "segment_cpu"),
    (Platform("cpu", frozenset({"avx2"}), cxx=False), "float32", "segment_cpu"),
    (Platform("gpu"), "float32", "segment"),
])
def test_the_engine_s_form_follows_the_platform(platform, dtype, expected):
    form, reason = lora_form(platform, dtype)
    assert form == expected and reason
