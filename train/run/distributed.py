"""One run over several processes (hosts): `jax.distributed` joins them into one SPMD program.

Every process is started with the same flags and `--out-dir`, plus its own
`--process-id`; they meet at `--coordinator HOST:PORT` (process 0 serves it, on that
address only: neither the rendezvous nor JAX's coordination service listens on other
interfaces). They first meet there through a plain TCP handshake (`rendezvous`): each
process says hello with its process count, its id and the settings every process must
share (for tiny_lm: the whole experiment config and the mesh), process 0 checks each
hello against its own as it comes, and then tells every process present either to go or
why not. So processes started with different flags, a process id given twice, a process
that cannot reach the coordinator, or a coordinator whose peers do not come all fail in
one line naming the process, the flag and both values - at once, or after
`--join-timeout` seconds for a missing process (JAX's own coordination client aborts
the process with a stack trace instead). A busy port or an address that is not this
machine's is one line too.

The handshake's messages are a 4-byte big-endian length and then that many bytes of a
UTF-8 JSON object tagged with `PROTOCOL`: `hello` from each process 1..N-1, `go` or
`stop` (with the error line) from process 0. A connection that sends anything else, or
nothing within `HELLO_TIMEOUT_S`, is a stranger: process 0 drops it and keeps waiting.

After `join`, `jax.devices()` lists every process's devices, the run's mesh
spans them all, and each jitted step runs on all of them at once; on a CPU the
collectives between processes go through JAX's gloo implementation. Only
process 0 prints, plots, writes the metrics and holds the run directory's lock
(`is_main`); checkpoints are written and read by all of them (orbax).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import re
import socket
import struct
import time
from typing import Any, Iterable, Mapping

import jax
import numpy as np
from flax.traverse_util import flatten_dict
from jax.experimental import multihost_utils

JOIN_TIMEOUT_S = 60  # how long a process waits for all the others at the coordinator
HELLO_TIMEOUT_S = 5.0  # a process says hello as soon as it connects; a silent connection is a stranger
MAX_MESSAGE_BYTES = 1 << 20  # a hello holds a config (a few KB); a larger length prefix is garbage
PROTOCOL = "jaxattn-rendezvous/1"
SAME_FLAGS = "start every process with the same flags"


class DistributedError(RuntimeError):
    """The processes could not be joined (coordinator unreachable, a process missing, a disagreement)."""


class _NotAMessage(Exception):
    """What came on a connection is not a message of this protocol; str() says what it was."""


class _Silent(_NotAMessage):
    """Nothing (or only part of a message) came before the deadline."""


class _HungUp(_NotAMessage):
    """The other side closed or reset the connection."""


@dataclasses.dataclass(frozen=True)
class Cluster:
    """Where this process stands: `--coordinator HOST:PORT --num-processes N --process-id I`."""

    coordinator: str
    num_processes: int
    process_id: int
    timeout_s: int = JOIN_TIMEOUT_S

    def __post_init__(self):
        if not re.fullmatch(r"[\w.\-]+:\d{1,5}|\[[0-9a-fA-F:]+\]:\d{1,5}", self.coordinator or ""):
            raise ValueError(f"--coordinator must be HOST:PORT (e.g. 127.0.0.1:8476), got {self.coordinator!r}")
        if not 1 <= self.host_port[1] <= 65535:
            raise ValueError(f"--coordinator {self.coordinator}: the port must be in [1, 65535]")
        if self.num_processes < 1:
            raise ValueError(f"--num-processes must be at least 1, got {self.num_processes}")
        if not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"--process-id must be in [0, {self.num_processes}), got {self.process_id}")
        if self.timeout_s < 1:
            raise ValueError(f"--join-timeout must be at least 1 second, got {self.timeout_s}")

    @property
    def host_port(self) -> tuple[str, int]:
        host, port = self.coordinator.rsplit(":", 1)
        return host.strip("[]"), int(port)


def _remaining(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())


# ----------------------------------------------------------------------------- messages

def _send(conn: socket.socket, kind: str, **fields: Any) -> None:
    data = json.dumps({"protocol": PROTOCOL, "kind": kind, **fields}).encode()
    conn.sendall(struct.pack(">I", len(data)) + data)


def _recv_exact(conn: socket.socket, size: int, deadline: float) -> bytes:
    """`size` bytes from `conn` by `deadline`: _Silent or _HungUp otherwise."""
    data = b""
    while len(data) < size:
        conn.settimeout(_remaining(deadline) or 1e-3)
        try:
            chunk = conn.recv(size - len(data))
        except TimeoutError:
            raise _Silent("no complete message in time") from None
        except OSError as err:
            raise _HungUp(err.strerror or type(err).__name__) from None
        if not chunk:
            raise _HungUp("the connection was closed")
        data += chunk
    return data


def _recv(conn: socket.socket, deadline: float, kinds: Iterable[str]) -> dict[str, Any]:
    """The next message on `conn`, one of `kinds`, by `deadline`; _NotAMessage for anything else."""
    size = struct.unpack(">I", _recv_exact(conn, 4, deadline))[0]
    if size > MAX_MESSAGE_BYTES:
        raise _NotAMessage(f"a length prefix of {size} bytes")
    try:
        message = json.loads(_recv_exact(conn, size, deadline))
    except ValueError:  # not UTF-8, or not JSON
        raise _NotAMessage("not JSON") from None
    if not isinstance(message, dict) or message.get("protocol") != PROTOCOL or message.get("kind") not in kinds:
        raise _NotAMessage(f"not a {'/'.join(kinds)} message of {PROTOCOL}")
    return message


def _read_hello(conn: socket.socket, deadline: float) -> dict[str, Any] | None:
    """A process's hello, or None from a stranger (garbage, a hang-up, silence past HELLO_TIMEOUT_S)."""
    try:
        hello = _recv(conn, min(deadline, time.monotonic() + HELLO_TIMEOUT_S), ["hello"])
    except _NotAMessage:
        return None
    settings = hello.get("settings")
    valid = (type(hello.get("num_processes")) is int and type(hello.get("process_id")) is int
             and isinstance(settings, dict) and all(isinstance(v, str) for v in settings.values()))
    return hello if valid else None


