"""Log-probabilities and echo through `python -m train.serve` and the official `openai` client: one server
process for the module, on a tiny random model saved as a transformers directory (`tiny_hf`), whose
own float32 log-softmax (`DecoderLM.apply` on the same ids) the answers must equal to 1e-5.

The last test runs lm-evaluation-harness's `local-completions` model against the server, and its `hf`
backend on the same directory, on two small tasks written here (a multiple choice scored by
log-likelihood, and a greedy generation scored by exact match): the scores must be equal.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest

from jaxattn.model import DecoderLM
from server_process import TEMPLATE, ServerProcess
from tiny_hf import write_tiny_hf

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("train_serve_logprobs")]
MODEL = "tiny_lm"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = tmp_path_factory.mktemp("logprobs") / MODEL
    config, params, tokenizer = write_tiny_hf(directory)
    (directory.parent / "chat.jinja").write_text(TEMPLATE)
    return directory, config, params, tokenizer


@pytest.fixture(scope="module")
def server(saved):
    directory = saved[0]
    args = ["--hf", str(directory), "--chat-template", str(directory.parent / "chat.jinja"), "--max-seqs", "4",
            "--seed", "0"]
    with ServerProcess(args) as process:
        yield process


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(saved):
    """ids -> `[T, V]` float32 log-softmax of the model's logits (row t predicts token t + 1)."""
    _, config, params, _ = saved
    apply = jax.jit(lambda ids: jax.nn.log_softmax(DecoderLM(config).apply({"params": params}, ids)[0]
                                                   .astype(jnp.float32)))
    return lambda ids: np.asarray(apply(jnp.asarray([ids], jnp.int32)))


def ids_of(saved, text: str) -> list[int]:
    return saved[3].encode(text).ids


def spell(saved, token: int) -> str:
    return saved[3].decode([token])


def ids_from(saved, tokens: list[str]) -> list[int]:
    """The ids of spelled tokens (one character each; the end-of-sequence token, spelled "", drawn too)."""
    return [saved[3].token_to_id(t) if t else saved[3].token_to_id("</s>") for t in tokens]


def expected_top(saved, row: np.ndarray, k: int) -> dict:
    top = np.argsort(-row)[:k]
    return {spell(saved, int(i)): float(row[i]) for i in top}


def check_completion_logprobs(saved, logprobs, ids: list[int], rows: np.ndarray, k: int):
    """`logprobs` (a completion's) are those of tokens `ids`, drawn from the log-softmax `rows`."""
    assert logprobs.tokens == [spell(saved, t) for t in ids]
    np.testing.assert_allclose(logprobs.token_logprobs, rows[np.arange(len(ids)), ids], atol=1e-5)
    assert logprobs.text_offset == np.cumsum([0] + [len(t) for t in logprobs.tokens[:-1]]).tolist()
    for top, row, token in zip(logprobs.top_logprobs, rows, ids):
        want = expected_top(saved, row, k)
        want.setdefault(spell(saved, token), float(row[token]))  # the chosen token's, always
        assert top.keys() == want.keys()
        np.testing.assert_allclose([top[t] for t in want], list(want.values()), atol=1e-5)


def test_completion_logprobs_are_the_models_log_softmax(saved, client, reference):
    """The drawn tokens' log-probabilities and top 5, before temperature and filters (a seeded draw)."""
    prompt = "The king said"
    answer = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0.8, seed=4,
                                       logprobs=5, extra_body={"top_k": 10})
    choice = answer.choices[0]
    out = ids_from(saved, choice.logprobs.tokens)
    assert len(out) == answer.usage.completion_tokens and "".join(choice.logprobs.tokens) == choice.text
    rows = reference(ids_of(saved, prompt) + out)[len(prompt) - 1:-1]
    check_completion_logprobs(saved, choice.logprobs, out, rows, 5)


def test_echo_gives_the_prompt_and_its_logprobs_first(saved, client, reference):
    prompt = "Once upon a time"
    answer = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=2)
    choice = answer.choices[0]
    logprobs = choice.logprobs
    ids = ids_from(saved, logprobs.tokens)
    assert choice.text.startswith(prompt) and "".join(logprobs.tokens) == choice.text
    assert ids[:len(prompt)] == ids_of(saved, prompt) and len(ids) == len(prompt) + answer.usage.completion_tokens
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None and logprobs.tokens[0] == "O"
    logprobs.token_logprobs, logprobs.top_logprobs = logprobs.token_logprobs[1:], logprobs.top_logprobs[1:]
    logprobs.tokens, logprobs.text_offset = logprobs.tokens[1:], [o - 1 for o in logprobs.text_offset[1:]]
    check_completion_logprobs(saved, logprobs, ids[1:], reference(ids)[:-1], 2)
    assert answer.usage.prompt_tokens == len(prompt)


