"""The server's failure paths in-process, over a stand-in engine (no model to compile): an internal
error is a 500 and the server goes on, chat without a template is a 400, a drain cancels what has
not finished in time (`jaxattn.serving.api`), and `python -m train.serve`'s start-up errors are one line
and exit 1 or 2."""

import collections
import socket
import threading
import time
import types

import openai
import uvicorn
import pytest

from jaxattn.hf.chat_template import ChatTemplate
from jaxattn.serving import Request, Status
from jaxattn.serving.api.app import Limits, ServedModel, create_app
from jaxattn.serving.api.metrics import ServerMetrics
from jaxattn.serving.api.runner import EngineRunner
from jaxattn.serving.api.server import DrainingServer, listen_socket
from train import serve

MODEL = "stand-in"


class StandInEngine:
    """What EngineRunner and the metrics use of an Engine. Each step draws token 1 for every request
    (or raises, with `fail`); with `stall`, requests never get a token; cancelled ones end."""

    lora_names, loras, speculator = (), None, None  # no LoRA slots, no speculative decoding

    def __init__(self, *, fail=False, stall=False):
        self.fail, self.stall = fail, stall
        self.allocator = types.SimpleNamespace(in_use=0, num_pages=8, cached=0, hits=0, queries=0)
        self.stats = collections.Counter()
        self.waiting, self.running, self._cancelled = collections.deque(), [], []

    def add_request(self, prompt_ids, sampling):
        request = Request(tuple(prompt_ids), sampling, 0, lambda ids: "x" * len(ids))
        self.waiting.append(request)
        return request

    def cancel(self, request):
        self._cancelled.append(request)

    def has_unfinished(self):
        return bool(self.waiting or self.running)

    def step(self):
        if self.fail:
            raise RuntimeError("the stand-in step failed")
        time.sleep(0.01)
        ended = []
        for request in self._cancelled:
            for queue in (self.waiting, self.running):
                if request in queue:
                    queue.remove(request)
            request.status, request.finish_reason = Status.FINISHED, "cancelled"
            ended.append(request)
        self._cancelled = []
        while self.waiting:
            request = self.waiting.popleft()
            request.status = Status.RUNNING
            self.running.append(request)
        if self.stall:
            return ended
        for request in list(self.running):
            request.output_ids.append(1)
            request.token_times.append(time.perf_counter())
            request.text.add(1)
            if len(request.output_ids) == request.sampling.max_tokens:
                request.status, request.finish_reason = Status.FINISHED, "length"
                request.text.finish()
                self.running.remove(request)
            ended.append(request)
        return ended


def served(**changes) -> ServedModel:
    return ServedModel(**{**dict(name=MODEL, encode=lambda text, special: [1] * len(text), max_model_len=64),
                          **changes})


class InProcessServer:
    """The app over a stand-in engine, served by `DrainingServer` on a thread (port 0)."""

    def __init__(self, engine, model: ServedModel, drain_seconds=30.0, http="auto"):
        self.runner = EngineRunner(engine)
        metrics = ServerMetrics(engine)
        app = create_app(self.runner, model, metrics, Limits())
        self.sock = listen_socket("127.0.0.1", 0)
        self.url = "http://127.0.0.1:%d" % self.sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="critical", lifespan="off", timeout_graceful_shutdown=2, http=http)
        self.server = DrainingServer(config, self.runner, drain_seconds, lambda: "ready")
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=30)

    def __enter__(self):
        self.runner.start()
        self.thread = threading.Thread(target=self.server.run, kwargs=dict(sockets=[self.sock]), daemon=True)
        self.thread.start()
        assert wait_for(lambda: self.server.started)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(10)
        self.runner.stop()


