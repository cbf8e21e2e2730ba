"""bench/large_corpus.py end to end at a tiny size: the corpus prepared, both sides trained, the figures written."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_benchmark_writes_both_corpora_and_the_memory_criterion(tmp_path):
    source = tmp_path / "source.txt"
    source.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(2000)))
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "large_corpus.py"), "--gib", "0.002", "--iters", "2",
                           "--rounds", "1", "--scratch", str(tmp_path), "--out-dir", str(tmp_path / "results"),
                           "--source", str(source)],
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads((tmp_path / "results" / "large_corpus.json").read_text())
    assert record["prepare"]["train_tokens"] > 0.002 * 2**30 / 2 and record["prepare"]["peak_rss_gib"] > 0
    assert set(record["runs"]) == {"large", "tiny shakespeare"}
    for runs in record["runs"].values():
        assert len(runs) == 1 and runs[0]["peak_rss_gib_kernel"] > 0.1 and runs[0]["median_tokens_per_s"] > 0
    table = (tmp_path / "results" / "large_corpus.md").read_text()
    assert "Peak memory of the run over the large corpus under 1.5 GiB: yes." in table
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results", "source.txt"]  # the corpus and runs are gone
