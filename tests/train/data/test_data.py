import hashlib
import http.server
import os
import threading

import pytest

from train.data import corpus as data
from train.data.errors import DataError


@pytest.fixture
def no_shakespeare_env(monkeypatch, tmp_path):
    """No env var, an empty cache dir: resolution has to download."""
    monkeypatch.delenv(data.ENV_PATH, raising=False)
    monkeypatch.delenv(data.ENV_URL, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "jaxattn" / data.SHAKESPEARE_FILENAME


@pytest.fixture
def http_server(tmp_path):
    """Serves tmp_path/www on 127.0.0.1 at an ephemeral port."""
    root = tmp_path / "www"
    root.mkdir()

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(root), **kwargs)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_explicit_path_wins(tmp_path, monkeypatch):
    f = tmp_path / "other.txt"
    f.write_text("abcabc")
    monkeypatch.setenv(data.ENV_PATH, str(tmp_path / "missing.txt"))
    assert data.resolve_data_path(f) == f


def test_env_var_then_cache(tmp_path, no_shakespeare_env, monkeypatch):
    env_file = tmp_path / "env.txt"
    env_file.write_text("x")
    monkeypatch.setenv(data.ENV_PATH, str(env_file))
    assert data.resolve_data_path() == env_file
    monkeypatch.delenv(data.ENV_PATH)
    no_shakespeare_env.parent.mkdir(parents=True)
    no_shakespeare_env.write_text("cached")
    assert data.resolve_data_path() == no_shakespeare_env


def test_bad_path_is_a_clear_error(tmp_path, monkeypatch):
    with pytest.raises(DataError, match="does not exist"):
        data.resolve_data_path(tmp_path / "nope.txt")
    with pytest.raises(DataError, match="is not a file"):
        data.resolve_data_path(tmp_path)
    monkeypatch.setenv(data.ENV_PATH, str(tmp_path / "gone.txt"))
    with pytest.raises(DataError, match=r"\$JAXATTN_SHAKESPEARE"):
        data.resolve_data_path()


def test_empty_and_non_utf8_files(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(DataError, match="is empty"):
        data.load_corpus(empty)
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"\xff\xfe\x00abc")
    with pytest.raises(DataError, match="not UTF-8"):
        data.load_corpus(binary)
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("ab")
    with pytest.raises(DataError, match="too short"):
        data.load_corpus(tiny)


def test_split_is_first_90_last_10(tmp_path):
    f = tmp_path / "t.txt"
    text = "".join(chr(ord("a") + i % 26) for i in range(1000))
    f.write_text(text)
    corpus = data.load_corpus(f, tokenizer="char")
    assert len(corpus.train) == 900 and len(corpus.val) == 100
    assert corpus.tokenizer.decode(corpus.val) == text[900:]
    byte_corpus = data.load_corpus(f, tokenizer="byte")
    assert byte_corpus.tokenizer.vocab_size == 256


def test_download_from_local_server(http_server, no_shakespeare_env, monkeypatch):
    root, base = http_server
    payload = ("First Citizen:\nBefore we proceed any further, hear me speak.\n" * 200).encode()
    (root / "input.txt").write_bytes(payload)
    monkeypatch.setattr(data, "SHAKESPEARE_SHA256", hashlib.sha256(payload).hexdigest())
    monkeypatch.setenv(data.ENV_URL, base + "/input.txt")
    path = data.resolve_data_path()
    assert path == no_shakespeare_env and path.read_bytes() == payload
    assert os.listdir(path.parent) == [path.name]  # no temp file left
    assert data.resolve_data_path() == path  # second time: the cache, no server needed


def test_checksum_mismatch_leaves_no_file(http_server, tmp_path):
    root, base = http_server
    (root / "input.txt").write_bytes(b"not shakespeare")
    dest = tmp_path / "dl" / "tinyshakespeare.txt"
    with pytest.raises(DataError, match="checksum mismatch"):
        data.download(base + "/input.txt", dest, data.SHAKESPEARE_SHA256, progress=False)
    assert not dest.exists() and os.listdir(dest.parent) == []


def test_offline_message_says_where_to_put_the_file(http_server, no_shakespeare_env, monkeypatch):
    _, base = http_server
    monkeypatch.setenv(data.ENV_URL, base + "/missing.txt")  # 404, like being offline
    with pytest.raises(DataError) as err:
        data.resolve_data_path()
    message = str(err.value)
    assert str(no_shakespeare_env) in message and data.ENV_PATH in message and "--data" in message
    assert not no_shakespeare_env.exists()
    assert os.listdir(no_shakespeare_env.parent) == []


