"""bench/gguf_kept.py on a tiny Q4_1 GGUF file, in this process: a jaxattn cell measures the file kept
quantized (decode, prompt processing, the resident size), and the report names every cell."""

import dataclasses

import pytest

pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402

from bench import gguf_kept  # noqa: E402
from tests.gguf.test_gguf import SPECS, write_gguf  # noqa: E402


def test_a_jaxattn_cell_measures_the_kept_file_and_the_report_names_every_cell(tmp_path):
    path = tmp_path / "tiny-Q4_1.gguf"
    write_gguf(path, dataclasses.replace(SPECS["llama"], layers=1), Q.Q4_1)
    spec = {"cell": "jaxattn kept", "gguf": str(path), "dtype": None, "threads": 1, "new_tokens": 3,
            "prompt_len": 8, "calls": 1}
    kept = gguf_kept.run_jaxattn(spec)
    assert kept["quant"] == "int4:asym" and kept["decode_tokens_per_s"] > 0 and kept["prompt_tokens_per_s"] > 0
    assert kept["rss_bytes"] > kept["weight_bytes"] > 0 and kept["notes"]
    # the runtime alone, then the model read (in a test process whose heap earlier tests grew: no order between them)
    assert kept["runtime_rss_bytes"] > 0 and kept["loaded_rss_bytes"] > 0
    floats = gguf_kept.run_jaxattn({**spec, "cell": "jaxattn float32", "dtype": "float32"})
    assert floats["quant"] is None and floats["weight_bytes"] > 3 * kept["weight_bytes"]
    results = {"jaxattn kept": [{**kept, "peak_rss_bytes": 2}], "jaxattn kept, native_cpu": [],
               "jaxattn float32": [{**floats, "peak_rss_bytes": 1}],
               "llama.cpp": [{"available": False, "reason": "llama-cpp-python is not installed"}]}
    rows = gguf_kept.summarize(results, file_bytes=path.stat().st_size)
    record = {"gguf": str(path), "file_bytes": path.stat().st_size, "threads": 1, "rounds": 1, "new_tokens": 3,
              "prompt_len": 8, "rows": rows, "machine": {"cpu": "cpu", "platform": "cpu", "cpus": 1, "jax": "0"},
              "command": "bench/gguf_kept.py"}
    table = gguf_kept.markdown(record)
    assert "| jaxattn kept | int4:asym |" in table and "| llama.cpp | unavailable: llama-cpp-python" in table
    assert "| jaxattn kept, native_cpu | unavailable" in table and "| ready - runtime |" in table