def test_each_of_n_choices_carries_its_own_logprobs_and_echo(saved, client, reference):
    """n seeded choices with echo and logprobs: each choice's text starts with the prompt, and its
    log-probabilities are the model's for its own tokens, as a solo request with that choice's seed."""
    prompt = "Hark"
    answer = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=1.0, seed=7, n=2,
                                       echo=True, logprobs=1)
    assert [c.index for c in answer.choices] == [0, 1]
    for i, choice in enumerate(answer.choices):
        solo = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=1.0, seed=7 + i,
                                         echo=True, logprobs=1).choices[0]
        assert choice.text == solo.text and choice.text.startswith(prompt)
        ids = ids_from(saved, choice.logprobs.tokens)
        assert choice.logprobs.token_logprobs[0] is None and "".join(choice.logprobs.tokens) == choice.text
        np.testing.assert_allclose(choice.logprobs.token_logprobs[1:], reference(ids)[np.arange(len(ids) - 1), ids[1:]],
                                   atol=1e-5)


def test_max_tokens_zero_with_echo_only_scores(saved, client, reference):
    """Token ids in, as lm-eval sends them: the prompt's text and log-probabilities, nothing drawn; with
    echo and no logprobs, the text alone."""
    ids = ids_of(saved, "Score me, please.")
    answer = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=1, temperature=0)
    choice = answer.choices[0]
    assert choice.text == "Score me, please." and choice.finish_reason == "length"
    assert answer.usage.completion_tokens == 0 and len(choice.logprobs.tokens) == len(ids)
    np.testing.assert_allclose(choice.logprobs.token_logprobs[1:], reference(ids)[np.arange(len(ids) - 1), ids[1:]],
                               atol=1e-5)
    plain = client.completions.create(model=MODEL, prompt="Just echo", max_tokens=0, echo=True)
    assert plain.choices[0].text == "Just echo" and plain.choices[0].logprobs is None


def test_chat_logprobs_are_the_models_log_softmax(saved, client, reference):
    messages = [{"role": "user", "content": "Hello there"}]
    answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                            logprobs=True, top_logprobs=3)
    content = answer.choices[0].logprobs.content
    out = ids_from(saved, [c.token for c in content])
    assert "".join(c.token for c in content) == answer.choices[0].message.content
    rendered = ids_of(saved, "<user>Hello there</>\n<assistant>")
    rows = reference(rendered + out)[len(rendered) - 1:-1]
    assert [c.token for c in content] == [spell(saved, t) for t in out]
    assert all(c.bytes == list(c.token.encode()) for c in content)
    np.testing.assert_allclose([c.logprob for c in content], rows[np.arange(len(out)), out], atol=1e-5)
    for entry, row in zip(content, rows):
        want = expected_top(saved, row, 3)
        assert [t.token for t in entry.top_logprobs] == list(want)
        np.testing.assert_allclose([t.logprob for t in entry.top_logprobs], list(want.values()), atol=1e-5)
    no_top = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, logprobs=True)
    assert all(c.top_logprobs == [] for c in no_top.choices[0].logprobs.content)


def test_streamed_logprobs_join_to_the_whole_answers(client):
    knobs = dict(model=MODEL, prompt="Stream this", max_tokens=10, temperature=0, echo=True, logprobs=3)
    whole = client.completions.create(**knobs).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(**knobs, stream=True) if c.choices]
    joined = {name: sum((getattr(c.logprobs, name) for c in chunks if c.logprobs), [])
              for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    assert joined == whole.logprobs.model_dump() and "".join(c.text for c in chunks) == whole.text
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=0,
                logprobs=True, top_logprobs=2)
    whole_chat = client.chat.completions.create(**chat).choices[0].logprobs.content
    streamed = [entry for c in client.chat.completions.create(**chat, stream=True)
                for entry in (c.choices[0].logprobs.content if c.choices and c.choices[0].logprobs else [])]
    # The second request finds the first's prompt pages in the prefix cache, so its prompt runs in
    # another step shape: the numbers agree to float32's rounding, each to the model's within 1e-5.
    assert [(e.token, [t.token for t in e.top_logprobs]) for e in streamed] == [
        (e.token, [t.token for t in e.top_logprobs]) for e in whole_chat]
    np.testing.assert_allclose([[e.logprob] + [t.logprob for t in e.top_logprobs] for e in streamed],
                               [[e.logprob] + [t.logprob for t in e.top_logprobs] for e in whole_chat], atol=1e-5)