def _stop(conns: Iterable[socket.socket], why: str) -> None:
    """Tells each process on `conns` to stop with the line `why` (best effort: it may be gone)."""
    for conn in conns:
        with conn:
            try:
                _send(conn, "stop", error=why)
            except OSError:
                pass


# ----------------------------------------------------------------------------- process 0

def _listen(cluster: Cluster) -> socket.socket:
    """A server socket on the coordinator's own address (not all interfaces); DistributedError naming
    `--coordinator` where that address is not this machine's or its port is taken."""
    host, port = cluster.host_port
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        return socket.create_server(address, family=family)
    except socket.gaierror as err:
        raise DistributedError(
            f"--coordinator {cluster.coordinator}: cannot resolve {host} ({err.strerror})") from None
    except OSError as err:
        raise DistributedError(f"--coordinator {cluster.coordinator}: {_bind_problem(err, host, port)}") from None


def _bind_problem(err: OSError, host: str, port: int) -> str:
    if err.errno == errno.EADDRINUSE:
        return (f"port {port} is already in use on {host}: choose another --coordinator port, or stop what "
                "holds it (a previous run still running, or another process started with --process-id 0)")
    if err.errno == errno.EADDRNOTAVAIL:
        return f"process 0 must run on the machine that has that address ({host} is not an address of this one)"
    return f"process 0 cannot listen there ({err.strerror})"


def _missing(cluster: Cluster, joined: Iterable[int]) -> str:
    missing = sorted(set(range(1, cluster.num_processes)) - set(joined))
    return (f"process(es) {missing} of {cluster.num_processes} did not reach the coordinator at "
            f"{cluster.coordinator} within {cluster.timeout_s}s")


def _next_hello(server: socket.socket, cluster: Cluster, joined: Iterable[int],
                deadline: float) -> tuple[socket.socket, dict[str, Any]]:
    """The next connection that says hello, and its hello (strangers are dropped); DistributedError
    naming the missing processes at `deadline`."""
    while True:
        server.settimeout(_remaining(deadline) or 1e-3)
        try:
            conn, _ = server.accept()
        except OSError:  # a timeout, or a connection reset before it was accepted
            if not _remaining(deadline):
                raise DistributedError(_missing(cluster, joined)) from None
            continue
        hello = _read_hello(conn, deadline)
        if hello is not None:
            return conn, hello
        conn.close()


def _disagreement(hello: dict[str, Any], cluster: Cluster, settings: Mapping[str, str],
                  joined: Iterable[int]) -> str | None:
    """Where the process that sent `hello` disagrees with process 0, as the line every process stops
    with; None where it agrees. `settings` (both sides) map names to JSON text."""
    who, count, theirs = hello["process_id"], hello["num_processes"], hello["settings"]
    if count != cluster.num_processes:
        return (f"process {who} was started with --num-processes {count}, process 0 with "
                f"{cluster.num_processes}: {SAME_FLAGS}")
    if who == 0 or who in joined:
        return f"two processes were started with --process-id {who}: give each process its own --process-id"
    if not 0 < who < count:
        return f"a process was started with --process-id {who}, out of [0, {count}) for --num-processes {count}"
    for key in sorted(set(settings) | set(theirs)):
        if settings.get(key) != theirs.get(key):
            return (f"process {who} was started with {key}={theirs.get(key, '(none)')}, process 0 with "
                    f"{settings.get(key, '(none)')}: {SAME_FLAGS}")
    return None


def _go(conns: Iterable[socket.socket], deadline: float) -> None:
    """Tells every process to go, then waits for each to hang up first, so that the port is free for
    JAX's service at once (one that is gone already will fail to join JAX in its own line)."""
    for conn in conns:
        try:
            _send(conn, "go")
        except OSError:
            pass
    for conn in conns:
        with conn:
            try:
                _recv_exact(conn, 1, time.monotonic() + HELLO_TIMEOUT_S)
            except _NotAMessage:
                pass


