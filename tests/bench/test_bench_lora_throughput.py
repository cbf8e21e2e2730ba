"""bench/lora_throughput.py in a smoke run on the tiny model: every adapter count decodes every token, its
ratio to the engine without adapters recorded, the files written."""

import json

from bench import lora_throughput


def test_every_adapter_count_runs_and_is_compared_with_none(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # its tiny checkpoint, not the user's cache
    out = tmp_path / "lora_throughput"
    assert lora_throughput.main(["--quick", "--adapters", "0", "2", "--requests", "3", "--prompt", "5",
                                 "--output", "3", "--rounds", "1", "--out", str(out)]) == 0
    record = json.loads(out.with_suffix(".json").read_text())
    assert record["model"] == "tiny" and set(record["ratio_to_none"]) == {"0", "2"}
    assert record["ratio_to_none"]["0"] == 1.0 and all(v > 0 for v in record["median_tokens_per_s"].values())
    assert "| 2 |" in out.with_suffix(".md").read_text()
