"""One run over several processes (hosts): `jax.distributed` joins them into one SPMD program.

Every process is started with the same flags and `--out-dir`, plus its own
`--process-id`; they meet at `--coordinator HOST:PORT` (process 0 serves it).
They first meet there through a plain TCP handshake (`rendezvous`), so that a
process that cannot reach the coordinator, or a coordinator whose peers do not
come, fails after `--join-timeout` seconds with one line naming what is missing
(JAX's own coordination client aborts the process with a stack trace instead).
After `join`, `jax.devices()` lists every process's devices, the run's mesh
spans them all, and each jitted step runs on all of them at once; on a CPU the
collectives between processes go through JAX's gloo implementation. Only
process 0 prints, plots, writes the metrics and holds the run directory's lock
(`is_main`); checkpoints are written and read by all of them (orbax).
"""

from __future__ import annotations

import dataclasses
import re
import socket
import time

import jax
import numpy as np
from jax.experimental import multihost_utils

JOIN_TIMEOUT_S = 60  # how long a process waits for all the others at the coordinator


class DistributedError(RuntimeError):
    """The processes could not be joined (coordinator unreachable, a process missing)."""


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


def _serve_rendezvous(cluster: Cluster, deadline: float) -> None:
    """Process 0: wait for every other process to say hello, then tell them all to go."""
    peers: dict[int, socket.socket] = {}
    with socket.create_server(("", cluster.host_port[1])) as server:
        while len(peers) < cluster.num_processes - 1:
            server.settimeout(_remaining(deadline) or 1e-3)
            try:
                conn, _ = server.accept()
                conn.settimeout(_remaining(deadline) or 1e-3)
                peers[int(conn.recv(16).decode())] = conn
            except (socket.timeout, ValueError):
                if not _remaining(deadline):
                    missing = sorted(set(range(1, cluster.num_processes)) - set(peers))
                    for conn in peers.values():
                        conn.close()
                    raise DistributedError(f"process(es) {missing} of {cluster.num_processes} did not reach "
                                           f"the coordinator at {cluster.coordinator} within {cluster.timeout_s}s")
        for conn in peers.values():
            conn.sendall(b"go")
        for conn in peers.values():  # they close first, so the port is free for JAX's service at once
            conn.recv(1)
            conn.close()


def _reach_rendezvous(cluster: Cluster, deadline: float) -> None:
    """Processes 1..N-1: say hello to process 0 (retrying until the deadline) and wait for its go."""
    while True:
        try:
            conn = socket.create_connection(cluster.host_port, timeout=_remaining(deadline) or 1e-3)
            break
        except OSError:
            if not _remaining(deadline):
                raise DistributedError(
                    f"process {cluster.process_id} could not reach the coordinator at {cluster.coordinator} "
                    f"within {cluster.timeout_s}s (is process 0 running with the same --coordinator?)") from None
            time.sleep(0.2)
    with conn:
        conn.sendall(str(cluster.process_id).encode())
        conn.settimeout(_remaining(deadline) or 1e-3)
        try:
            go = conn.recv(2)
        except socket.timeout:
            go = b""
        if go != b"go":
            raise DistributedError(f"process {cluster.process_id}: the coordinator at {cluster.coordinator} did "
                                   f"not start the run within {cluster.timeout_s}s (a process is missing)")


def rendezvous(cluster: Cluster) -> None:
    """Every process of `cluster` present within its timeout, or DistributedError naming who is not."""
    deadline = time.monotonic() + cluster.timeout_s
    if cluster.process_id == 0:
        _serve_rendezvous(cluster, deadline)
    else:
        _reach_rendezvous(cluster, deadline)


def join(cluster: Cluster) -> None:
    """`rendezvous`, then `jax.distributed.initialize` with gloo collectives on a CPU; call before
    JAX starts.

    Raises:
      DistributedError: the coordinator or a process did not answer within `cluster.timeout_s`.
    """
    if cluster.num_processes > 1:
        rendezvous(cluster)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(coordinator_address=cluster.coordinator, num_processes=cluster.num_processes,
                                   process_id=cluster.process_id, initialization_timeout=cluster.timeout_s)
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
