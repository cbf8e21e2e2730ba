"""Several choices, penalties, min_p and logit_bias through the official `openai` client on one real
`python -m train.serve` process (a tiny random model; all tests in one xdist group).

The engine's draws are checked against NumPy references in tests/serving/test_logit_knobs.py and
test_choices.py; here, what the HTTP layer adds: the fields reach the engine (an answer changes as
they say it must), n choices are each a solo request with seed s + i, streamed with their index,
usage counts the prompt once, best_of answers one of its sequences, and the bad values are 400s
naming the field.
"""

import openai
import pytest

from server_process import CHARS, MODEL, ServerProcess, tiny_server_args

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("train_serve_sampling")]
PROMPT = "The king said"
TOKEN = {c: i for i, c in enumerate(sorted(CHARS))}  # the served character tokenizer's ids


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    args = tiny_server_args(tmp_path_factory.mktemp("serve_sampling")) + ["--max-seqs", "8", "--seed", "0"]
    with ServerProcess(args) as process:
        yield openai.OpenAI(base_url=process.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def complete(client, **knobs):
    return client.completions.create(model=MODEL, prompt=PROMPT, **{"max_tokens": 12, "temperature": 0, **knobs})


def test_n_seeded_choices_each_equal_a_solo_request_with_seed_s_plus_i(client):
    many = complete(client, n=3, seed=40, temperature=1.0)
    solo = [complete(client, seed=40 + i, temperature=1.0) for i in range(3)]
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert [c.text for c in many.choices] == [s.choices[0].text for s in solo]
    assert len({c.text for c in many.choices}) == 3
    assert many.usage.prompt_tokens == solo[0].usage.prompt_tokens  # the prompt once
    assert many.usage.completion_tokens == sum(s.usage.completion_tokens for s in solo)


def test_chat_choices_stream_with_their_index_and_equal_the_whole_answer(client):
    knobs = dict(model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=10, n=2, seed=7,
                 temperature=1.0)
    whole = client.chat.completions.create(**knobs)
    texts, finished, usage = {0: "", 1: ""}, {}, None
    for chunk in client.chat.completions.create(**knobs, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason is not None:
                finished[choice.index] = choice.finish_reason
    assert [texts[i] for i in (0, 1)] == [c.message.content for c in whole.choices]
    assert finished == {0: "length", 1: "length"}
    assert usage.completion_tokens == whole.usage.completion_tokens == 20


def test_best_of_answers_one_of_its_sequences(client):
    best = complete(client, n=1, best_of=3, seed=11, temperature=1.0)
    solo = [complete(client, seed=11 + i, temperature=1.0).choices[0].text for i in range(3)]
    assert len(best.choices) == 1 and best.choices[0].text in solo
    assert best.usage.completion_tokens == 12  # the choices answered, as vLLM counts them
    with pytest.raises(openai.BadRequestError) as caught:
        complete(client, n=1, best_of=2, stream=True)
    assert caught.value.body["param"] == "best_of"


def test_logit_bias_and_the_penalties_reach_the_draw(client):
    forced = complete(client, logit_bias={str(TOKEN["a"]): 100})
    assert forced.choices[0].text == "a" * 12
    plain = complete(client).choices[0].text
    banned = complete(client, logit_bias={str(TOKEN[plain[0]]): -100}).choices[0].text
    assert banned[0] != plain[0]
    penalised = complete(client, presence_penalty=2.0, frequency_penalty=2.0).choices[0].text
    assert penalised != plain and penalised == complete(client, presence_penalty=2.0, frequency_penalty=2.0).choices[0].text
    repeated = complete(client, logit_bias={str(TOKEN["a"]): 5}, extra_body={"repetition_penalty": 3.0}).choices[0].text
    assert repeated != complete(client, logit_bias={str(TOKEN["a"]): 5}).choices[0].text
    sampled = dict(temperature=5.0, seed=3)
    assert complete(client, **sampled, extra_body={"min_p": 0.9}).choices[0].text != complete(client, **sampled).choices[0].text


@pytest.mark.parametrize("knobs, param", [
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=-2.5), "frequency_penalty"),
    (dict(extra_body={"repetition_penalty": 0}), "repetition_penalty"), (dict(extra_body={"min_p": 2}), "min_p"),
    (dict(logit_bias={"a": 1}), "logit_bias"), (dict(logit_bias={"1": 500}), "logit_bias"),
    (dict(logit_bias={str(len(CHARS)): 1}), "logit_bias"), (dict(n=17), "n"), (dict(n=3, best_of=2), "best_of"),
])
def test_bad_values_are_400s_naming_the_field(client, knobs, param):
    with pytest.raises(openai.BadRequestError) as caught:
        complete(client, **knobs)
    assert caught.value.body["param"] == param


@pytest.mark.parametrize("stream", [False, True])
def test_a_guide_the_vocabulary_cannot_write_is_a_400_saying_so(client, stream):
    """The served characters hold no "Ω": the guide leaves the first draw nothing to choose."""
    assert "Ω" not in CHARS
    with pytest.raises(openai.APIError) as caught:  # streamed: the client raises the error event as an APIError
        answer = complete(client, stream=stream, extra_body={"guided_regex": "Ω[a-z]+"})
        for _ in answer:
            pass
    if not stream:
        assert isinstance(caught.value, openai.BadRequestError)
    assert "the vocabulary cannot write what it asks for next" in str(caught.value)
    assert complete(client).choices[0].text  # the server stays up
