"""An adapter PEFT itself wrote, read by `jaxattn.hf.peft.load_adapter` and put into a slot
(`jaxattn.lora.slots`) of a base with q, k and v fused, as the server loads one: the rows that choose
it give the merged model's logits (1e-5) and PEFT's own (tests/hf/test_peft.py's 1e-4); the rows of no
adapter give the base's. The bases and PEFT's adapter are tests/hf/test_peft.py's."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")  # the test extra
pytest.importorskip("transformers")
pytest.importorskip("peft")

from jaxattn import with_fused_qkv  # noqa: E402
from jaxattn.hf.peft import load_adapter  # noqa: E402
from jaxattn.lora import empty_slots, merge_lora, with_token_slots, write_slot  # noqa: E402
from tests.hf.test_peft import ALL, SEQ, TOL, bases, jax_logits, peft_adapter, tokens, torch_logits  # noqa: E402, F401

ROW_SLOTS = np.array([2, -1, 2])


def test_an_adapter_peft_wrote_runs_in_a_slot_as_merged(bases, tmp_path):  # noqa: F811 (the fixture imported)
    model, _, config, params = bases("llama")
    adapted = peft_adapter(model, tmp_path, seed=3).eval()  # r=4 on every projection
    fused, fused_config = with_fused_qkv(params, config)
    with_lora, lora = load_adapter(tmp_path, fused_config, fused)
    slotted = write_slot(empty_slots(fused, fused_config, 3, 8, ALL), 2, with_lora)  # rank 4 in slots of rank 8
    ids = tokens(1, batch=len(ROW_SLOTS))
    got = jax_logits(fused_config, with_token_slots(slotted, np.repeat(ROW_SLOTS, SEQ)), ids)
    merged, base = jax_logits(fused_config, merge_lora(with_lora), ids), jax_logits(config, params, ids)
    adapter_rows = ROW_SLOTS >= 0
    assert np.max(np.abs(got[adapter_rows] - merged[adapter_rows])) < 1e-5
    assert np.max(np.abs(got[adapter_rows] - torch_logits(adapted, ids)[adapter_rows])) < TOL
    assert np.max(np.abs(got[~adapter_rows] - base[~adapter_rows])) < 1e-5
    assert np.max(np.abs(merged - base)) > 1e-2  # the adapter is visible
