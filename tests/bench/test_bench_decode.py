"""bench/decode.py's cache-length sweep: each batch size keeps its own results file."""

import json
import types

import pytest

from bench import decode as bench_decode


@pytest.mark.parametrize("batch,name", [(1, "decode_cache_sweep"), (8, "decode_cache_sweep_b8")])
def test_a_sweep_writes_the_file_of_its_batch(monkeypatch, tmp_path, batch, name):
    monkeypatch.setattr(bench_decode, "RESULTS", tmp_path)
    rows = [dict(kernel=kernel, max_len=max_len, cache_length=256, runs=[0.5], tokens_per_s=float(i))
            for i, (kernel, max_len) in enumerate((k, m) for k in bench_decode.SWEEP_KERNELS for m in (8192, 256))]
    bench_decode.write_sweep(rows, types.SimpleNamespace(batch=batch, sweep_steps=32, repeats=5))
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{name}.json", f"{name}.md"]
    assert json.loads((tmp_path / f"{name}.json").read_text())["meta"]["batch"] == batch
    assert f"batch {batch}," in (tmp_path / f"{name}.md").read_text()
