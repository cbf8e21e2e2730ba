"""LoRA adapters over HTTP: `python -m train.serve --lora NAME=DIR --max-loras N`, adapters loaded and
unloaded while serving (`/v1/load_lora_adapter`, `/v1/unload_lora_adapter`), one real server for the
module (a tiny Llama saved as a transformers directory, three PEFT adapters `jaxattn.hf.peft` wrote).

Every answer is checked against the greedy tokens of its adapter merged into the base
(`jaxattn.lora.merge_lora`, `jaxattn.generate`), so a request answered by the wrong adapter, or from
pages another adapter computed, is seen; requests of the base and of three adapters over two slots run
at once, while adapters are unloaded and loaded.
"""

import concurrent.futures
import functools
import json
import threading

import jax
import numpy as np
import openai
import pytest
from tokenizers import Tokenizer

import jaxattn as ja
from jaxattn import hf
from jaxattn.lora import LoraConfig, add_lora, merge_lora
import server_process
from server_process import MODEL, ServerProcess, tiny_bpe_server_args
from tiny_models import with_random_b

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("train_serve_loras")]
KEY, MAX_NEW = "lora-key", 8
ADAPTERS = {"alpha": (4, 8.0, ("q", "v", "o", "down")), "beta": (8, 8.0, ("q", "k", "v", "o", "gate", "up", "down")),
            "gamma": (2, 4.0, ("k", "up"))}  # name: (rank, alpha, targets), each written as a PEFT directory
# The last is longer than a page (16 tokens): its first page goes into the prefix cache.
PROMPTS = [[5, 17, 42, 99, 7, 3], [60, 61, 62, 63, 64, 65, 66, 67, 68, 1], list(range(200, 220))]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(the served model's directory arguments, {adapter: its PEFT directory}, base config, base params)."""
    folder = tmp_path_factory.mktemp("serve_loras")
    args = tiny_bpe_server_args(folder)
    config, params = hf.load_pretrained(folder / MODEL)
    dirs = {}
    for i, (name, (rank, alpha, targets)) in enumerate(ADAPTERS.items()):
        lora = LoraConfig(rank=rank, alpha=alpha, targets=targets)
        adapted = with_random_b(add_lora(params, config, lora, jax.random.PRNGKey(i)), seed=i, std=0.5)
        dirs[name] = hf.peft.save_adapter(folder / name, config, adapted, lora)
    return args, dirs, config, params, Tokenizer.from_file(str(folder / MODEL / "tokenizer.json"))


@pytest.fixture(scope="module")
def server(model):
    args, dirs, *_ = model
    with ServerProcess(args + ["--api-key", KEY, "--max-seqs", "8", "--lora", f"alpha={dirs['alpha']}",
                               "--max-loras", "2", "--max-lora-rank", "8", "--seed", "0"]) as process:
        yield process


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def expected(model):
    """(adapter or None, prompt index) -> the text of the merged model's greedy tokens (cut at `<eos>`)."""
    _, dirs, config, params, tokenizer = model

    @functools.lru_cache(maxsize=None)
    def text(adapter, index):
        merged = params if adapter is None else merge_lora(hf.peft.load_adapter(dirs[adapter], config, params)[0])
        prompt = PROMPTS[index]
        ids = ja.generate(merged, config, np.array([prompt]), np.array([len(prompt)]), max_new_tokens=MAX_NEW,
                          rng=jax.random.PRNGKey(0), temperature=0.0).tokens[0].tolist()
        return tokenizer.decode(ids[:ids.index(0)] if 0 in ids else ids)
    return text


def http(server, path, *, key: str | None = KEY, **options):
    """(status, parsed JSON or text) of a raw request, with this module's key unless told otherwise."""
    return server_process.http(server, path, key=key, timeout=60, **options)


def metric(server, name: str) -> float:
    return server_process.metric(server, name, KEY)


def load(server, name, path, key=KEY):
    return http(server, "/v1/load_lora_adapter", method="POST", key=key,
                body=json.dumps({"lora_name": name, "lora_path": str(path)}).encode())


def unload(server, name):
    return http(server, "/v1/unload_lora_adapter", method="POST", body=json.dumps({"lora_name": name}).encode())


def ask(client, model, index):
    return client.completions.create(model=model, prompt=PROMPTS[index], max_tokens=MAX_NEW, temperature=0)


def test_models_list_the_base_and_each_adapter_with_its_parent(server, client):
    assert "LoRA: 1 adapters, 2 slots of rank 8" in server.ready_line
    cards = {card.id: card for card in client.models.list().data}
    assert set(cards) == {MODEL, "alpha"} and cards["alpha"].parent == MODEL and cards[MODEL].parent is None
    with pytest.raises(openai.NotFoundError, match="the model 'nobody' does not exist"):
        ask(client, "nobody", 0)


def test_loading_and_unloading_refuse_what_they_cannot_do(server, model):
    _, dirs, *_ = model
    assert load(server, "beta", dirs["beta"], key=None)[0] == 401  # behind the API key
    status, body = http(server, "/v1/load_lora_adapter", method="POST", body=b'{"lora_name": "x"}')
    assert status == 400 and body["error"]["param"] == "lora_path"
    for name in ("alpha", MODEL):
        status, body = load(server, name, dirs["beta"])
        assert status == 400 and body["error"]["code"] == "lora_exists"
    status, body = load(server, "nowhere", dirs["beta"].parent / "missing")
    assert status == 400 and body["error"]["param"] == "lora_path" and "missing" in body["error"]["message"]
    status, body = unload(server, "nowhere")
    assert status == 404 and body["error"]["code"] == "model_not_found"


def test_requests_of_the_base_and_three_adapters_over_two_slots_get_their_adapters_tokens(server, client, model,
                                                                                           expected):
    _, dirs, *_ = model
    for name in ("beta", "gamma"):
        assert load(server, name, dirs[name]) == (200, {"status": "ok", "message": f"LoRA adapter {name!r} added"})
    assert metric(server, "jaxattn_lora_adapters_loaded") == 3
    asked = [(adapter, index) for _ in range(2) for adapter in (None, "alpha", "beta", "gamma")
             for index in range(len(PROMPTS))]
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(lambda job: ask(client, job[0] or MODEL, job[1]), asked))
    for (adapter, index), answer in zip(asked, answers):
        assert answer.model == (adapter or MODEL) and answer.choices[0].text == expected(adapter, index), (adapter, index)
    assert len({expected(adapter, 0) for adapter in (None, "alpha", "beta", "gamma")}) >= 3  # they differ


