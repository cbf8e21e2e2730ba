"""bench/finetune.py's pieces in this process: both runners on a tiny Llama (one step each), the rows, the
checks of the targets and the report."""

import json

import pytest

from bench import finetune
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
