"""bench/finetune.py's pieces in this process: both runners on a tiny Llama (one step each), the rows, the
checks of the targets and the report."""

import dataclasses
import json

import pytest

from bench import finetune, step_products
from jaxattn import MLAConfig
from bench.serve import ensure_checkpoint


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    checkpoint, facts = ensure_checkpoint("quick", tmp_path_factory.mktemp("ft"), finetune.quick_config())
    return {"checkpoint": str(checkpoint), "threads": 2, "steps": 1, "seq": 16, "batch": 2, "rank": 4,
            "base_dtype": "float32", "params": facts["params"]}


def test_both_runners_train_the_same_adapters_on_the_same_batches(spec):
    ours, theirs = finetune.run_jax(spec), finetune.run_peft(spec)
    # rank 4 on every projection of 2 layers (d 64, kv 32, mlp 128): the same count on both sides
    assert ours["trainable_params"] == theirs["trainable_params"] == 2 * 4 * (2 * (64 + 64) + 2 * (64 + 32)
                                                                               + 3 * (64 + 128))
    assert ours["optimizer_state_bytes"] >= 8 * ours["trainable_params"]  # two float32 moments (and a count)
    # B = 0 at the start: the first step's loss is the base's on the same batch, on both sides
    assert ours["ms_per_step"] > 0 and abs(ours["last_loss"] - theirs["last_loss"]) < 0.05
    autocast, compute16 = finetune.run_peft_bf16(spec), finetune.run_jax_bf16_compute(spec)
    for bf16 in (autocast, compute16):  # bfloat16 operands: the same loss to bfloat16's rounding
        assert bf16["trainable_params"] == theirs["trainable_params"]
        assert abs(bf16["last_loss"] - theirs["last_loss"]) < 0.05


def test_the_rows_checks_and_report_say_what_held():
    cells = {"jax": {"records": [{"ms_per_step": 100.0, "peak_rss_bytes": 2**30, "trainable_params": 10,
                                  "optimizer_state_bytes": 80, "compile_s": 1.0}]},
             "peft": {"records": [{"ms_per_step": 160.0, "peak_rss_bytes": 2 * 2**30, "trainable_params": 10,
                                   "optimizer_state_bytes": 80, "compile_s": 0.0}]}}
    rows = finetune.summarize(cells, full_params=1000)
    assert rows[0]["state_fraction"] == pytest.approx(0.01) and rows[0]["peak_rss_mb"] == 1024
    checks = {c["check"]: c["holds"] for c in finetune.checks(rows)}
    assert checks == {"jaxattn LoRA step (jax) at least 1.5x peft's": True,
                      "peak memory (jax) no higher than peft's": True,
                      "optimizer state (jax) under 2% of a full fine-tune's": True}
    bf16 = {name: {"records": [{**cells[like]["records"][0], "ms_per_step": ms}]}
            for name, like, ms in (("jax_bf16", "jax", 70.0), ("peft_bf16", "peft", 120.0))}
    bf16["jax_adam8bit"] = {"records": [{**cells["jax"]["records"][0], "optimizer_state_bytes": 21}]}
    both = {c["check"]: c["holds"] for c in finetune.checks(finetune.summarize({**cells, **bf16}, full_params=1000))}
    # bfloat16 beside both peers, float32 beside PEFT's float32 only
    assert both["jaxattn LoRA step (jax_bf16) at least 1.5x peft_bf16's"] is True  # 120 / 70
    assert "jaxattn LoRA step (jax) at least 1.5x peft_bf16's" not in both and len(both) == 2 * 5 + 2
    assert both["optimizer state (jax_adam8bit) under 2% of a full fine-tune's"] is True  # 21 / 8000
    record = {"machine": {"cpu": "x", "platform": "cpu", "cpus": 2, "jax": "0"}, "command": "bench/finetune.py",
              "model": "quick",
              "settings": {"batch": 2, "seq": 16, "rank": 4, "threads": 2, "rounds": 1, "steps": 1},
              "rows": rows, "checks": finetune.checks(rows)}
    text = finetune.markdown(record)
    assert "| jax | 100 | 1.60x |" in text and "| yes |" in text
    json.dumps(record)


