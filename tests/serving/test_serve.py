"""`python -m train.serve` through the official `openai` client: one real server process on a free
loopback port for the module (all its tests in one xdist group), stopped by SIGTERM in the last test.

What each test checks is in its name and docstring; the server's tiny model is random, so the
texts are gibberish, compared with the server's own answers (streamed against whole, concurrent
against solo) rather than with fixed strings.
"""

import asyncio
import json
import re
import signal
import socket
import threading
import time

import openai
import pytest

import server_process
from server_process import MODEL, ServerProcess, tiny_server_args

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("train_serve")]
KEY = "test-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    args = tiny_server_args(tmp_path_factory.mktemp("serve")) + [
        "--api-key", KEY, "--max-seqs", "16", "--max-waiting", "2", "--max-body", "100000", "--seed", "0",
        "--decode-steps", "4"]  # every test below also runs through calls of several decode steps
    with ServerProcess(args) as process:
        yield process


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def http(server, path, *, key: str | None = KEY, **options):
    """(status, parsed JSON or text) of a raw request, with this module's key unless told otherwise."""
    return server_process.http(server, path, key=key, **options)


def metric(server, name: str) -> float:
    """A sample's value from /metrics (`name` with its labels, as Prometheus writes it)."""
    return server_process.metric(server, name, KEY)


def until(condition, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


def complete(client, prompt="The king", **knobs):
    return client.completions.create(model=MODEL, prompt=prompt, **{"max_tokens": 24, "temperature": 0, **knobs})


def test_the_ready_line_names_the_url_model_pages_and_memory(server):
    assert re.match(r"ready: http://127\.0\.0\.1:\d+ \(model 'tiny'; [\d,]+ pages of 16 tokens, [\d.]+ MiB of KV "
                    r"cache: each of 16 rows reaches [\d,]+ tokens at once, the full need: every row can reach the "
                    r"context; \d+ step programs compiled in [\d.]+ s; 4 decode steps per call", server.ready_line), \
        server.ready_line


def test_models_and_health(server, client):
    """/v1/models lists the served name; /health answers 200 without the key."""
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert http(server, "/health", key=None) == (200, {"status": "ok"})


def test_a_streamed_completion_joins_to_the_whole_answer(client):
    whole = complete(client, max_tokens=30)
    chunks = list(complete(client, max_tokens=30, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert whole.choices[0].finish_reason == "length" and chunks[-2].choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 30 and whole.usage.prompt_tokens == len("The king")
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(c.object == "text_completion" and c.id == chunks[0].id for c in chunks)


def test_a_streamed_chat_joins_to_the_whole_answer(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who are you?"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=20, temperature=0)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert whole.choices[0].message.role == "assistant" and whole.choices[0].finish_reason == "length"
    rendered = "<system>Be brief.</>\n<user>Who are you?</>\n<assistant>"  # the template, as transformers renders it
    assert whole.usage.prompt_tokens == len(rendered) and whole.usage.completion_tokens == 20
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_stop_strings_cut_the_text_before_them(client):
    text = complete(client, max_tokens=40).choices[0].text
    stop = text[12:14]
    cut = complete(client, max_tokens=40, stop=stop)
    assert cut.choices[0].text == text[:text.index(stop)] and cut.choices[0].finish_reason == "stop"
    listed = complete(client, max_tokens=40, stop=["\x00never", stop], stream=True)
    assert "".join(c.choices[0].text for c in listed) == text[:text.index(stop)]


def test_max_tokens_bounds_the_answer_and_usage_counts_it(client):
    for n in (1, 7):
        answer = complete(client, max_tokens=n)
        assert answer.usage.completion_tokens == n and answer.usage.total_tokens == n + answer.usage.prompt_tokens
        assert answer.choices[0].finish_reason == "length" and len(answer.choices[0].text) == n  # one char a token


def test_a_seed_gives_the_same_draws_and_another_seed_others(client):
    draws = [complete(client, temperature=1.0, seed=seed, max_tokens=40).choices[0].text for seed in (7, 7, 8)]
    assert draws[0] == draws[1] != draws[2]


def test_a_prompt_of_token_ids_is_the_same_as_its_text(client):
    text = complete(client, prompt="abc").choices[0].text
    ids = [ord(c) - 32 + 1 for c in "abc"]  # the tiny vocabulary: "\n", then printable ASCII from " "
    assert complete(client, prompt=ids).choices[0].text == text


def test_sixteen_concurrent_streams_each_equal_its_solo_answer(server, client):
    prompts = [f"Request {i}: {'xy' * i}" for i in range(16)]
    solo = [complete(client, prompt=p, max_tokens=32).choices[0].text for p in prompts]
    hits_before = metric(server, "jaxattn_prefix_cache_hits_total")

    async def one(aclient, prompt):
        stream = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=32, temperature=0,
                                                  stream=True)
        return "".join([c.choices[0].text async for c in stream])

    async def all_at_once():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0) as aclient:
            return await asyncio.gather(*(one(aclient, p) for p in prompts))

    assert asyncio.run(all_at_once()) == solo
    assert metric(server, "jaxattn_prefix_cache_hits_total") >= hits_before  # counted, never reset


@pytest.mark.parametrize("knobs, param", [
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_p=0.0), "top_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=250, prompt="x" * 10), "max_tokens"),  # 10 + 250 > the context, 256
    (dict(n=17), "n"),  # past the limit, 16
])
def test_bad_parameters_are_400s_naming_the_parameter(client, knobs, param):
    with pytest.raises(openai.BadRequestError) as caught:
        complete(client, **knobs)
    assert caught.value.status_code == 400 and caught.value.body["param"] == param, caught.value.body


def test_deprecated_functions_are_400s_pointing_at_tools(client):
    """OpenAI's older form of tools would change the answer, so it is refused rather than ignored."""
    for field, value in (("functions", [{"name": "f", "parameters": {"type": "object"}}]), ("function_call", "auto")):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                           extra_body={field: value})
        assert caught.value.body["param"] == field and "tools" in caught.value.body["message"]


