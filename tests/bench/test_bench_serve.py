"""bench/serve.py: the load it draws, the figures it computes, and a smoke run of its runners on a tiny model."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bench import serve

ROOT = Path(__file__).resolve().parents[2]
CORPUS = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n" * 40


# ---------------------------------------------------------------- the load

def test_requests_stay_in_their_ranges_and_are_slices_of_the_text():
    ids = serve.text_ids(CORPUS)
    assert max(ids) < len(set(CORPUS)) and min(ids) == 0
    requests = serve.draw_requests(ids, 200, (5, 40), (3, 9), seed=1)
    assert all(5 <= len(r.prompt) <= 40 and 3 <= r.max_tokens <= 9 for r in requests)
    assert {len(r.prompt) for r in requests} >= {5, 40} and {r.max_tokens for r in requests} == set(range(3, 10))
    text = "".join(map(chr, ids))
    assert all("".join(map(chr, r.prompt)) in text for r in requests)


def test_the_same_seed_draws_the_same_load():
    ids = serve.text_ids(CORPUS)
    def draw(seed):
        return serve.draw_requests(ids, 20, (4, 30), (2, 8), seed=seed)
    assert draw(3) == draw(3) and draw(3) != draw(4)
    assert serve.poisson_arrivals(50, 2.0, seed=3) == serve.poisson_arrivals(50, 2.0, seed=3)


def test_poisson_arrivals_start_at_zero_and_increase_at_the_rate():
    times = serve.poisson_arrivals(4000, 5.0)
    assert times[0] == 0.0 and all(b > a for a, b in zip(times, times[1:]))
    assert np.mean(np.diff(times)) == pytest.approx(1 / 5.0, rel=0.1)


def test_the_loads_share_the_requests():
    requests = serve.draw_requests(serve.text_ids(CORPUS), 5, (4, 8), (2, 3))
    loads = serve.make_loads(requests, [1, 4], 3.0)
    assert [load.name for load in loads] == ["concurrency 1", "concurrency 4", "Poisson 3/s"]
    assert [(r.prompt, r.max_tokens) for r in loads[2].requests] == [(r.prompt, r.max_tokens) for r in requests]
    assert [r.arrival_s for r in loads[2].requests] == serve.poisson_arrivals(5, 3.0)
    assert len(serve.make_loads(requests, [2], 0.0)) == 1


def test_a_corpus_shorter_than_the_longest_prompt_is_refused():
    with pytest.raises(serve.BenchError, match="fewer than the longest prompt"):
        serve.draw_requests([1, 2, 3], 1, (2, 4), (1, 1))


# ---------------------------------------------------------------- the figures

@pytest.mark.parametrize("values", [[3.0], [1.0, 2.0], [5.0, 1.0, 4.0, 2.0, 3.0], list(np.linspace(0, 1, 37))])
@pytest.mark.parametrize("q", [0, 50, 90, 99, 100])
def test_percentiles_interpolate_as_numpy_does(values, q):
    assert serve.percentile(values, q) == pytest.approx(np.percentile(values, q))


def test_percentile_of_nothing_is_none():
    assert serve.percentile([], 50) is None


def test_figures_of_hand_made_timings():
    run = {"end_s": 1.6, "requests": [
        {"arrival_s": 0.0, "token_times_s": [0.5, 0.7, 1.0]},   # TTFT 0.5, gaps 0.2 and 0.3
        {"arrival_s": 1.0, "token_times_s": [1.2, 1.5]},        # TTFT 0.2, gap 0.3
    ]}
    m = serve.metrics(run)
    assert m["duration_s"] == pytest.approx(1.6) and m["output_tokens"] == 5
    assert m["output_tokens_per_s"] == pytest.approx(5 / 1.6) and m["requests_per_s"] == pytest.approx(2 / 1.6)
    assert m["ttft_p50_s"] == pytest.approx(0.35) and m["ttft_p99_s"] == pytest.approx(0.2 + 0.3 * 0.99)
    assert m["itl_p50_s"] == pytest.approx(0.3) and m["itl_p99_s"] == pytest.approx(0.3)
    run["end_s"] = 1.0  # a runner's end before its last token: the last token ends the run
    assert serve.metrics(run)["duration_s"] == pytest.approx(1.5)


def test_one_token_requests_have_no_gaps():
    m = serve.metrics({"end_s": 1.0, "requests": [{"arrival_s": 0.0, "token_times_s": [0.4]}]})
    assert m["itl_p50_s"] is None and m["ttft_p50_s"] == pytest.approx(0.4)


def test_medians_over_repeats_skip_what_is_missing():
    runs = [{"a": 1.0, "b": None}, {"a": 3.0, "b": None}, {"a": 2.0, "b": None}]
    assert serve.median_metrics(runs) == {"a": 2.0, "b": None}


def test_a_runner_that_stops_short_is_caught():
    requests = [serve.Request([1, 2], 3), serve.Request([1], 2)]
    serve.check_tokens(requests, [[5, 5, 5], [6, 6]], "x")
    with pytest.raises(serve.BenchError, match="request 1 asked 2 tokens and got 1"):
        serve.check_tokens(requests, [[5, 5, 5], [6]], "x")


def test_tokens_are_compared_with_static_generate_where_it_ran():
    def record(*outputs):
        return {"available": True, "requests": [{"output_ids": o} for o in outputs]}
    records = {"engine": record([1, 2], [3]), "static_generate": record([1, 2], [4]),
               "hf_generate_batch": record([1, 2], [4])}
    assert serve.agreement(records, ["engine", "hf_generate_batch", "static_generate"]) == {
        "engine": 1, "hf_generate_batch": 2, "static_generate": 2}
    del records["static_generate"]
    assert serve.agreement(records, ["engine", "hf_generate_batch", "static_generate"]) == {
        "engine": 2, "hf_generate_batch": 1}
    assert serve.reference_runner(["engine", "hf_generate_batch"]) == "engine"


def test_the_engine_is_unavailable_while_jaxattn_serving_does_not_import(monkeypatch):
    monkeypatch.setitem(sys.modules, "jaxattn.serving", None)  # `import jaxattn.serving` raises ImportError
    record = serve.run_engine({})
    assert record["available"] is False and "jaxattn.serving does not import" in record["reason"]


def test_an_unavailable_runner_is_a_row_of_the_table():
    meta = {"runners": ["engine", "static_generate"], "model": "tiny", "repeats": 1, "threads": 2, "cores": 2,
            "checkpoint": {"architecture": "GPTNeoXForCausalLM", "params": 30000}, "machine_line": "a CPU",
            "kernels": "reference", "load": "3 requests", "max_seqs": 32, "page_size": 16, "max_model_len": 10,
            "token_budget": 256, "reference": "static_generate", "command": "python bench/serve.py"}
    figures = {"output_tokens_per_s": 100.0, "requests_per_s": 2.0, "ttft_p50_s": 0.01, "ttft_p99_s": 0.02,
               "itl_p50_s": 0.001, "itl_p99_s": 0.002}
    rows = [{"load": "concurrency 2", "runner": "engine", "unavailable": "jaxattn.serving does not import: no"},
            {"load": "concurrency 2", "runner": "static_generate", "median": figures, "compile_s": 1.5,
             "memory": {"pool_bytes": 2 ** 20, "reserved_peak_bytes": 2 ** 20, "used_peak_bytes": None},
             "same_tokens_as_reference": 3, "requests": 3}]
    text = serve.markdown({"meta": meta, "loads": [{"load": "concurrency 2", "load_average": None, "rows": rows}]})
    table = [line for line in text.splitlines() if line.startswith("| concurrency 2")]
    assert table[0].startswith("| concurrency 2 | engine | unavailable: jaxattn.serving does not import")
    assert table[1] == ("| concurrency 2 | static_generate | 100 | 2.00 | 10.0 | 20.0 | 1.00 | 2.00 "
                        "| 1.0 / 1.0 / n/a | 1.5 | 3 of 3 |")
    assert all(line.count("|") == 12 for line in table)


@pytest.mark.parametrize("argv, message", [
    (["--prompt-range", "9,3"], "--prompt-range needs 1 <= MIN <= MAX"),
    (["--output-range", "4"], "--output-range takes MIN,MAX"),
    (["--runners", "static_generate,vllm"], "unknown ['vllm']"),
    (["--concurrency", "0"], "every --concurrency must be at least 1"),
    (["--concurrency", "", "--poisson-rate", "0"], "no load"),
    (["--model", "baby", "--prompt-range", "32,900", "--output-range", "32,256"], "over the baby model's"),
])
def test_a_bad_command_line_is_one_error_line_and_status_2(capsys, argv, message):
    assert serve.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0]


# ---------------------------------------------------------------- smoke runs (fresh processes)

def smoke(tmp_path, runners: str, text: str = CORPUS) -> dict:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(text)
    out = tmp_path / "out" / "serve"
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "serve.py"), "--model", "tiny", "--runners", runners,
         "--requests", "3", "--concurrency", "2", "--poisson-rate", "0", "--prompt-range", "3,6",
         "--output-range", "2,4", "--repeats", "1", "--cache-dir", str(tmp_path / "cache"), "--out", str(out)],
        env={**os.environ, "PYTHONPATH": str(ROOT), "JAXATTN_SHAKESPEARE": str(corpus)}, capture_output=True,
        text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    record = json.loads(out.with_suffix(".json").read_text())
    markdown = out.with_suffix(".md").read_text()
    asked = sum(r.max_tokens for r in serve.draw_requests(serve.text_ids(text), 3, (3, 6), (2, 4)))
    assert record["meta"]["runners"] == runners.split(",") and record["meta"]["model"] == "tiny"
    assert record["meta"]["checkpoint"]["architecture"] == "GPTNeoXForCausalLM"
    assert str(tmp_path) not in record["meta"]["command"] and "--out /path/to/serve" in record["meta"]["command"]
    [load] = record["loads"]
    assert load["load"] == "concurrency 2" and [row["runner"] for row in load["rows"]] == runners.split(",")
    for row in load["rows"]:
        median = row["median"]
        assert median["output_tokens"] == asked  # exactly what was asked: EOS ignored
        for key in ("output_tokens_per_s", "requests_per_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s"):
            # Over HTTP, tokens of consecutive steps that reach the client in one read share its time.
            assert median[key] > 0 or (row["runner"] == "server" and key.startswith("itl") and median[key] == 0), key
        assert median["ttft_p50_s"] <= median["ttft_p99_s"] and median["itl_p50_s"] <= median["itl_p99_s"]
        guided = row["runner"] == "engine_guided"  # requests 0 and 2 guided: their tokens are the guide's
        adapted = row["runner"].startswith("engine_lora")  # the adapted model's tokens
        assert row["memory"]["pool_bytes"] > 0 and row["same_tokens_as_reference"] >= (0 if adapted else 1 if guided
                                                                                        else 3)
        assert f"| concurrency 2 | {row['runner']} |" in markdown
    return record


@pytest.mark.slow
def test_static_generate_smoke_run(tmp_path):
    record = smoke(tmp_path, "static_generate")
    row = record["loads"][0]["rows"][0]
    assert row["memory"]["reserved_peak_bytes"] >= row["memory"]["used_peak_bytes"] > 0
    assert [b["rows"] for b in row["settings"]["batches"]] == [2, 1]  # batches of the concurrency, in order


@pytest.mark.slow
def test_hf_generate_batch_gets_the_same_tokens(tmp_path):
    record = smoke(tmp_path, "static_generate,hf_generate_batch")
    hf = record["loads"][0]["rows"][1]
    assert hf["memory"]["used_peak_bytes"] is None and hf["settings"]["num_blocks"] > 0


@pytest.mark.slow
def test_the_server_over_http_gets_the_same_tokens(tmp_path):
    record = smoke(tmp_path, "static_generate,server")
    server = record["loads"][0]["rows"][1]
    assert server["compile_s"] > 0 and server["memory"]["reserved_peak_bytes"] <= server["memory"]["pool_bytes"]
    assert "--max-seqs 2" in server["settings"]["command"] and "CHECKPOINT" in server["settings"]["command"]


@pytest.mark.slow
def test_the_guided_engine_runs_beside_the_engine_and_states_the_mask_s_cost(tmp_path):
    # $, & and 3 stand for JSON's braces and quote, which Shakespeare lacks (serve.JSON_STAND_INS); the
    # schema's key is "text", whose x this corpus lacks.
    record = smoke(tmp_path, "engine,engine_guided", text=CORPUS + "$&3x")
    guided = record["loads"][0]["rows"][1]
    assert guided["mask"]["per_row_s"] > 0 and guided["mask"]["rows_per_guided_step"] >= 1
    markdown = (tmp_path / "out" / "serve.md").read_text()
    assert "the host filled the guided rows' masks in" in markdown
    for row in record["loads"][0]["rows"]:  # each engine's step: the host's phases and the device's wait
        ms = row["step_ms"]
        assert ms["steps"] >= 2 and ms["host"] > 0 and ms["device"] > 0
        assert ms["total"] == pytest.approx(ms["host"] + ms["device"])
        assert f"| concurrency 2 | {row['runner']} | {ms['steps']:,.0f} | {ms['host']:.2f} |" in markdown


@pytest.mark.slow
def test_the_engine_with_adapters_runs_beside_the_engine_and_is_compared_with_it(tmp_path):
    record = smoke(tmp_path, "engine,engine_lora2")
    lora = record["loads"][0]["rows"][1]
    assert lora["settings"]["max_loras"] == 2 and lora["settings"]["max_lora_rank"] == serve.LORA_RANK
    rows = {row["runner"]: row["median"]["output_tokens_per_s"] for row in record["loads"][0]["rows"]}
    markdown = (tmp_path / "out" / "serve.md").read_text()
    assert "concurrency 2: LoRA adapters in slots" in markdown
    assert f"| 2 | {rows['engine_lora2']:,.1f} | {rows['engine_lora2'] / rows['engine']:.2f}x |" in markdown
