"""bench/paged_native.py's pieces in this process: a build's call is timed with the keys and values it
reads, a revision's loop is written out with its headers, and the report names both builds."""

import subprocess

from bench import paged_native


def test_a_cell_times_one_call_and_counts_the_keys_and_values_it_reads():
    got = paged_native.run_cell({"context": 20, "threads": 1, "calls": 2})
    assert got["median_s"] > 0 and got["bytes"] == 2 * 32 * 20 * 3 * 64 * 4


def test_a_revisions_loop_is_written_with_the_headers_it_includes(tmp_path):
    source = paged_native.baseline_source("HEAD", tmp_path)
    assert source == tmp_path / "paged_attention.cc" and source.is_file()
    head = subprocess.run(["git", "show", f"HEAD:{paged_native.SOURCE}"], cwd=paged_native.ROOT,
                          capture_output=True, text=True, check=True).stdout
    assert source.read_text() == head and (tmp_path / "quant_dot.h").is_file()


def test_the_report_names_both_builds_and_the_ratio():
    record = {"baseline": "abc", "context": 600, "threads": 2, "rounds": 2, "bytes": 29.5e6,
              "times": {"this tree": [0.0015, 0.0016], "baseline (abc)": [0.002, 0.0022]},
              "machine": {"cpu": "a CPU", "platform": "cpu", "cpus": 2, "jax": "0"}, "command": "bench"}
    text = paged_native.markdown(record)
    assert "| this tree | 1.55 | 19.0 | 1.50, 1.60 |" in text and "| baseline (abc) | 2.10 |" in text
    assert "This tree over the baseline: 1.35x." in text
