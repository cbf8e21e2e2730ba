"""bench/lora_slots.py in a smoke run: every form timed beside the base, the forms agreeing, the files named by CPU class."""

import json

from bench import lora_slots


def test_every_form_is_timed_beside_the_base_and_agrees(tmp_path):
    record = lora_slots.main(["--quick", "--out", str(tmp_path)])
    assert [(r["rows"], r["adapters"], r["slots"]) for r in record["rows"]] == [(8, 1, 32), (8, 2, 32)]
    for row in record["rows"]:
        assert all(row[f"{cell}_ms"] > 0 for cell in lora_slots.CELLS) and row["forms_max_diff"] < 1e-5
    name = f"lora_slots_{record['machine']['cpu_class_slug']}"
    assert json.loads((tmp_path / f"{name}.json").read_text())["rows"] == record["rows"]
    assert "| 8 | 2 | 32 |" in (tmp_path / f"{name}.md").read_text() and "/path/to/out" in record["command"]