def _serve(cluster: Cluster, settings: Mapping[str, str], deadline: float) -> None:
    """Process 0: check each hello against its own as it comes, then tell every process to go; on a
    disagreement or a missing process, tell every process present why and raise DistributedError."""
    joined: dict[int, socket.socket] = {}
    with _listen(cluster) as server:
        try:
            while len(joined) < cluster.num_processes - 1:
                conn, hello = _next_hello(server, cluster, joined, deadline)
                problem = _disagreement(hello, cluster, settings, joined)
                if problem is not None:
                    _stop([conn], problem)
                    raise DistributedError(problem)
                joined[hello["process_id"]] = conn
        except DistributedError as err:
            _stop(joined.values(), str(err))
            raise
    _go(list(joined.values()), deadline)


# ----------------------------------------------------------------------------- processes 1..N-1

def _connect(cluster: Cluster, deadline: float) -> socket.socket:
    """A connection to the coordinator, retried until `deadline` (process 0 may not be up yet)."""
    while True:
        try:
            return socket.create_connection(cluster.host_port, timeout=_remaining(deadline) or 1e-3)
        except OSError:
            if not _remaining(deadline):
                raise DistributedError(
                    f"process {cluster.process_id} could not reach the coordinator at {cluster.coordinator} "
                    f"within {cluster.timeout_s}s (is process 0 running with the same --coordinator?)") from None
            time.sleep(0.2)


def _no_go(cluster: Cluster, why: _NotAMessage) -> str:
    """The line for a process whose hello got no `go` or `stop` from the coordinator."""
    where = f"process {cluster.process_id}: the coordinator at {cluster.coordinator}"
    if isinstance(why, _Silent):
        return f"{where} did not start the run within {cluster.timeout_s}s (a process is missing)"
    if isinstance(why, _HungUp):
        return f"{where} hung up before the run started ({why}): see process 0's error"
    return f"{where} answered with {why}: is another program using that port?"


def _reach(cluster: Cluster, settings: Mapping[str, str], deadline: float) -> None:
    """Processes 1..N-1: say hello to process 0 and wait for its go; DistributedError with its line
    where it says stop."""
    with _connect(cluster, deadline) as conn:
        try:
            _send(conn, "hello", num_processes=cluster.num_processes, process_id=cluster.process_id,
                  settings=dict(settings))
            reply = _recv(conn, deadline, ["go", "stop"])
        except OSError as err:  # the send failed: process 0 hung up at once
            raise DistributedError(_no_go(cluster, _HungUp(err.strerror or type(err).__name__))) from None
        except _NotAMessage as why:
            raise DistributedError(_no_go(cluster, why)) from None
    if reply["kind"] == "stop":
        raise DistributedError(str(reply.get("error") or "process 0 stopped the run"))


def rendezvous(cluster: Cluster, settings: Mapping[str, Any] | None = None) -> None:
    """Returns once every process of `cluster` is present and agrees with process 0 on
    `--num-processes`, has its own `--process-id` and the same `settings` (a mapping of
    JSON-serialisable values, nested mappings compared key by key under dotted names).

    Raises:
      DistributedError: in every process present, with the same line, for the first disagreement;
        in process 0 (and those present) for a process missing after `cluster.timeout_s`; in a
        process that cannot reach the coordinator by then; in process 0 where the coordinator's
        address is not this machine's or its port is taken.
    """
    deadline = time.monotonic() + cluster.timeout_s
    flat = {key: json.dumps(value, sort_keys=True, default=str)
            for key, value in flatten_dict(dict(settings or {}), sep=".").items()}
    if cluster.process_id == 0:
        _serve(cluster, flat, deadline)
    else:
        _reach(cluster, flat, deadline)


def join(cluster: Cluster, settings: Mapping[str, Any] | None = None) -> None:
    """`rendezvous(cluster, settings)`, then `jax.distributed.initialize` (its service bound to the
    coordinator's address only) with gloo collectives on a CPU; call before JAX starts.

    Raises:
      DistributedError: see `rendezvous`; or JAX could not join the processes within `cluster.timeout_s`.
    """
    rendezvous(cluster, settings)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(coordinator_address=cluster.coordinator, num_processes=cluster.num_processes,
                                   process_id=cluster.process_id, initialization_timeout=cluster.timeout_s,
                                   coordinator_bind_address=cluster.coordinator)
    except Exception as err:  # JAX raises assorted runtime errors for a missing peer
        first = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
        raise DistributedError(
            f"process {cluster.process_id} of {cluster.num_processes} could not join the coordinator at "
            f"{cluster.coordinator} within {cluster.timeout_s}s (is process 0 running with the same "
            f"--coordinator and --num-processes?): {first}") from None


def is_main() -> bool:
    """True in the process that prints and writes (process 0; the only one without `join`)."""
    return jax.process_index() == 0


def agree(ok: bool, what: str) -> None:
    """Every process learns whether process 0 managed `what`: the others raise DistributedError
    where it did not, rather than waiting for it in a collective. One process: nothing to do."""
    if jax.process_count() == 1:
        return
    if not bool(multihost_utils.broadcast_one_to_all(np.asarray(ok))):
        if not is_main():
            raise DistributedError(f"process 0 could not {what}; see its error")