@pytest.mark.parametrize("endpoint, knobs, param", [
    ("completions", dict(logprobs=21), "logprobs"),
    ("completions", dict(logprobs=-1), "logprobs"),
    ("completions", dict(logprobs=True), "logprobs"),
    ("completions", dict(max_tokens=0), "max_tokens"),
    ("chat", dict(logprobs=True, top_logprobs=21), "top_logprobs"),
    ("chat", dict(top_logprobs=2), "top_logprobs"),
    ("chat", dict(logprobs=3), "logprobs"),
])
def test_bad_values_are_400s_naming_the_field(client, endpoint, knobs, param):
    with pytest.raises(openai.BadRequestError) as caught:
        if endpoint == "completions":
            client.completions.create(model=MODEL, prompt="x", **{"max_tokens": 2, **knobs})
        else:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                           **knobs)
    assert caught.value.body["param"] == param, caught.value.body


# -- lm-evaluation-harness ---------------------------------------------------------------------

TASKS = {
    "tiny_choice": """task: tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
""",
    "tiny_say": """task: tiny_say
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: answer
generation_kwargs:
  until: ["\\n"]
  do_sample: false
  max_gen_toks: 8
metric_list:
  - metric: exact_match
""",
}


def write_tasks(directory, client) -> None:
    """Two tasks and their JSON-lines data under `directory`. Half of tiny_say's answers are the model's own
    greedy answers (asked of the server here), so that its exact match is neither 0 nor 1."""
    choice = [{"question": f"Which letter follows {c}?", "choices": [chr(ord(c) + 1), chr(ord(c) + 2), "zz", c],
               "answer": i % 4} for i, c in enumerate("abcdefgh")]
    say = [{"question": f"Say {word}:"} for word in ("hi", "yes", "no", "ok", "abc", "x")]
    for i, doc in enumerate(say):
        greedy = client.completions.create(model=MODEL, prompt=doc["question"], max_tokens=8, temperature=0,
                                           stop=["\n"]).choices[0].text
        doc["answer"] = greedy if i % 2 == 0 else "not this"
    for name, docs in (("tiny_choice", choice), ("tiny_say", say)):
        data = directory / f"{name}.jsonl"
        data.write_text("".join(json.dumps(doc) + "\n" for doc in docs))
        (directory / f"{name}.yaml").write_text(TASKS[name].format(data=data))


def test_lm_eval_through_the_server_equals_its_hf_backend(saved, server, client, tmp_path, monkeypatch):
    """lm-eval's `local-completions` (echo with logprobs for the log-likelihoods, greedy completions with
    stop strings for the generations) scores as its `hf` backend does on the same transformers directory."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import make_table

    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    write_tasks(tmp_path, client)
    directory = saved[0]
    runs = {"local-completions": f"model={MODEL},base_url={server.url}/v1/completions,tokenizer_backend=huggingface,"
                                 f"tokenizer={directory},num_concurrent=1,max_retries=1",
            "hf": f"pretrained={directory},dtype=float32,device=cpu"}
    results = {model: lm_eval.simple_evaluate(model=model, model_args=args, tasks=list(TASKS), log_samples=True,
                                              task_manager=TaskManager(include_path=str(tmp_path)), batch_size=1)
               for model, args in runs.items()}
    for model, result in results.items():
        print(f"\n{model}\n{make_table(result)}")
    served, hf = results["local-completions"], results["hf"]
    for task, metric in (("tiny_choice", "acc,none"), ("tiny_say", "exact_match,none")):
        assert served["results"][task][metric] == hf["results"][task][metric]
    assert hf["results"]["tiny_say"]["exact_match,none"] == 0.5
    served_choice, hf_choice = (sorted(r["samples"]["tiny_choice"], key=lambda s: s["doc_id"]) for r in (served, hf))
    loglikelihoods = [[[ll for ll, _ in s["filtered_resps"]] for s in samples]
                      for samples in (served_choice, hf_choice)]
    print("largest log-likelihood difference:", np.abs(np.subtract(*loglikelihoods)).max())
    np.testing.assert_allclose(*loglikelihoods, atol=1e-5)
    generations = [[s["filtered_resps"] for s in sorted(r["samples"]["tiny_say"], key=lambda s: s["doc_id"])]
                   for r in (served, hf)]
    assert generations[0] == generations[1]
