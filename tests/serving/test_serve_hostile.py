"""Requests a hostile or careless client sends, over the stand-in engine in-process: each is a 400 naming its
field (or the body), answered at once, and the server goes on serving (`jaxattn.serving.api`,
`jaxattn.serving.validation`)."""

import json
import socket
import statistics
import threading
import time
import urllib.error
import urllib.request

import pytest

from jaxattn.serving.api.server import headers_timeout
from jaxattn.serving.text import TextStream
from jaxattn.serving.validation import MAX_STOP_CHARS, MAX_STOPS
from tests.serving.test_serve_app import MODEL, InProcessServer, StandInEngine, served


@pytest.fixture(scope="module")
def server():
    with InProcessServer(StandInEngine(), served()) as running:
        yield running


def post(server, body: bytes, path="/v1/completions"):
    """(status, parsed answer, seconds) of a raw POST."""
    request = urllib.request.Request(server.url + path, data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    started = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            status, text = response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        status, text = err.code, err.read().decode()
    return status, json.loads(text), time.perf_counter() - started


def completion(**fields) -> bytes:
    return json.dumps({"model": MODEL, "prompt": "ab", "max_tokens": 2, **fields}).encode()


@pytest.mark.parametrize("fields, param", [
    (dict(prompt=[True, False]), "prompt"),  # booleans are not token ids (they were read as [1, 0])
    (dict(max_tokens=True), "max_tokens"),  # nor counts (read as 1)
    (dict(max_tokens=2.0), "max_tokens"),
    (dict(n=True), "n"),
    (dict(top_k=2**63), "top_k"),  # passed, then an OverflowError inside the step: a 500
    (dict(stop=["x"] * (MAX_STOPS + 1)), "stop"),  # 10,000 of them took 2.1 s
    (dict(stop=["x" * (MAX_STOP_CHARS + 1)]), "stop"),  # 100 KB took 15 s and stalled the others' steps
])
def test_a_meaningless_or_unbounded_field_is_a_400_naming_it(server, fields, param):
    status, answer, seconds = post(server, completion(**fields))
    assert status == 400 and answer["error"]["param"] == param, answer
    assert seconds < 5
    assert post(server, completion())[0] == 200  # and the server goes on


def test_chat_counts_refuse_booleans_too(server):
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "a"}], "max_completion_tokens": True})
    status, answer, _ = post(server, body.encode(), "/v1/chat/completions")
    assert status == 400 and answer["error"]["param"] == "max_completion_tokens", answer


def test_a_body_nested_past_the_decoder_s_depth_is_a_400_not_a_500(server):
    status, answer, _ = post(server, b"[" * 100_000 + b"]" * 100_000)
    assert status == 400 and "nests" in answer["error"]["message"], answer
    assert post(server, completion())[0] == 200


def test_an_infinite_temperature_names_temperature(server):
    status, answer, _ = post(server, b'{"model": "%s", "prompt": "ab", "temperature": 1e999}' % MODEL.encode())
    assert status == 400 and answer["error"]["param"] == "temperature", answer


def test_a_long_stop_string_costs_a_token_little_time():
    """The hold-back of a stop string's possible start is found at C speed: 16 stop strings of the longest
    length, built to match the text's tail as far as possible, cost a token under 20 ms (it was quadratic
    in the length: 15 s for one stop string of 100 KB)."""
    stop = ("ab" * MAX_STOP_CHARS)[:MAX_STOP_CHARS]
    text = "x" * 500 + "ab" * 300 + "a"
    stream = TextStream(lambda ids: text[:len(ids)], (stop,) * MAX_STOPS)
    for token in range(len(text) - 5):
        stream.add(token)
    started = time.perf_counter()
    for token in range(len(text) - 5, len(text)):
        stream.add(token)
    assert (time.perf_counter() - started) / 5 < 0.02
    assert stream.text == text[:500]  # the tail that may still begin the stop string is held back


def test_a_connection_that_stops_inside_its_headers_is_closed_at_the_deadline():
    """It was held open for 20 s and more: enough of them would use up the server's connections. A request
    whose headers came in time is not cut, however long its answer takes."""
    with InProcessServer(StandInEngine(), served(max_model_len=400), http=headers_timeout(1.0)) as server:
        port = int(server.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as stalled:
            stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-")
            stalled.settimeout(10)
            started = time.monotonic()
            assert stalled.recv(100) == b""  # the server closed it
            assert 0.5 < time.monotonic() - started < 5
        answer = server.client.completions.create(model=MODEL, prompt="ab", max_tokens=200)  # 2 s of steps
        assert answer.usage.completion_tokens == 200
        again = server.client.completions.create(model=MODEL, prompt="ab", max_tokens=2)  # the kept-alive connection
        assert again.usage.completion_tokens == 2


def test_normal_requests_keep_their_latency_beside_hostile_ones(server):
    """A bounded load over loopback: 4 clients send hostile requests (long and many stop strings, huge
    numbers, booleans, deep nesting) for the whole test while 8 connections sit inside their headers;
    20 normal completions, one after another, keep their median latency within 2x of the same completions
    alone (each hostile request is refused at once, so the engine's loop never sees one)."""
    hostile = [completion(stop=["x" * 100_000]), completion(stop=["y"] * 10_000), completion(top_k=2**63),
               completion(prompt=[True, False]), b"[" * 50_000 + b"]" * 50_000]
    port = int(server.url.rsplit(":", 1)[1])

    def normal_latencies() -> list[float]:
        times = []
        for _ in range(20):
            status, _, seconds = post(server, completion(max_tokens=5))
            assert status == 200
            times.append(seconds)
        return times

    alone = normal_latencies()
    stop = threading.Event()
    refused = []

    def attack(body: bytes):
        while not stop.is_set():
            refused.append(post(server, body)[0])

    stalled = [socket.create_connection(("127.0.0.1", port)) for _ in range(8)]
    for connection in stalled:
        connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le")
    attackers = [threading.Thread(target=attack, args=(hostile[i % len(hostile)],)) for i in range(4)]
    for thread in attackers:
        thread.start()
    try:
        beside = normal_latencies()
    finally:
        stop.set()
        for thread in attackers:
            thread.join(30)
        for connection in stalled:
            connection.close()
    print(f"normal completions: median {statistics.median(alone) * 1e3:.1f} ms alone, "
          f"{statistics.median(beside) * 1e3:.1f} ms beside {len(refused)} hostile requests")
    assert refused and set(refused) == {400}
    assert statistics.median(beside) <= 2 * statistics.median(alone), (alone, beside)
