"""bench/fused_qkv.py on a tiny Llama: every format timed in each layout, each with the same tokens."""

import json

from bench import fused_qkv


def test_each_format_decodes_the_same_tokens_with_q_k_and_v_fused(tmp_path):
    record = fused_qkv.main(["--quick", "--weights", "float32,int8", "--out", str(tmp_path / "out"),
                             "--cache-dir", str(tmp_path / "cache")])
    rows = {(r["weights"], r["layout"]): r for r in record["rows"]}
    assert set(rows) == {("float32", "separate"), ("float32", "fused"),
                         *(("int8", layout) for layout in ("separate", "fused", "fused, prepared"))}
    assert all(r["same_tokens"] and r["tokens_per_s"] > 0 for r in rows.values())
    fused, separate = rows["int8", "fused"], rows["int8", "separate"]
    assert fused["speedup"] == fused["tokens_per_s"] / separate["tokens_per_s"] and separate["speedup"] == 1
    saved = json.loads((tmp_path / "out" / "fused_qkv.json").read_text())
    assert saved["rows"] == record["rows"] and "| int8 | fused, prepared |" in (tmp_path / "out" / "fused_qkv.md").read_text()