def test_an_adapter_is_unloaded_and_reloaded_while_other_requests_run(server, client, model, expected):
    """Unloading an adapter a request uses is a 409 until it ends; loading another adapter under its name
    then answers with the new one (no page of the old one is found); nothing else is lost meanwhile."""
    _, dirs, *_ = model
    stop, seen, failures = threading.Event(), [], []

    def traffic():  # the base's and alpha's requests, all along
        while not stop.is_set():
            for adapter, index in ((None, 0), ("alpha", 1)):
                try:
                    text = ask(client, adapter or MODEL, index).choices[0].text
                    seen.append(text == expected(adapter, index))
                except Exception as err:  # noqa: BLE001 (any failure is one)
                    failures.append(repr(err))

    expected(None, 0), expected("alpha", 1), expected("gamma", 2), expected("beta", 2)  # computed before
    thread = threading.Thread(target=traffic)
    thread.start()
    try:
        long = client.completions.create(model="gamma", prompt=PROMPTS[2], max_tokens=120, temperature=0,
                                         stream=True, extra_body={"ignore_eos": True})
        next(iter(long))  # it runs
        status, body = unload(server, "gamma")
        assert status == 409 and body["error"]["code"] == "lora_in_use"
        for _ in long:
            pass
        assert unload(server, "gamma")[0] == 200
        with pytest.raises(openai.NotFoundError):
            ask(client, "gamma", 2)
        assert load(server, "gamma", dirs["beta"])[0] == 200  # another adapter under the same name
        assert ask(client, "gamma", 2).choices[0].text == expected("beta", 2)
        assert unload(server, "gamma")[0] == 200 and load(server, "gamma", dirs["gamma"])[0] == 200
        assert ask(client, "gamma", 2).choices[0].text == expected("gamma", 2)
    finally:
        stop.set()
        thread.join(60)
    assert failures == [] and seen and all(seen)
    assert 'jaxattn_lora_requests_running{adapter="gamma"}' in http(server, "/metrics")[1]
