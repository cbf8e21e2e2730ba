"""The chat page of `python -m train.serve` (jaxattn/serving/api/chat.html) in headless Chromium, against a real server.

One tiny randomly initialised server (tests/serving/server_process.py) serves the module. Each test opens its
page in a `LoopbackPage` (tests/browser.py): the requests to the server's origin go through, any other is
recorded and aborted, and every test ends with none and with no console error.

The tiny model writes a 200-token reply in a fraction of a second on a CPU, faster than a browser can
show it half written or a click can stop it. The tests that need a reply part way through hold the
server (SIGSTOP) and let it run in slices of a few milliseconds (`Held`), reading the page between
slices; the browser runs on meanwhile.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from browser import LoopbackPage
from server_process import MODEL, ServerProcess, tiny_server_args

# A server process and a Chromium; one worker runs them all (`make test` spreads groups), so each starts once.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("serve_browser")]

PAGE_FILE = Path(__file__).resolve().parents[2] / "jaxattn" / "serving" / "api" / "chat.html"
SLICE_S = 0.004  # how long a held server runs at a time
PAUSE_S = 0.05  # then the browser's time to read and show what came
REPLY = "Array.from(document.querySelectorAll('#messages .assistant')).pop() ?? null"
STATE = f"""() => {{ const r = {REPLY}; return r === null ? null
  : {{state: r.dataset.state ?? null, text: r.querySelector('.text').textContent,
      stats: r.querySelector('.stats') ? r.querySelector('.stats').textContent : null}}; }}"""
FINISHED = f"() => {{ const r = {REPLY}; return r !== null && r.dataset.state !== 'streaming'; }}"


@pytest.fixture(scope="module")
def server(chromium, tmp_path_factory):  # after `chromium` has skipped where there is no browser
    with ServerProcess(tiny_server_args(tmp_path_factory.mktemp("chat-server")) + ["--max-seqs", "4"]) as running:
        yield running


def loopback_page(browser, server: ServerProcess) -> LoopbackPage:
    """A LoopbackPage of the server that also keeps `posted`: (URL, JSON body) of each POST, in order."""
    view = LoopbackPage(browser, server.url, viewport=(1200, 800))
    view.posted = []
    view.page.on("request", lambda r: r.method == "POST" and view.posted.append((r.url, r.post_data_json)))
    return view


@pytest.fixture()
def view(chromium, server):
    page = loopback_page(chromium, server)
    yield page
    page.close()


class Held:
    """The server process stopped (SIGSTOP) while inside the `with`; `run(s)` lets it go on for `s` seconds.

    A stopped server still accepts connections (the kernel queues them), so the page's request waits;
    leaving the `with` (even by an exception) lets the server run again. While held, every thread of the
    server runs at the lowest priority: on cores shared with other work, the test's own process then gets
    a core back when its slice ends, and stops the server after about that slice, not after however long
    the scheduler took to wake it (a server left running for a whole reply shows no growing text).
    """

    def __init__(self, server: ServerProcess):
        self.pid = server.proc.pid

    def _nice(self, value: int) -> None:
        for task in Path(f"/proc/{self.pid}/task").iterdir():  # setpriority names one thread
            try:
                os.setpriority(os.PRIO_PROCESS, int(task.name), value)
            except (ProcessLookupError, PermissionError):  # gone, or not ours to raise again
                pass

    def __enter__(self) -> "Held":
        os.kill(self.pid, signal.SIGSTOP)
        self._nice(19)
        return self

    def run(self, seconds: float = SLICE_S) -> None:
        os.kill(self.pid, signal.SIGCONT)
        time.sleep(seconds)
        os.kill(self.pid, signal.SIGSTOP)

    def __exit__(self, *exc) -> None:
        self._nice(0)
        os.kill(self.pid, signal.SIGCONT)


def reply(page) -> dict | None:
    """{state, text, stats} of the last assistant reply, or None."""
    return page.evaluate(STATE)


def send(page, prompt: str) -> dict:
    """Types `prompt`, sends it with Enter and waits for the reply to end -> `reply(page)`."""
    page.locator("#prompt").fill(prompt)
    page.keyboard.press("Enter")
    page.wait_for_function(FINISHED, timeout=30_000)
    return reply(page)


def slice_until(page, held: Held, done, timeout: float = 60) -> list[dict]:
    """Runs the held server a slice at a time until `done(seen)`, `seen` the last reply after each slice
    (None before there is one); returns `seen`. Playwright answers the page's requests while it reads it."""
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        held.run()
        time.sleep(PAUSE_S)
        seen.append(reply(page))
        if seen[-1] is not None and done(seen):
            return seen
    raise AssertionError(f"the page never showed what was waited for; it showed {seen[-3:]}")


