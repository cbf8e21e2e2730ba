"""bench/speculative.py on a tiny GGUF file, in this process: every candidate runs on each prompt, ours
and transformers' greedy tokens agree, and the table names every prompt; the command keeps no machine path."""

import argparse
import dataclasses
import json

import pytest

pytest.importorskip("gguf")
pytest.importorskip("transformers")

from bench import speculative  # noqa: E402
from tests.gguf.test_gguf import SPECS, write_gguf  # noqa: E402


def test_every_candidate_runs_and_the_table_names_every_prompt(tmp_path, monkeypatch):
    for kind in ("code_edit", "free"):  # the tiny file's context is 64 tokens
        monkeypatch.setitem(speculative.PROMPTS, kind, f"{kind}: x = x + 1")
    path = tmp_path / "tiny.gguf"
    write_gguf(path, dataclasses.replace(SPECS["llama"], layers=1))
    config, params, tokenizer, chat, saved = speculative.load(str(path))
    hf = speculative.hf_model(saved, tokenizer, threads=1, scratch=str(tmp_path / "hf"))
    args = argparse.Namespace(new_tokens=6, rounds=1, k=3, n_min=1, n_max=2, draft_k=(), draft_fixed=False)
    rows = {kind: speculative.measure_prompt(kind, (config, params), tokenizer, chat, args, hf)
            for kind in ("code_edit", "free")}
    for row in rows.values():
        assert set(row["tokens_per_s"]) == {"plain", "ngram", "hf_plain", "hf_lookup"}
        assert row["ngram_equals_plain"] and row["hf_agrees_for"] == 6 and row["hf_lookup_agrees_for"] == 6
        assert row["ngram"]["steps"] >= 1 and row["speedup"] > 0 and row["hf_speedup"] > 0
    record = {"model": path.name, "new_tokens": 6, "rounds": 1, "k": 3, "n_min": 1, "n_max": 2, "threads": 1,
              "load_before": 0.5, "load_after": 0.7, "machine": {"cpu": "cpu"}, "command": "c", "prompts": rows}
    table = speculative.markdown(record)
    assert "| code_edit |" in table and "| free |" in table and "load average 0.5 before" in table


def test_the_command_line_keeps_relative_paths_only():
    line = speculative.command_line(["--gguf", "/models/x/SmolLM2.gguf", "--out", "/elsewhere/out", "--rounds", "3"])
    assert line.endswith("--gguf SmolLM2.gguf --out OUT --rounds 3")
    inside = speculative.command_line(["--out", str(speculative.ROOT / "bench" / "results" / "s")])
    assert inside.endswith("--out bench/results/s")


def test_the_engine_bench_runs_plain_and_speculative_engines_with_the_same_tokens(tmp_path, monkeypatch):
    from bench import speculative_engine
    monkeypatch.setattr(speculative, "PROMPTS", {"code_edit": "code_edit: x = x + 1"})
    monkeypatch.setattr(speculative_engine, "PROMPTS", speculative.PROMPTS)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, dataclasses.replace(SPECS["llama"], layers=1))
    assert speculative_engine.main(["--gguf", str(path), "--rounds", "1", "--new-tokens", "6", "--k", "2",
                                    "--prompts", "code_edit", "--out", str(tmp_path), "--name", "s"]) == 0
    record = json.loads((tmp_path / "s.json").read_text())
    row = record["prompts"]["code_edit"]
    assert row["ngram"]["equals_plain"] and row["tokens_per_s"]["plain"] > 0
    assert record["weights"] == "served" and row["ngram"]["decode_speedup"] > 0 and row["decode_tokens_per_s"]["plain"] > 0
    assert "| code_edit | ngram |" in (tmp_path / "s.md").read_text()