def test_the_step_products_are_the_products_torch_autograd_computes(spec):
    """The floor's list is the peer's own step: torch's FLOP counter over PEFT's forward and backward (eager
    attention, so that its products are counted as matrix products) finds the same products."""
    import peft
    import torch
    import transformers
    from torch.utils.flop_counter import FlopCounterMode

    products = finetune.products_of(spec)
    model = transformers.AutoModelForCausalLM.from_pretrained(spec["checkpoint"], dtype=torch.float32,
                                                              attn_implementation="eager")
    model = peft.get_peft_model(model, peft.LoraConfig(r=spec["rank"], lora_alpha=2 * spec["rank"],
                                                       target_modules=list(finetune.PEFT_MODULES),
                                                       task_type="CAUSAL_LM"))
    ids = torch.from_numpy(finetune.windows(spec, model.config.vocab_size, 1)[0, :, :-1].copy())
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    counted = {str(op): flops for op, flops in counter.get_flop_counts()["Global"].items()}
    attention = sum(p.flops for p in products if p.what.startswith("attention"))
    assert counted == {"aten.mm": step_products.total_flops(products) - attention, "aten.bmm": attention}


def test_step_products_refuses_what_it_does_not_list():
    config = finetune.quick_config()
    with pytest.raises(ValueError, match=r"targets \['experts'\]"):
        step_products.step_products(config, 2, 16, 4, ["q", "experts"])
    with pytest.raises(ValueError, match="MLA"):
        mla = MLAConfig(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)
        step_products.step_products(dataclasses.replace(config, mla=mla), 2, 16, 4, ["q"])


def test_the_floor_times_each_product_and_sits_beside_the_steps(spec):
    products = finetune.products_of(spec)
    timed = {"products_xla": step_products.time_products_xla(products, rounds=1),
             "products_torch": step_products.time_products_torch(products, threads=2, rounds=1)}
    for result in timed.values():
        # every product of the step counted once, under its shape
        assert sum(s["count"] for s in result["shapes"]) == sum(p.count for p in products)
        assert result["flops"] == step_products.total_flops(products)
        assert result["ms_per_step"] == pytest.approx(sum(s["ms_each"] * s["count"] for s in result["shapes"]))
    cells = {name: {"records": [{**result, "peak_rss_bytes": 0}]} for name, result in timed.items()}
    steps = {"peft_bf16": 3 * timed["products_torch"]["ms_per_step"],
             "jax_bf16_compute": 2 * timed["products_xla"]["ms_per_step"]}
    for name, ms in steps.items():
        cells[name] = {"records": [{"ms_per_step": ms, "peak_rss_bytes": 2**30, "trainable_params": 10,
                                    "optimizer_state_bytes": 80, "compile_s": 0.0}]}
    rows = finetune.summarize(cells, full_params=1000)
    found = finetune.floor(rows)
    assert found["target_ms"] == pytest.approx(steps["peft_bf16"] / 1.5)
    by = {p["runner"]: p for p in found["products"]}
    xla, torch_ = timed["products_xla"]["ms_per_step"], timed["products_torch"]["ms_per_step"]
    assert by["products_xla"]["left_for_the_rest_ms"] == pytest.approx(found["target_ms"] - xla)
    assert by["products_xla"]["the_rest_ms"] == {"jax_bf16_compute": pytest.approx(xla)}
    assert by["products_torch"]["the_rest_ms"] == {"peft_bf16": pytest.approx(2 * torch_)}
    record = {"machine": {"cpu": "x", "platform": "cpu", "cpus": 2, "jax": "0"}, "command": "bench/finetune.py",
              "model": "quick", "settings": {"batch": 2, "seq": 16, "rank": 4, "threads": 2, "rounds": 1, "steps": 1},
              "rows": rows, "checks": finetune.checks(rows), "floor": found, "cells": cells}
    text = finetune.markdown(record)
    assert "## The floor: the step's products alone" in text and "| products_xla |" in text
    assert "| products_xla |" not in text.split("## The floor")[0]  # not a step among the steps
    shape = timed["products_torch"]["shapes"][0]
    assert f"| {shape['batch']}, {shape['m']}, {shape['k']}, {shape['n']} | {shape['count']} |" in text
    json.dumps(record)
