"""The rendezvous before `jax.distributed`: processes that disagree, a busy port, strangers, the bind address.

The failures that happen in a process run real `python -m train.tiny_lm` processes (they stop
before JAX starts training, in seconds); the protocol's cases run `rendezvous` in threads.
"""

import contextlib
import json
import os
import socket
import struct
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from train.run import distributed
from train.run.distributed import Cluster, DistributedError

ROOT = Path(__file__).resolve().parents[3]
ENV = {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}, "PYTHONPATH": str(ROOT)}
SAME = "start every process with the same flags"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------- real processes

def _start(tmp_path: Path, port: int, *flags: str) -> subprocess.Popen:
    text = tmp_path / "text.txt"
    text.write_text("abcdefghijklmnopqrstuvwxyz\n" * 40)
    command = [sys.executable, "-m", "train.tiny_lm", "--quiet", "--data", str(text), "--out-dir",
               str(tmp_path / "run"), "--coordinator", f"127.0.0.1:{port}", *flags]
    return subprocess.Popen(command, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _error_line(process: subprocess.Popen) -> str:
    """The one line a failed process wrote to stderr (exit 1, no traceback)."""
    try:
        _, err = process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        raise
    assert process.returncode == 1 and "Traceback" not in err, err[-3000:]
    assert len(err.strip().splitlines()) == 1, err[-3000:]
    return err.strip()


def _two(tmp_path: Path, flags0: list[str], flags1: list[str]) -> tuple[list[str], float]:
    """Processes 0 and 1 (join timeout 30 s) with their own extra flags: their error lines and how long it took."""
    port, start = _free_port(), time.monotonic()
    common = ["--join-timeout", "30", "--set", "train.max_iters=2", "train.plot=false"]
    processes = [_start(tmp_path, port, *common, "--process-id", str(i), *flags)
                 for i, flags in enumerate([flags0, flags1])]
    return [_error_line(p) for p in processes], time.monotonic() - start


@pytest.mark.slow
def test_processes_started_with_different_process_counts_both_stop_at_once_in_one_line(tmp_path):
    lines, took = _two(tmp_path, ["--num-processes", "2"], ["--num-processes", "3"])
    assert lines == [f"error: process 1 was started with --num-processes 3, process 0 with 2: {SAME}"] * 2
    assert took < 20  # not the 30 s join timeout


@pytest.mark.slow
def test_processes_started_with_different_meshes_both_stop_at_once_in_one_line(tmp_path):
    lines, took = _two(tmp_path, ["--num-processes", "2", "--mesh", "data:2"],
                       ["--num-processes", "2", "--mesh", "data:1,fsdp:2"])
    assert lines == [f'error: process 1 was started with runtime.mesh="data:1,fsdp:2,tensor:1", process 0 with '
                     f'"data:2,fsdp:1,tensor:1": {SAME}'] * 2
    assert took < 20


@pytest.mark.slow
def test_a_busy_coordinator_port_is_one_line(tmp_path):
    port = _free_port()
    with socket.create_server(("127.0.0.1", port)):  # what a previous run still running would hold
        line = _error_line(_start(tmp_path, port, "--num-processes", "2", "--process-id", "0"))
    assert line == (f"error: --coordinator 127.0.0.1:{port}: port {port} is already in use on 127.0.0.1: choose "
                    "another --coordinator port, or stop what holds it (a previous run still running, or another "
                    "process started with --process-id 0)")


# ------------------------------------------------------------------------- the protocol, in threads

def _attempt(cluster: Cluster, settings: dict) -> str | None:
    try:
        distributed.rendezvous(cluster, settings)
    except DistributedError as err:
        return str(err)
    return None


def _all(port: int, members: list[tuple[int, int, dict]], timeout_s: int = 10) -> list[str | None]:
    """`rendezvous` for each (num_processes, process_id, settings) in its own thread: None or its error."""
    with ThreadPoolExecutor(len(members)) as pool:
        futures = [pool.submit(_attempt, Cluster(f"127.0.0.1:{port}", n, i, timeout_s), settings)
                   for n, i, settings in members]
        return [f.result(timeout=30) for f in futures]


def _until_listening(port: int) -> None:
    """Waits for process 0's socket; the probe hangs up at once, so process 0 drops it as a stranger."""
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except ConnectionRefusedError:
            time.sleep(0.02)
    raise AssertionError("process 0 never listened")


def _dropped(stranger: socket.socket) -> bool:
    """Process 0 closed the connection without an answer (a reset where it left bytes unread)."""
    try:
        return stranger.recv(100) == b""
    except ConnectionResetError:
        return True


def test_processes_that_agree_go_and_nested_settings_are_compared_by_dotted_name():
    config = {"model": {"d_model": 32, "mla": {"rank": 4}}, "runtime": {"mesh": "data:2"}}
    assert _all(_free_port(), [(3, i, config) for i in range(3)]) == [None] * 3
    other = {**config, "model": {"d_model": 32, "mla": {"rank": 8}}}
    assert _all(_free_port(), [(2, 0, config), (2, 1, other)]) == [
        f"process 1 was started with model.mla.rank=8, process 0 with 4: {SAME}"] * 2


def test_a_disagreement_stops_a_process_that_agreed_and_was_waiting():
    """Process 1 agrees and waits (its timeout is 10 s); process 2, started a second later (a process
    that came after process 0 had stopped could not be told), differs: all three stop at once."""
    port, start = _free_port(), time.monotonic()
    with ThreadPoolExecutor(3) as pool:
        first = [pool.submit(_attempt, Cluster(f"127.0.0.1:{port}", 3, i, 10), {"lr": 1e-3}) for i in (0, 1)]
        time.sleep(1.0)
        last = pool.submit(_attempt, Cluster(f"127.0.0.1:{port}", 3, 2, 10), {"lr": 2e-3})
        lines = [f.result(timeout=30) for f in [*first, last]]
    assert lines == [f"process 2 was started with lr=0.002, process 0 with 0.001: {SAME}"] * 3
    assert time.monotonic() - start < 6


def test_a_process_id_given_twice_stops_every_process():
    lines = _all(_free_port(), [(3, 0, {}), (3, 1, {}), (3, 1, {})])
    assert lines == ["two processes were started with --process-id 1: give each process its own --process-id"] * 3


def test_a_missing_process_is_named_to_the_processes_present_within_process_0s_timeout():
    port = _free_port()
    with ThreadPoolExecutor(2) as pool:
        waiting = pool.submit(_attempt, Cluster(f"127.0.0.1:{port}", 3, 1, 30), {})
        coordinator = pool.submit(_attempt, Cluster(f"127.0.0.1:{port}", 3, 0, 1), {})
        line = f"process(es) [2] of 3 did not reach the coordinator at 127.0.0.1:{port} within 1s"
        assert coordinator.result(timeout=10) == line and waiting.result(timeout=10) == line


@pytest.mark.parametrize("garbage", [
    b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",  # a length prefix of ~1.2 GB
    struct.pack(">I", 5) + b"\xff\xfe\x00ab",  # not UTF-8 JSON
    struct.pack(">I", 2) + b"[]",  # JSON, not a message
    b"\x00\x00",  # cut short, then a hang-up
], ids=["http", "binary", "json", "short"])
def test_a_stranger_sending_garbage_is_dropped_and_process_0_keeps_waiting(garbage):
    port = _free_port()
    with ThreadPoolExecutor(2) as pool:
        coordinator = pool.submit(_attempt, Cluster(f"127.0.0.1:{port}", 2, 0, 10), {"a": 1})
        _until_listening(port)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as stranger:
            stranger.sendall(garbage)
            with contextlib.suppress(OSError):  # already reset where process 0 left bytes unread
                stranger.shutdown(socket.SHUT_WR)  # no more to come
            assert _dropped(stranger)
        assert _attempt(Cluster(f"127.0.0.1:{port}", 2, 1, 10), {"a": 1}) is None
        assert coordinator.result(timeout=10) is None


def test_a_hello_with_the_wrong_types_is_a_stranger_too():
    port = _free_port()
    hello = json.dumps({"protocol": distributed.PROTOCOL, "kind": "hello", "num_processes": "2",
                        "process_id": 1, "settings": {}}).encode()
    with ThreadPoolExecutor(1) as pool:
        coordinator = pool.submit(_attempt, Cluster(f"127.0.0.1:{port}", 2, 0, 10), {})
        _until_listening(port)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as stranger:
            stranger.sendall(struct.pack(">I", len(hello)) + hello)
            assert _dropped(stranger)
        assert _attempt(Cluster(f"127.0.0.1:{port}", 2, 1, 10), {}) is None
        assert coordinator.result(timeout=10) is None


def test_a_silent_stranger_is_dropped_after_the_hello_timeout(monkeypatch):
    monkeypatch.setattr(distributed, "HELLO_TIMEOUT_S", 0.2)
    port = _free_port()
    with ThreadPoolExecutor(1) as pool:
        coordinator = pool.submit(_attempt, Cluster(f"127.0.0.1:{port}", 2, 0, 10), {})
        _until_listening(port)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as stranger:
            assert _dropped(stranger)  # waited for, then dropped
        assert _attempt(Cluster(f"127.0.0.1:{port}", 2, 1, 10), {}) is None
        assert coordinator.result(timeout=10) is None


def test_the_rendezvous_listens_on_the_coordinators_address_only():
    """All of 127/8 is loopback on Linux: a server on all interfaces would answer at 127.0.0.2 too."""
    port = _free_port()
    with ThreadPoolExecutor(1) as pool:
        coordinator = pool.submit(_attempt, Cluster(f"127.0.0.1:{port}", 2, 0, 10), {})
        _until_listening(port)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.2", port), timeout=5)
        assert _attempt(Cluster(f"127.0.0.1:{port}", 2, 1, 10), {}) is None
        assert coordinator.result(timeout=10) is None


def test_a_coordinator_address_of_another_machine_is_one_line():
    line = _attempt(Cluster("192.0.2.1:8476", 2, 0, 5), {})  # TEST-NET-1: never this machine's
    assert line == ("--coordinator 192.0.2.1:8476: process 0 must run on the machine that has that address "
                    "(192.0.2.1 is not an address of this one)")


def test_a_peer_answered_by_another_program_says_so_at_once():
    with socket.create_server(("127.0.0.1", 0)) as other:
        port = other.getsockname()[1]
        with ThreadPoolExecutor(1) as pool:
            peer = pool.submit(_attempt, Cluster(f"127.0.0.1:{port}", 2, 1, 30), {})
            conn, _ = other.accept()
            with conn:
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
                assert peer.result(timeout=10) == (
                    f"process 1: the coordinator at 127.0.0.1:{port} answered with a length prefix of "
                    f"{struct.unpack('>I', b'HTTP')[0]} bytes: is another program using that port?")


def test_a_port_out_of_range_is_a_usage_error():
    with pytest.raises(ValueError, match=r"--coordinator 127.0.0.1:99999: the port must be in \[1, 65535\]"):
        Cluster("127.0.0.1:99999", 2, 0)