def get(server: ServerProcess, path: str) -> tuple[int, dict, str]:
    with urllib.request.urlopen(server.url + path, timeout=30) as answer:
        return answer.status, dict(answer.headers), answer.read().decode("utf-8")


def post(server: ServerProcess, path: str, body: dict) -> dict:
    request = urllib.request.Request(server.url + path, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        return json.loads(answer.read())


def metrics(server: ServerProcess) -> dict[str, float]:
    """The samples of GET /metrics: {"name" or 'name{labels}': value}."""
    samples = {}
    for line in get(server, "/metrics")[2].splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def set_knobs(page, **values) -> None:
    """Fills the settings by their labels: set_knobs(page, **{"Max tokens": 40})."""
    for label, value in values.items():
        page.get_by_label(label, exact=True).fill(str(value))


def chat_bodies(view) -> list[dict]:
    return [body for url, body in view.posted if url.endswith("/v1/chat/completions")]


# ----------------------------------------------------------------------------- the tests


def test_the_page_is_one_file_the_server_sends_as_it_is(server):
    html = PAGE_FILE.read_text(encoding="utf-8")
    status, headers, body = get(server, "/")
    assert status == 200 and headers["content-type"].startswith("text/html")
    assert body == html
    # Nothing from elsewhere: no URL with a host, no script or style file, no import, no HTML built from text.
    assert re.findall(r"https?://|//[\w.-]+\.\w+/|\bsrc\s*=|@import|\bimport\s*\(|XMLHttpRequest|WebSocket"
                      r"|\.innerHTML|outerHTML|insertAdjacentHTML|document\.write|\beval\s*\(", html) == []
    assert re.findall(r"<link\b[^>]*>", html) == ['<link rel="icon" href="data:,">']  # no favicon request
    assert sorted(set(re.findall(r"fetch\(\s*([^,)]+)", html))) == ['"v1/models"', "url"]  # paths of the origin
    assert sorted(set(re.findall(r"\burl = ([^;]+);", html))) == ['"v1/chat/completions"', '"v1/completions"']


def test_the_page_loads_clean_and_names_the_model(view, server):
    page = view.open()
    assert page.locator("#model").input_value() == MODEL
    assert page.locator("#model").is_visible() and page.evaluate("() => document.body.dataset.model") == MODEL
    assert page.locator("#status").text_content() == "ready"
    assert view.served == [f"GET {server.url}/", f"GET {server.url}/v1/models"]
    for name, enabled in (("Send", True), ("Stop", False), ("New chat", True)):
        assert page.get_by_role("button", name=name, exact=True).is_enabled() == enabled, name
    for label in ("Message", "Mode", "System prompt", "Temperature", "Top p", "Top k", "Max tokens", "Seed",
                  "API key", "Model"):
        assert page.get_by_label(label, exact=True).count() == 1, label
    assert page.get_by_role("log", name="Conversation").count() == 1
    assert page.locator("#prompt").evaluate("e => e === document.activeElement")  # ready to type into
    # The model's context caps max_tokens (the server's card says max_model_len).
    assert page.locator("#max-tokens").get_attribute("max") == "255"
    view.assert_clean()


def test_a_message_streams_into_a_reply_that_ends_with_its_usage(view, server):
    page = view.open()
    set_knobs(page, **{"Temperature": 0.7, "Top p": 0.95, "Top k": 40, "Max tokens": 60, "Seed": 5})
    page.locator("#prompt").click()
    page.keyboard.type("Hello,")
    page.keyboard.press("Shift+Enter")  # a new line, not a send
    page.keyboard.type("world")
    assert page.locator("#prompt").input_value() == "Hello,\nworld" and view.posted == []
    with Held(server) as held:
        page.keyboard.press("Enter")
        assert page.locator("#prompt").input_value() == ""
        assert page.locator("#stop").is_enabled() and not page.locator("#send").is_enabled()
        # A slice at a time until the reply has shown two lengths of text while streaming.
        seen = slice_until(page, held, lambda seen: seen[-1]["state"] != "streaming"
                           or len({len(r["text"]) for r in seen if r and r["text"]}) >= 2)
    streaming = [len(r["text"]) for r in seen if r and r["state"] == "streaming" and r["text"]]
    assert len(set(streaming)) >= 2, f"the reply did not grow while it streamed: {seen}"
    page.wait_for_function(FINISHED, timeout=30_000)
    shown = reply(page)
    assert shown["state"] == "done", shown

    body = chat_bodies(view)[0]
    message = {"role": "user", "content": "Hello,\nworld"}
    assert body == {"model": MODEL, "messages": [message], "stream": True, "stream_options": {"include_usage": True},
                    "temperature": 0.7, "top_p": 0.95, "top_k": 40, "max_tokens": 60, "seed": 5}
    # The same request whole (a seeded reply depends on its seed and positions only): the page lost or
    # repeated no piece of the stream.
    whole = post(server, "/v1/chat/completions",
                 {**{k: v for k, v in body.items() if k != "stream_options"}, "stream": False})
    choice = whole["choices"][0]
    assert shown["text"] == choice["message"]["content"]
    tokens = whole["usage"]["completion_tokens"]
    stats = page.locator("#messages .assistant").last.locator(".stats")
    assert stats.get_attribute("data-tokens") == str(tokens)
    assert stats.get_attribute("data-finish") == choice["finish_reason"]
    for part in (f"{tokens} tokens", f"prompt {whole['usage']['prompt_tokens']}", "first token", "tokens/s",
                 f"finish: {choice['finish_reason']}"):
        assert part in shown["stats"], (part, shown["stats"])
    assert not page.locator("#stop").is_enabled() and page.locator("#send").is_enabled()

    # The next message carries the conversation; "New chat" forgets it.
    set_knobs(page, **{"Max tokens": 8, "Seed": ""})
    page.locator("#prompt").fill("again")
    page.get_by_role("button", name="Send").click()
    page.wait_for_function(FINISHED, timeout=30_000)
    second = chat_bodies(view)[1]
    assert second["messages"] == [message, {"role": "assistant", "content": shown["text"]},
                                  {"role": "user", "content": "again"}]
    assert "seed" not in second and second["max_tokens"] == 8
    page.get_by_role("button", name="New chat").click()
    assert page.locator("#messages .message").count() == 0
    page.locator("#prompt").fill("fresh")
    page.keyboard.press("Enter")
    page.wait_for_function(FINISHED, timeout=30_000)
    assert chat_bodies(view)[2]["messages"] == [{"role": "user", "content": "fresh"}]
    assert reply(page)["state"] == "done" and page.locator("#messages .assistant").count() == 1
    view.assert_clean()


def test_stop_keeps_the_partial_reply_and_the_server_frees_its_row(view, server):
    page = view.open()
    set_knobs(page, **{"Max tokens": 200})
    before = metrics(server)
    page.locator("#prompt").fill("Tell me a long story")
    with Held(server) as held:
        page.get_by_role("button", name="Send").click()
        seen = slice_until(page, held, lambda seen: seen[-1]["state"] != "streaming" or seen[-1]["text"] != "")
        assert seen[-1]["state"] == "streaming", f"the reply ended before it could be stopped: {seen[-1]}"
        page.get_by_role("button", name="Stop").click()  # while the server is held: mid-reply for sure
        page.wait_for_function(FINISHED, timeout=10_000)
    shown = reply(page)
    assert shown["state"] == "stopped", shown
    assert shown["text"].startswith(seen[-1]["text"]) and 0 < len(shown["text"]) < 200
    assert "stopped" in shown["stats"] and "finish:" not in shown["stats"]
    assert not page.locator("#stop").is_enabled() and page.locator("#send").is_enabled()
    assert chat_bodies(view)[0]["max_tokens"] == 200

    deadline = time.monotonic() + 10  # the server notices the closed connection and ends the request
    now = metrics(server)
    while (now["jaxattn_requests_running"] or now["jaxattn_requests_waiting"]) and time.monotonic() < deadline:
        time.sleep(0.1)
        now = metrics(server)
    assert now["jaxattn_requests_running"] == 0 and now["jaxattn_requests_waiting"] == 0
    assert re.search(r"^jaxattn_requests_running 0\.0$", get(server, "/metrics")[2], re.M)
    assert now["jaxattn_kv_pages_used"] == 0  # its pages are back in the pool
    length = 'jaxattn_requests_finished_total{reason="length"}'
    assert now.get(length, 0) == before.get(length, 0), "the stopped reply ran to its max_tokens on the server"
    view.assert_clean()


def test_completion_mode_posts_the_text_as_a_prompt(view, server):
    page = view.open()
    page.get_by_label("Mode", exact=True).select_option("completion")
    assert page.get_by_label("System prompt").is_disabled()  # a plain prompt has no system message
    set_knobs(page, **{"Max tokens": 12, "Seed": 1})
    shown = send(page, "ROMEO:")
    assert shown["state"] == "done", shown
    (url, body), = view.posted
    assert url == f"{server.url}/v1/completions"
    assert body == {"model": MODEL, "prompt": "ROMEO:", "stream": True, "stream_options": {"include_usage": True},
                    "temperature": 0.8, "top_p": 1, "top_k": 0, "max_tokens": 12, "seed": 1}
    whole = post(server, "/v1/completions", {**{k: v for k, v in body.items() if k != "stream_options"},
                                             "stream": False})
    assert shown["text"] == whole["choices"][0]["text"]
    assert f"{whole['usage']['completion_tokens']} tokens" in shown["stats"]
    view.assert_clean()


def test_log_probabilities_colour_each_token_and_a_json_schema_constrains_the_reply(view, server):
    """The Output settings: each token a span coloured by its probability, its top five on hover, the
    numbers the server's own; the JSON schema sent as response_format, and the reply valid JSON of it."""
    page = view.open()
    page.get_by_label("Show log-probabilities").check()
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    page.get_by_label("JSON schema").fill(json.dumps(schema))
    set_knobs(page, **{"Max tokens": 40, "Seed": 3})
    shown = send(page, "A number, as JSON")
    assert shown["state"] == "done", shown
    (url, body), = view.posted
    assert url == f"{server.url}/v1/chat/completions" and body["logprobs"] is True and body["top_logprobs"] == 5
    assert body["response_format"] == {"type": "json_schema", "json_schema": {"name": "schema", "schema": schema}}
    value = json.loads(shown["text"])
    assert set(value) == {"n"} and value["n"] in range(10)
    spans = page.evaluate("""() => Array.from(document.querySelectorAll('#messages .assistant .token'))
                             .map((s) => [s.textContent, Number(s.dataset.logprob), s.title])""")
    assert "".join(text for text, _, _ in spans) == shown["text"]
    assert all(title.count("%") == 5 for _, _, title in spans)  # the top five, on hover
    whole = post(server, "/v1/chat/completions", {**{k: v for k, v in body.items() if k != "stream_options"},
                                                  "stream": False})
    content = whole["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == [text for text, _, _ in spans]
    assert max(abs(e["logprob"] - logprob) for e, (_, logprob, _) in zip(content, spans)) < 1e-4
    view.assert_clean()


def test_a_model_without_a_chat_template_is_used_through_completions(chromium, tmp_path):
    """The page opens in completion mode (the model card says "chat": false); asked to chat anyway, the
    server's 400 shows in the reply, the page goes back to completion mode and keeps the text."""
    args = tiny_server_args(tmp_path, chat_template=False) + ["--max-seqs", "1"]
    with ServerProcess(args) as plain:
        view = loopback_page(chromium, plain)
        try:
            page = view.open()
            assert page.get_by_label("Mode", exact=True).input_value() == "completion"
            assert "no chat template" in page.locator("#notice").text_content()
            page.get_by_label("Mode", exact=True).select_option("chat")
            shown = send(page, "Hi")
            assert shown["state"] == "error", shown
            assert "no chat template" in page.locator(".assistant .problem").text_content()
            assert page.get_by_label("Mode", exact=True).input_value() == "completion"
            assert page.locator("#prompt").input_value() == "Hi"
            page.get_by_role("button", name="Send").click()
            page.wait_for_function(FINISHED, timeout=30_000)
            assert reply(page)["state"] == "done" and reply(page)["text"] != ""
            assert [url for url, _ in view.posted] == [f"{plain.url}/v1/chat/completions",
                                                       f"{plain.url}/v1/completions"]
            # Chromium logs the 400 itself; nothing else went wrong.
            assert [e for e in view.errors if "status of 400" not in e] == [] and len(view.errors) == 1
            assert view.requests == []
        finally:
            view.close()


HARNESS_PAGE = """<!doctype html><html><body><img src="https://example.invalid/a.png">
<script>
  fetch("/data").then(r => r.text()).then(t => { document.body.dataset.got = t; });
  fetch("http://127.0.0.1:9/other-port").catch(() => {});
  fetch("http://localhost:PORT/other-host").catch(() => {});
  try { new WebSocket("ws://127.0.0.1:PORT/socket"); } catch (e) {}
  console.error("boom");
  setTimeout(() => { document.body.dataset.ready = "1"; }, 0);
</script></body></html>"""


def test_the_harness_lets_the_origin_through_and_records_every_other_request(chromium):
    """What the checks above rely on: a LoopbackPage fetches from its origin only, and records the rest."""
    asked = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802  (http.server's name)
            asked.append(self.path)
            page = HARNESS_PAGE.replace("PORT", str(self.server.server_port))
            body = (page if self.path == "/" else "served").encode()
            self.send_response(200 if self.path in ("/", "/data") else 404)
            self.send_header("Content-Type", "text/html" if self.path == "/" else "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    port = httpd.server_port
    view = LoopbackPage(chromium, f"http://127.0.0.1:{port}")
    try:
        page = view.open()
        page.wait_for_function("() => document.body.dataset.got === 'served'", timeout=10_000)
        page.wait_for_timeout(300)
        assert view.served == [f"GET http://127.0.0.1:{port}/", f"GET http://127.0.0.1:{port}/data"]
        for entry in ("GET https://example.invalid/a.png", "GET http://127.0.0.1:9/other-port",
                      f"GET http://localhost:{port}/other-host", f"WEBSOCKET ws://127.0.0.1:{port}/socket"):
            assert entry in view.requests, view.requests
        assert asked == ["/", "/data"]  # the WebSocket and the other host never reached the server
        assert any("boom" in error for error in view.errors)
        with pytest.raises(AssertionError):
            view.assert_clean()
        for elsewhere in ("http://example.com:8000", "ws://127.0.0.1:8000", "file:///index.html"):
            with pytest.raises(ValueError, match="LoopbackPage"):
                LoopbackPage(chromium, elsewhere)
    finally:
        view.close()
        httpd.shutdown()
        httpd.server_close()
