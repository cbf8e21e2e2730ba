"""A real `python -m train.serve` process for the server tests, on a free loopback port.

`tiny_server_args(directory)` writes a tiny randomly initialised model (a config file, the corpus
whose characters are its vocabulary, a chat template) and returns the command-line arguments that
serve it. `ServerProcess` starts the program with `--port 0` (the system picks a free port), waits
for its one `ready:` line on stdout (the URL it listens on), and stops it on exit (SIGTERM, then
SIGKILL), keeping what it wrote on stderr for the assertions. `http` and `metric` ask it a raw request and
read one sample of its /metrics.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Printable ASCII and two characters outside it (whole characters stream out, never halves).
CHARS = "\n" + "".join(chr(c) for c in range(32, 127)) + "é日"
TINY_TOML = f"""
[model]
vocab_size = {len(CHARS)}
d_model = 32
num_layers = 2
num_heads = 4
num_kv_heads = 2
positions = "rope"
max_seq_len = 256
init_std = 0.3
"""
# A chat template of the characters above (ChatML's shape, written in them).
TEMPLATE = ("{% for message in messages %}{{ '<' + message['role'] + '>' + message['content'] + '</>\\n' }}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<assistant>' }}{% endif %}")
MODEL = "tiny"  # the served name: the config file's stem
READY = re.compile(r"^ready: (http://\S+)")


def tiny_server_args(directory: Path, *, chat_template: bool = True) -> list[str]:
    """Writes tiny.toml, corpus.txt and chat.jinja under `directory`; the arguments that serve them."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{MODEL}.toml").write_text(TINY_TOML)
    (directory / "corpus.txt").write_text(CHARS)
    args = ["--random-init", str(directory / f"{MODEL}.toml"), "--data", str(directory / "corpus.txt")]
    if chat_template:
        (directory / "chat.jinja").write_text(TEMPLATE)
        args += ["--chat-template", str(directory / "chat.jinja")]
    return args


class ServerProcess:
    """`python -m train.serve ARGS --host 127.0.0.1 --port 0`, ready when it has printed its URL.

    Use as a context manager; `url` is "http://127.0.0.1:PORT"; `stderr()` is what it has logged.
    `stop(sig)` sends `sig` and waits for the exit code.
    """

    def __init__(self, args: list[str], *, timeout: float = 600, env: dict | None = None):
        self.args, self.timeout = args, timeout
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
        self.url: str | None = None
        self.ready_line = ""
        self._err: list[str] = []

    def __enter__(self) -> "ServerProcess":
        self.proc = subprocess.Popen([sys.executable, "-m", "train.serve", *self.args, "--host", "127.0.0.1",
                                      "--port", "0"], cwd=ROOT, env=self.env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self._reader = threading.Thread(target=self._read_stderr, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + self.timeout
        for line in self.proc.stdout:
            match = READY.match(line)
            if match:
                self.url, self.ready_line = match.group(1), line.strip()
                break
            if time.monotonic() > deadline:
                break
        if self.url is None:
            self.stop(signal.SIGKILL)
            raise RuntimeError(f"train.serve did not print its ready line (exit {self.proc.returncode}): "
                               f"{self.stderr()[-3000:]}")
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()  # never blocks the server
        return self

    def _read_stderr(self) -> None:
        for line in self.proc.stderr:
            self._err.append(line)

    def stderr(self) -> str:
        return "".join(self._err)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        """Sends `sig` (if it still runs) and waits; SIGKILL after `timeout`. The exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(5)
        return self.proc.returncode

    def __exit__(self, *exc) -> None:
        self.stop()


def tiny_bpe_server_args(directory: Path) -> list[str]:
    """A tiny random Llama saved as a transformers directory under `directory` with a byte-level BPE
    tokenizer whose tokens span several characters (`structured_cases.bpe_tokenizer`, `<eos>` its end of
    sequence), and the chat template above; the arguments that serve it as `MODEL`."""
    import jaxattn
    from jaxattn import hf
    from structured_cases import bpe_tokenizer
    from tiny_models import drawn_params

    directory.mkdir(parents=True, exist_ok=True)
    config = jaxattn.ModelConfig(vocab_size=320, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                 mlp_hidden=64, max_seq_len=512, positions="rope", norm="rmsnorm", mlp="swiglu",
                                 tie_embeddings=False)
    hf.save_pretrained(directory / MODEL, config, drawn_params(config, seed=3, std=0.4), bpe_tokenizer(320),
                       eos_token_id=0)
    (directory / "chat.jinja").write_text(TEMPLATE)
    return ["--hf", str(directory / MODEL), "--chat-template", str(directory / "chat.jinja")]


def http(server, path, *, key: str | None, method="GET", body: bytes | None = None, timeout=30):
    """(status, parsed JSON or text) of a raw request, with `key` as the bearer token (None: none)."""
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(server.url + path, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            status, text = response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        status, text = err.code, err.read().decode()
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


def metric(server, name: str, key: str | None) -> float:
    """A sample's value from /metrics (`name` with its labels, as Prometheus writes it); 0 if absent."""
    _, text = http(server, "/metrics", key=key)
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0