def test_a_prompt_longer_than_the_context_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "y" * 300}])
    assert caught.value.code == "context_length_exceeded"


def test_characters_outside_the_vocabulary_are_a_400(client):
    with pytest.raises(openai.BadRequestError, match="cannot be encoded"):
        complete(client, prompt="snow ☃")


def test_malformed_json_and_a_body_that_is_no_object_are_400s(server):
    for body in (b"{not json", b"[1, 2]"):
        status, answer = http(server, "/v1/completions", method="POST", body=body)
        assert status == 400 and answer["error"]["type"] == "invalid_request_error", answer


def test_a_missing_or_wrong_key_is_a_401_and_health_stays_open(server):
    with pytest.raises(openai.AuthenticationError) as caught:
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert caught.value.code == "invalid_api_key"
    status, answer = http(server, "/v1/models", key=None)  # the client always sends one
    assert status == 401 and answer["error"]["code"] == "invalid_api_key"
    assert http(server, "/health", key=None)[0] == 200
    assert http(server, "/metrics", key=None)[0] == 200


def test_an_unknown_model_or_route_is_a_404(server, client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="gpt-4", prompt="a", max_tokens=1)
    assert caught.value.body["param"] == "model"
    status, answer = http(server, "/v1/audio/speech", method="POST", body=b"{}")
    assert status == 404 and "no route" in answer["error"]["message"]


def test_a_body_over_the_limit_is_a_413(client):
    with pytest.raises(openai.APIStatusError) as caught:
        complete(client, prompt="a" * 200_000)
    assert caught.value.status_code == 413 and "bytes" in caught.value.message