def wait_for(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False


def test_the_stand_in_serves_a_completion():
    """The stand-in is a fair engine: a whole answer of max_tokens tokens."""
    with InProcessServer(StandInEngine(), served()) as server:
        answer = server.client.completions.create(model=MODEL, prompt="ab", max_tokens=3)
    assert answer.choices[0].text == "xxx" and answer.usage.completion_tokens == 3


def test_an_internal_error_is_a_500_naming_the_request_and_the_server_goes_on(caplog):
    def broken(text, special):
        raise RuntimeError("an encoder bug")

    with InProcessServer(StandInEngine(), served(encode=broken)) as server:
        with pytest.raises(openai.InternalServerError) as caught:
            server.client.completions.create(model=MODEL, prompt="ab", max_tokens=3)
        assert caught.value.status_code == 500 and "Traceback" not in caught.value.message
        tag = caught.value.message.split("request ")[1].split(")")[0]
        assert tag.startswith("req-") and tag in caplog.text  # logged with its id
        assert server.client.models.list().data[0].id == MODEL  # still up


def test_a_failed_step_ends_its_requests_with_500s_and_the_server_goes_on(caplog):
    engine = StandInEngine(fail=True)
    with InProcessServer(engine, served()) as server:
        with pytest.raises(openai.InternalServerError, match="internal error in the step"):
            server.client.completions.create(model=MODEL, prompt="ab", max_tokens=3)
        stream = server.client.completions.create(model=MODEL, prompt="ab", max_tokens=3, stream=True)
        with pytest.raises(openai.APIError, match="internal error in the step"):
            list(stream)
        engine.fail = False
        assert server.client.completions.create(model=MODEL, prompt="ab", max_tokens=2).choices[0].text == "xx"
    assert "a step failed (requests req-" in caplog.text


def test_chat_without_a_template_is_a_400_and_completions_still_work():
    with InProcessServer(StandInEngine(), served()) as server:
        with pytest.raises(openai.BadRequestError) as caught:
            server.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
        assert caught.value.code == "no_chat_template" and "--chat-template" in caught.value.message
        assert server.client.completions.create(model=MODEL, prompt="a", max_tokens=1).choices[0].text == "x"


def test_a_drain_cancels_what_has_not_finished_after_drain_seconds():
    """A stream that never progresses: after SIGTERM /health is 503, new requests are 503, and after
    --drain-seconds the stream ends with an error event and the server stops."""
    with InProcessServer(StandInEngine(stall=True), served(), drain_seconds=0.5) as server:
        stream = server.client.completions.create(model=MODEL, prompt="ab", max_tokens=3, stream=True)
        assert wait_for(lambda: len(server.runner.engine.running) == 1)
        server.server.handle_exit(15, None)
        with pytest.raises(openai.InternalServerError) as caught:
            server.client.completions.create(model=MODEL, prompt="a", max_tokens=1)
        assert caught.value.status_code == 503
        with pytest.raises(openai.APIError, match="shut down before this request finished"):
            list(stream)
        server.thread.join(10)
        assert not server.thread.is_alive()


# -- start-up errors: one line, exit 1 (runtime) or 2 (usage), before any model is compiled ------------

def run_main(capsys, *argv):
    with pytest.raises(SystemExit) as exited:
        serve.main(list(argv))
    err = capsys.readouterr().err.strip().splitlines()
    return exited.value.code, err[-1] if err else ""


def test_a_port_in_use_is_one_error_line_and_exit_1(capsys, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, line = run_main(capsys, "--checkpoint", str(tmp_path), "--port", str(port))
    assert code == 1 and line == f"error: cannot listen on 127.0.0.1:{port}: the port is in use"


def test_an_address_that_is_not_this_machine_s_is_one_error_line_and_exit_1(capsys, tmp_path):
    code, line = run_main(capsys, "--checkpoint", str(tmp_path), "--host", "192.0.2.1", "--port", "0")
    assert code == 1 and line == "error: cannot listen on 192.0.2.1:0: the address is not this machine's"


def test_a_model_that_does_not_load_is_one_error_line_and_exit_1(capsys, tmp_path):
    code, line = run_main(capsys, "--hf", str(tmp_path / "missing"), "--port", "0")
    assert code == 1 and line.startswith("error: ") and "missing" in line


def test_a_lora_directory_that_is_not_an_adapter_is_one_error_line_and_exit_1(capsys, tmp_path):
    code, line = run_main(capsys, "--hf", str(tmp_path / "missing"), "--port", "0", "--lora", f"a={tmp_path}")
    assert code == 1 and line == f"error: --lora a={tmp_path}: no adapter_config.json there (a PEFT adapter directory)"


@pytest.mark.parametrize("argv, message", [
    (["--max-seqs", "0"], "--max-seqs must be >= 1"),
    (["--port", "70000"], "--port must be in [0, 65535]"),
    (["--data", "x.txt"], "--data goes with --random-init"),
    (["--kv-memory", "1", "--num-pages", "8"], "not allowed with argument"),
    (["--lora", "no-directory"], "--lora takes NAME=DIR (a PEFT adapter directory), got 'no-directory'"),
    (["--lora", "a=x", "--lora", "a=y"], "--lora a=y: the name 'a' is served already"),
    (["--lora", "a=x", "--max-loras", "0"], "--lora needs --max-loras >= 1"),
    (["--max-lora-rank", "0"], "--max-lora-rank >= 1"),
])
def test_bad_flags_are_one_error_line_and_exit_2(capsys, tmp_path, argv, message):
    code, line = run_main(capsys, "--checkpoint", str(tmp_path), *argv)
    assert code == 2 and line.startswith("error: ") and message in line


# -- the request's checks: the engine's one place, answered as 400s naming the endpoint's field ----------

def test_out_of_range_fields_are_400s_naming_the_endpoint_s_field():
    """SamplingParams' refusals (jaxattn.serving.validation) name the engine's parameter; the server answers
    with its endpoint's: a chat's max_completion_tokens, a completion's top_k and stop. top_k -1 means off."""
    template = ChatTemplate("{% for m in messages %}{{ m['content'] }}{% endfor %}", {})
    with InProcessServer(StandInEngine(), served(chat_template=template)) as server:
        for call, param in [
            (lambda: server.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a"}],
                                                           max_completion_tokens=0), "max_completion_tokens"),
            (lambda: server.client.completions.create(model=MODEL, prompt="a", extra_body={"top_k": -2}), "top_k"),
            (lambda: server.client.completions.create(model=MODEL, prompt="a", stop=[""]), "stop"),
            (lambda: server.client.completions.create(model=MODEL, prompt=""), "prompt"),
        ]:
            with pytest.raises(openai.BadRequestError) as caught:
                call()
            assert caught.value.body["param"] == param, caught.value.body
        answer = server.client.completions.create(model=MODEL, prompt="a", max_tokens=2, extra_body={"top_k": -1})
        assert answer.choices[0].text == "xx"
