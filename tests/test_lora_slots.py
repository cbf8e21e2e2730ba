"""Adapters in slots (`jaxattn.lora.slots`): each token row runs the base with its own adapter merged.

A batch whose rows choose three different adapters (ranks 4, 2 and 3 in slots of rank 4, each with its
own targets and scale), an empty slot, and none (-1) gives, row by row, the logits of the base with
that one adapter merged (`merge_lora`), within 1e-5 in float32, for each attention kind and every
form of `slot_delta`; the forms agree with a numpy reference of the maths. Filling, clearing and
choosing slots recompile nothing; what cannot be slotted is refused by name. An adapter PEFT wrote
goes into a slot in tests/hf/test_peft_slots.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.traverse_util import flatten_dict

import jaxattn
from jaxattn.layers.moe import MoEConfig
from jaxattn.lora import (FORMS, LoraConfig, LoraSlots, add_lora, clear_slot, empty_slots, is_slots, merge_lora,
                          slot_delta, with_token_slots, write_slot)
from jaxattn.quantization import quantize
from tests.serving.compiles import counting_compiles
from tiny_models import VOCAB, drawn_params, tiny_config, tiny_kernels, with_random_b

TOL = 1e-5
ALL = ("q", "k", "v", "o", "gate", "up", "down")
GATED = dict(positions="rope", mlp="swiglu", norm="rmsnorm")
MOE = MoEConfig(num_experts=4, experts_per_token=2, expert_hidden=8, num_shared_experts=1, shared_expert_hidden=8)
# name: (config, the slots' targets, quantization mode or None)
KINDS = {
    "mha_fused_qkv": (tiny_config("mha", fused_qkv=True, **GATED), ALL, None),
    "gqa_fused_qkv": (tiny_config("gqa", fused_qkv=True, **GATED), ALL, None),
    "mqa_separate_plain_mlp": (tiny_config("mqa", positions="rope"), ("q", "k", "v", "o", "up", "down"), None),
    "mla": (tiny_config("mla_absorb", **GATED), ("q", "o", "gate", "up", "down"), None),  # wkv_b has no slots
    "moe_shared_experts": (tiny_config("gqa", fused_qkv=True, moe=MOE, **GATED), ALL, None),
    "int8_base": (tiny_config("gqa", fused_qkv=True, d_model=32, mlp_hidden=64, **GATED), ALL, "int8"),
}
SLOTS, RANK = 4, 4
ADAPTERS = ((4, 8.0), (2, 4.0), (3, 3.0))  # (rank, alpha) of three adapters
SLOT_OF = (3, 0, 2)  # the slot each goes into; slot 1 stays empty
ROW_SLOTS = np.array([3, -1, 0, 2, 1, 0])  # each sequence's slot
B, T = len(ROW_SLOTS), 8


def adapter_targets(targets, i):
    """Adapter 0 adapts every slotted target, 1 every other one, 2 the rest."""
    return (targets, targets[::2], targets[1::2])[i]


def token_slots(row_slots=ROW_SLOTS):
    return np.repeat(np.asarray(row_slots, np.int32), T)  # [B*T], row-major as a Linear flattens [B, T]


def with_form(params, form):
    return jax.tree.map(lambda w: w.replace(form=form) if is_slots(w) else w, params, is_leaf=is_slots)


@functools.partial(jax.jit, static_argnums=(0, 1))
def forward(config, kernels, params, ids):
    return jaxattn.DecoderLM(config, kernels).apply({"params": params}, ids)


def ids():
    return jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (B, T)))


@pytest.fixture(scope="module")
def built():
    """name -> (config, kernels, base, [adapter params], slotted params, {slot: logits of its adapter merged})."""
    cache = {}

    def get(name):
        if name not in cache:
            config, targets, mode = KINDS[name]
            kernels = tiny_kernels("mla_absorb" if name == "mla" else "mha")
            base = drawn_params(config, seed=1, std=0.1)
            base = base if mode is None else quantize(base, config, mode)
            adapters = [with_random_b(add_lora(base, config, LoraConfig(rank=r, alpha=alpha,
                                                                        targets=adapter_targets(targets, i)),
                                               jax.random.PRNGKey(i)), seed=i)
                        for i, (r, alpha) in enumerate(ADAPTERS)]
            slotted = empty_slots(base, config, SLOTS, RANK, targets)
            for slot, adapter in zip(SLOT_OF, adapters):
                slotted = write_slot(slotted, slot, adapter)
            plain = np.asarray(forward(config, kernels, base, ids()))
            merged = {-1: plain, 1: plain}
            merged.update({slot: np.asarray(forward(config, kernels, merge_lora(adapter), ids()))
                           for slot, adapter in zip(SLOT_OF, adapters)})
            cache[name] = config, kernels, base, adapters, slotted, merged
        return cache[name]
    return get


def assert_rows_match(got, merged, row_slots=ROW_SLOTS):
    for b, slot in enumerate(row_slots):
        assert np.max(np.abs(got[b] - merged[slot][b])) < TOL, (b, slot)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name", list(KINDS))
def test_each_row_gets_the_logits_of_its_adapter_merged(built, name, form):
    config, kernels, _, _, slotted, merged = built(name)
    got = np.asarray(forward(config, kernels, with_token_slots(with_form(slotted, form), token_slots()), ids()))
    assert_rows_match(got, merged)
    for slot in SLOT_OF:  # every adapter changes its rows
        assert np.max(np.abs(merged[slot] - merged[-1])) > 1e-2


def test_a_smaller_rank_is_zero_padded_and_a_rewritten_slot_holds_only_the_new_adapter(built):
    config, kernels, _, adapters, slotted, merged = built("gqa_fused_qkv")
    qkv = flatten_dict(slotted)[("blocks_0", "attn", "qkv", "kernel")]
    small = flatten_dict(adapters[1])[("blocks_0", "attn", "qkv", "kernel")]  # rank 2, adapts q and v
    assert qkv.a[0].shape == (SLOTS, config.d_model, RANK) and qkv.scale.dtype == jnp.float32
    np.testing.assert_array_equal(qkv.a[0][0, :, :2], small.a[0])
    assert not np.asarray(qkv.a[0][0, :, 2:]).any() and not np.asarray(qkv.b[0][0, 2:]).any()
    assert not np.asarray(qkv.a[1][0]).any()  # k: adapter 1 leaves it alone
    assert not np.asarray(qkv.a[0][1]).any() and float(qkv.scale[1]) == 0.0  # slot 1: empty
    np.testing.assert_allclose(np.asarray(qkv.scale), [2.0, 0.0, 1.0, 2.0])
    # slot 3 held adapter 0 (every target); adapter 1 written over it leaves no trace of it
    rewritten = write_slot(slotted, 3, adapters[1])
    got = np.asarray(forward(config, kernels, with_token_slots(rewritten, token_slots()), ids()))
    assert_rows_match(got, {**merged, 3: merged[0]})


def test_a_cleared_slot_runs_the_base(built):
    config, kernels, _, _, slotted, merged = built("gqa_fused_qkv")
    got = np.asarray(forward(config, kernels, with_token_slots(clear_slot(slotted, 3), token_slots()), ids()))
    assert_rows_match(got, {**merged, 3: merged[-1]})


def test_filling_clearing_and_choosing_slots_compile_nothing_new(built):
    config, kernels, base, adapters, slotted, merged = built("gqa_fused_qkv")
    jitted = jax.jit(write_slot)(slotted, jnp.int32(1), adapters[2])  # a traced slot
    eager = write_slot(slotted, 1, adapters[2])
    for x, y in zip(jax.tree.leaves(jitted), jax.tree.leaves(eager)):
        np.testing.assert_array_equal(x, y)
    forward(config, kernels, with_token_slots(clear_slot(eager, 0), token_slots()), ids())
    other_rows = np.array([1, 1, -1, 0, 3, 2])
    with counting_compiles() as compiles:
        refilled = clear_slot(write_slot(eager, 2, adapters[0]), 0)
        got = np.asarray(forward(config, kernels, with_token_slots(refilled, token_slots(other_rows)), ids()))
    assert compiles == []
    assert_rows_match(got, {**merged, 1: merged[2], 2: merged[3], 0: merged[-1]}, other_rows)


def reference_delta(rows, a, b, scale, slots):
    """The maths in numpy, row by row, in float64."""
    out = np.zeros((rows.shape[0], sum(w.shape[-1] for w in b)))
    for m, s in enumerate(slots):
        if s >= 0:
            out[m] = scale[s] * np.concatenate([rows[m] @ a_j[s] @ b_j[s] for a_j, b_j in zip(a, b)])
    return out


@pytest.mark.parametrize("rows, slots", [(37, "mixed"), (100, "mixed"), (100, "one"), (9, "none")])
def test_every_form_is_the_per_row_maths(rows, slots):
    rng = np.random.default_rng(rows)
    S, d_in, r, widths = 5, 6, 3, (5, 3, 3)
    a = [rng.normal(size=(S, d_in, r)).astype(np.float32) for _ in widths]
    b = [rng.normal(size=(S, r, w)).astype(np.float32) for w in widths]
    scale = rng.uniform(0.5, 2.0, S).astype(np.float32)
    x = rng.normal(size=(rows, d_in)).astype(np.float32)
    chosen = {"mixed": rng.integers(-1, S, rows), "one": np.full(rows, 2), "none": np.full(rows, -1)}[slots]
    weight = LoraSlots(jnp.zeros((d_in, sum(widths))), tuple(map(jnp.asarray, a)), tuple(map(jnp.asarray, b)),
                       jnp.asarray(scale), jnp.asarray(chosen, jnp.int32), parts=("q", "k", "v"), widths=widths,
                       weight_shape=(d_in, sum(widths)))
    want = reference_delta(x.astype(np.float64), a, b, scale, chosen)
    unadapted = weight.replace(a=(weight.a[0], None, weight.a[2]), b=(weight.b[0], None, weight.b[2]))
    both = jax.jit(lambda x, form: (slot_delta(x, weight, form), slot_delta(x, unadapted, form)), static_argnums=1)
    for form in FORMS:
        got, without_k = map(np.asarray, both(jnp.asarray(x), form))
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-5)
        np.testing.assert_allclose(without_k[:, 5:8], 0.0)  # a part without slots: zero columns
        np.testing.assert_allclose(without_k[:, :5], want[:, :5], atol=1e-4, rtol=1e-5)


def test_what_cannot_be_slotted_is_refused_by_name(built):
    config, _, base, adapters, slotted, _ = built("gqa_fused_qkv")
    big = add_lora(base, config, LoraConfig(rank=RANK + 1, targets=("q",)), jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match=r"qkv/kernel part 'q': the adapter's rank 5 is more than the slots' max rank 4"):
        write_slot(slotted, 0, big)
    for slot in (SLOTS, -1):
        with pytest.raises(ValueError, match=rf"slot {slot} is out of range: there are 4 slots"):
            write_slot(slotted, slot, adapters[0])
    with pytest.raises(ValueError, match="slot must be an int"):
        clear_slot(slotted, 1.5)
    few = empty_slots(base, config, SLOTS, RANK, ("q", "v", "o"))
    with pytest.raises(ValueError, match="adapt blocks_0/mlp/gate_up/kernel, which has no slots"):
        write_slot(few, 0, adapters[2])  # adapter 2 adapts k, o, up
    with pytest.raises(ValueError, match="qkv/kernel part 'k': the adapter adapts it, and it has no slots"):
        write_slot(empty_slots(base, config, SLOTS, RANK, ("q", "v", "o", "up")), 0, adapters[2])
    with pytest.raises(ValueError, match="slotted holds no LoraSlots"):
        write_slot(base, 0, adapters[0])
    with pytest.raises(ValueError, match=r"token_slots must be \[M\] int .* got shape \(2, 3\)"):
        with_token_slots(slotted, np.zeros((2, 3), np.int32))
    with pytest.raises(ValueError, match=r"token_slots has shape \(5,\), rows \(48, 16\)"):
        forward(config, jaxattn.Kernels(), with_token_slots(slotted, np.zeros(5, np.int32)), ids())
    with pytest.raises(ValueError, match="token_slots is not set"):
        forward(config, jaxattn.Kernels(), slotted, ids())
    with pytest.raises(ValueError, match="max_rank must be a positive int, got 0"):
        empty_slots(base, config, SLOTS, 0, ALL)
    with pytest.raises(ValueError, match=r"targets \['experts'\] name no weight"):
        empty_slots(base, config, SLOTS, RANK, ("q", "experts"))
    with pytest.raises(ValueError, match="blocks_0/attn/qkv/kernel already has LoRA adapters"):
        empty_slots(slotted, config, SLOTS, RANK, ("q",))


def test_weights_read_as_one_float_array_or_stacked_are_refused_by_name(built):
    moe_config = KINDS["moe_shared_experts"][0]
    with pytest.raises(ValueError, match="name blocks_0/mlp/experts_down, which the model reads as one float"):
        empty_slots(drawn_params(moe_config), moe_config, SLOTS, RANK, ("q", "experts"))
    mla = KINDS["mla"][0]
    mla_params = drawn_params(mla)
    with pytest.raises(ValueError, match="name blocks_0/attn/wkv_b, which the model reads as one float"):
        empty_slots(mla_params, mla, SLOTS, RANK, ("q", "k", "v"))
    scanned = KINDS["gqa_fused_qkv"][0].replace(scan_layers=True)
    with pytest.raises(ValueError, match=r"has shape \(2, 16, 32\): .* not layers stacked for a scan"):
        empty_slots(drawn_params(scanned), scanned, SLOTS, RANK, ("q",))
    # put there by hand, float_param refuses it naming the weight
    wkv_b = mla_params["blocks_0"]["attn"]["wkv_b"]
    by_hand = LoraSlots(wkv_b, (None,), (None,), jnp.zeros((SLOTS,)), jnp.zeros((B * T,), jnp.int32), parts=("kv",),
                        widths=(wkv_b.size // wkv_b.shape[0],), weight_shape=wkv_b.shape)
    mla_params["blocks_0"]["attn"]["wkv_b"] = by_hand
    with pytest.raises(ValueError, match="blocks_0/attn/wkv_b: adapters in slots run per token row"):
        forward(mla, tiny_kernels("mla_absorb"), mla_params, ids())


def test_fusing_q_k_and_v_leaves_slotted_projections_as_they_are():
    config = KINDS["mqa_separate_plain_mlp"][0]
    slotted = empty_slots(drawn_params(config), config, SLOTS, RANK, ("q",))
    fused, fused_config = jaxattn.with_fused_qkv(slotted, config)
    assert fused is slotted and fused_config is config