def test_a_full_waiting_queue_is_a_429(server, client):
    """16 rows and 2 waiting places: of 30 requests sent at once, some are refused with a 429 and every
    other one completes."""
    async def one(aclient, i):
        try:
            answer = await aclient.completions.create(model=MODEL, prompt=f"q{i}", max_tokens=60, temperature=0)
            return answer.usage.completion_tokens
        except openai.RateLimitError as err:
            assert err.status_code == 429 and err.code == "queue_full"
            return "429"

    async def all_at_once():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0) as aclient:
            return await asyncio.gather(*(one(aclient, i) for i in range(30)))

    results = asyncio.run(all_at_once())
    assert "429" in results and set(results) == {60, "429"}, results


def finished(server) -> float:
    """Requests finished so far, for any reason."""
    _, text = http(server, "/metrics")
    return sum(float(v) for v in re.findall(r"^jaxattn_requests_finished_total\{[^}]*\} (\S+)$", text, re.M))


def hang_up_after_asking(server, body: dict) -> None:
    """POSTs a completion on a bare socket and closes it before any byte of the answer."""
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    payload = json.dumps(body).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n").encode()
    with socket.create_connection((host, int(port)), timeout=30) as asking:
        asking.sendall(head + payload)


def test_disconnected_clients_free_their_rows_and_pages(server, client):
    """A stream closed after a few chunks, and a whole answer whose client gave up waiting: both are
    cancelled, seen through /metrics (rows and pages back to none, two more "cancelled")."""
    cancelled = 'jaxattn_requests_finished_total{reason="cancelled"}'
    before = metric(server, cancelled)
    stream = complete(client, max_tokens=200, stream=True)
    for _, chunk in zip(range(3), stream):
        assert chunk.choices[0].text
    stream.close()
    assert until(lambda: metric(server, cancelled) == before + 1), metric(server, cancelled)
    assert until(lambda: metric(server, "jaxattn_requests_running") == 0), metric(server, "jaxattn_requests_running")
    # A client that hangs up at once on a whole answer: the server reads the request, sees the connection
    # closed as it waits for the answer, and cancels it (the tiny model makes 220 tokens in about 0.1 s).
    ended = finished(server)
    hang_up_after_asking(server, {"model": MODEL, "prompt": "wait", "max_tokens": 220, "temperature": 0})
    assert until(lambda: finished(server) > ended), (ended, finished(server))
    assert until(lambda: metric(server, cancelled) == before + 2), metric(server, cancelled)
    assert until(lambda: metric(server, "jaxattn_requests_running") == 0)
    assert metric(server, "jaxattn_kv_pages_used") == 0
    assert metric(server, "jaxattn_generated_tokens_total") > 0
    assert metric(server, "jaxattn_time_to_first_token_seconds_count") > 0
    assert metric(server, "jaxattn_inter_token_latency_seconds_count") > 0


def test_sigterm_drains_running_streams_refuses_new_ones_and_exits_0(server, client):
    """Last in the module: SIGTERM while four streams run. /health and new requests get 503 at once;
    the streams finish whole (the drain lets them, up to --drain-seconds); the process exits 0."""
    results = {}

    def stream(i):
        chunks = list(complete(client, prompt=f"drain {i}", max_tokens=200, stream=True))
        results[i] = ("".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    assert until(lambda: metric(server, "jaxattn_requests_running") == 4, timeout=60)
    server.proc.send_signal(signal.SIGTERM)
    assert until(lambda: http(server, "/health", key=None)[0] == 503, timeout=5)
    with pytest.raises(openai.InternalServerError) as caught:
        complete(client)
    assert caught.value.status_code == 503 and caught.value.code == "draining"
    for thread in threads:
        thread.join(120)
    assert server.proc.wait(60) == 0, server.stderr()[-2000:]
    assert [results[i][1] for i in range(4)] == ["length"] * 4
    assert all(len(results[i][0]) == 200 for i in range(4))
    assert "Traceback" not in server.stderr()
