"""`python -m train.serve --speculative ngram:k=3` on a tiny random model: greedy answers are the argmax at
every token (their log-probabilities the top ones), sampled ones and several choices are answered,
`/metrics` carries the spec-decode counters (vLLM's), and a bad spec is one `error:` line, exit 2."""

import json

import pytest

from tests.serving.server_process import MODEL, ServerProcess, http, metric, tiny_server_args
from train import serve

PROMPT = "to be or not to be, to be or not to be, to be or not to be, to be"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    args = tiny_server_args(tmp_path_factory.mktemp("spec")) + ["--max-seqs", "4", "--speculative", "ngram:k=3"]
    with ServerProcess(args) as process:
        yield process


def completion(server, **body):
    status, answer = http(server, "/v1/completions", key=None, method="POST",
                          body=json.dumps({"model": MODEL, "prompt": PROMPT, **body}).encode())
    assert status == 200, answer
    return answer


def test_greedy_tokens_are_the_argmax_at_every_position(server):
    assert "speculative: ngram k=3" in server.ready_line
    answer = completion(server, max_tokens=40, temperature=0, logprobs=3)
    logprobs = answer["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == 40
    for chosen, top in zip(logprobs["token_logprobs"], logprobs["top_logprobs"]):
        assert chosen == pytest.approx(max(top.values()), abs=1e-6)
    again = completion(server, max_tokens=40, temperature=0, logprobs=3)
    assert again["choices"][0]["text"] == answer["choices"][0]["text"]
    steps = metric(server, "jaxattn_spec_decode_verify_steps_total", None)
    drafted = metric(server, "jaxattn_spec_decode_num_draft_tokens_total", None)
    accepted = metric(server, "jaxattn_spec_decode_num_accepted_tokens_total", None)
    first = metric(server, 'jaxattn_spec_decode_num_accepted_tokens_per_pos_total{position="0"}', None)
    assert steps > 0 and drafted > 0 and 0 <= accepted <= drafted and first <= accepted


def test_sampled_answers_and_several_choices_are_answered(server):
    answer = completion(server, max_tokens=24, temperature=1.0, seed=3, n=3)
    assert len(answer["choices"]) == 3
    assert all(choice["finish_reason"] == "length" for choice in answer["choices"])
    assert answer["usage"]["completion_tokens"] == 72


def test_a_bad_spec_is_one_error_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        serve.main(["--random-init", "nowhere.toml", "--speculative", "ngram:k=zero"])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("error: argument --speculative: ") and "k" in lines[-1]
