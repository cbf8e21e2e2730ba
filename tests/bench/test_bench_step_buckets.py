"""bench/step_buckets.py on a tiny Q4_1 GGUF file, in this process: every LIVE:BUCKET pair is timed, a full
bucket is its own 1.00x, and the report and record hold each pair and the command without the file's path."""

import dataclasses
import json

import pytest

pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402

from bench import step_buckets  # noqa: E402
from tests.gguf.test_gguf import SPECS, write_gguf  # noqa: E402


def test_each_pair_is_timed_and_a_full_bucket_is_its_own_measure(tmp_path):
    path = tmp_path / "tiny-Q4_1.gguf"
    write_gguf(path, dataclasses.replace(SPECS["llama"], layers=1), Q.Q4_1)
    out = tmp_path / "results" / "step_buckets"
    assert step_buckets.main(["--gguf", str(path), "--pairs", "1:1,2:4,4:4", "--context", "20", "--calls", "2",
                              "--rounds", "1", "--out", str(out)]) == 0
    record = json.loads(out.with_suffix(".json").read_text())
    assert [(row["live"], row["bucket"]) for row in record["rows"]] == [(1, 1), (2, 4), (4, 4)]
    assert all(row["ms"] > 0 and len(row["rounds_ms"]) == 1 for row in record["rows"])
    table = out.with_suffix(".md").read_text()
    assert "| 1 | 1 |" in table and "| 4 | 4 |" in table and "1.00x" in table
    assert str(tmp_path) not in record["command"] and "/path/to/tiny-Q4_1.gguf" in record["command"]
