"""bench/multi_step.py on a tiny Q4_1 GGUF file, in this process: each k is timed in turns, its tokens equal
one step a call's, and the record holds the rows and the command without the file's path."""

import dataclasses
import json

import pytest

pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402

from bench import multi_step  # noqa: E402
from tests.gguf.test_gguf import SPECS, write_gguf  # noqa: E402


def test_each_k_is_timed_and_its_tokens_equal_one_step_a_call(tmp_path):
    path = tmp_path / "tiny-Q4_1.gguf"
    write_gguf(path, dataclasses.replace(SPECS["llama"], layers=1), Q.Q4_1)
    out = tmp_path / "results" / "multi_step"
    assert multi_step.main(["--gguf", str(path), "--steps", "1,3", "--rows", "2", "--prompt", "4", "--new", "7",
                            "--rounds", "2", "--out", str(out)]) == 0
    record = json.loads(out.with_suffix(".json").read_text())
    rows = {row["decode_steps"]: row for row in record["rows"]}
    assert set(rows) == {1, 3} and all(row["tokens_equal_k1"] and row["tokens_per_s"] > 0 for row in rows.values())
    assert rows[3]["calls_per_token"] < rows[1]["calls_per_token"]  # three turns a call: fewer calls
    assert "| 1 | " in out.with_suffix(".md").read_text() and "1.00x" in out.with_suffix(".md").read_text()
    assert str(tmp_path / "tiny") not in record["command"] and "/path/to/gguf" in record["command"]
