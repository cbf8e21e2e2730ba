"""bench/versions.py: the figures' names, the medians and ratios, and two checkouts run in turns."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import versions  # noqa: E402

FAKE = """import argparse, json, pathlib
parser = argparse.ArgumentParser()
parser.add_argument("--out")
args = parser.parse_args()
speed = float(pathlib.Path("speed.txt").read_text())
record = {"meta": {"repeats": 1}, "loads": [{"load": "concurrency 8", "rows": [
    {"runner": "engine", "median": {"output_tokens_per_s": speed, "ok": True}}]}]}
pathlib.Path(args.out + ".json").write_text(json.dumps(record))
"""


def test_a_list_s_records_are_named_by_their_identifying_fields():
    record = {"loads": [{"load": "concurrency 8", "rows": [{"runner": "engine", "median": {"tok_s": 3, "ok": True}},
                                                           {"runner": "static", "median": {"tok_s": 1}}]}], "n": 2}
    assert versions.flatten(record) == {"loads[concurrency 8].rows[engine].median.tok_s": 3.0,
                                        "loads[concurrency 8].rows[static].median.tok_s": 1.0, "n": 2.0}


def test_each_figure_gets_both_medians_and_their_ratio():
    rounds = {"this": [{"a": 2.0, "b": 1}, {"a": 4.0, "b": 1}, {"a": 3.0, "b": 1}],
              "base": [{"a": 1.0, "b": 1}, {"a": 2.0, "b": 1}, {"a": 1.5, "b": 1}]}
    (row,) = versions.compare(rounds, "^a$")
    assert (row["figure"], row["this_median"], row["base_median"], row["ratio"]) == ("a", 3.0, 1.5, 2.0)
    assert row["this"] == [2.0, 4.0, 3.0] and row["base"] == [1.0, 2.0, 1.5]


@pytest.mark.slow  # two fresh interpreters a round
def test_two_checkouts_run_their_own_script_in_turns(tmp_path, monkeypatch):
    checkouts = {}
    for side, speed in (("base", "100"), ("this", "125")):
        folder = tmp_path / side
        (folder / "bench").mkdir(parents=True)
        (folder / "bench" / "fake.py").write_text(FAKE)
        (folder / "speed.txt").write_text(speed)
        checkouts[side] = folder
    monkeypatch.setattr(versions, "ROOT", checkouts["this"])
    monkeypatch.setattr(versions, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(versions, "describe_machine", lambda: {"cpu": "a CPU", "platform": "cpu", "cpus": 2,
                                                               "jax": "0"})
    versions.main(["--base", str(checkouts["base"]), "--rounds", "2", "--name", "fake", "--keys", "tokens_per_s",
                   "--out-flag", "--", "bench/fake.py"])
    saved = json.loads((tmp_path / "results" / "fake.json").read_text())
    (row,) = saved["rows"]
    assert row["figure"] == "loads[concurrency 8].rows[engine].median.output_tokens_per_s"
    assert row["base"] == [100.0, 100.0] and row["this"] == [125.0, 125.0] and row["ratio"] == 1.25
    assert "/path/to/base" in saved["meta"]["command"] and str(tmp_path) not in saved["meta"]["command"]
    assert "| 100 | 125 | 1.250 |" in (tmp_path / "results" / "fake.md").read_text()


def test_a_command_that_fails_is_one_error_line(tmp_path, capsys):
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "broken.py").write_text("raise SystemExit('no model here')\n")
    with pytest.raises(SystemExit, match="bench/broken.py failed in .*: no model here"):
        versions.run_once(tmp_path, ["bench/broken.py"], versions.parse_args(
            ["--base", str(tmp_path), "--name", "x", "--out-flag", "--", "bench/broken.py"]), tmp_path)
