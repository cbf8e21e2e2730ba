"""The server's process parts: its socket, bound before the model loads, and uvicorn draining on a signal.

* `listen_socket(host, port)`: the bound, listening socket, or a `ListenError` (an OSError) in one line
  at once: a port in use or an address that is not this machine's fails before minutes of compiling.
* `DrainingServer`: uvicorn, whose SIGTERM or SIGINT drains the engine first (new requests get a 503,
  running ones get `drain_seconds` to finish, then are cancelled) and exits 0; a second signal exits at
  once. It prints its ready line once it listens.
* `HeadersTimeout`: uvicorn's HTTP/1.1 protocol, closing a connection whose request line and headers have
  not all arrived `HEADERS_SECONDS` after it opened (or after its last answer): uvicorn waits for them
  forever, so connections that send part of their headers and stop would use up the server's.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import time
from typing import Callable

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from jaxattn.serving.api.runner import EngineRunner

log = logging.getLogger("jaxattn.serving.api")


class ListenError(OSError):
    """The address cannot be listened on (its message is the one line a program prints)."""


def listen_socket(host: str, port: int) -> socket.socket:
    """A bound TCP socket for `host:port`, before the model loads: a port in use or an address that is
    not this machine's fails in one line at once, not after minutes of compiling."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as err:
        raise ListenError(f"cannot listen on {host}:{port}: {err.strerror}") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)  # claimed now: callers queue in the backlog until the engine is compiled
    except OSError as err:
        sock.close()
        why = {errno.EADDRINUSE: "the port is in use", errno.EADDRNOTAVAIL: "the address is not this machine's"}
        raise ListenError(f"cannot listen on {host}:{port}: {why.get(err.errno, err.strerror)}") from None
    return sock


HEADERS_SECONDS = 10.0  # Node's and nginx's bounds are 60 s; a client's headers arrive in milliseconds


class HeadersTimeout(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's headers (see the module docstring);
    `seconds` is the class attribute (`headers_timeout(seconds)` makes one with another)."""

    seconds = HEADERS_SECONDS

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._headers_deadline = self.loop.call_later(self.seconds, self._headers_late)

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not None and not self.cycle.response_complete:  # the headers are in: a request runs
            self._headers_deadline.cancel()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():  # kept alive: the next request's headers have a deadline too
            self._headers_deadline.cancel()
            self._headers_deadline = self.loop.call_later(self.seconds, self._headers_late)

    def connection_lost(self, exc) -> None:
        self._headers_deadline.cancel()
        super().connection_lost(exc)

    def _headers_late(self) -> None:
        if (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing():
            log.info("closing a connection whose request headers did not arrive within %.0f s", self.seconds)
            if self.conn.our_state not in (h11.ERROR, h11.CLOSED, h11.MUST_CLOSE):
                self.conn.send(h11.ConnectionClosed())
            self.transport.close()


def headers_timeout(seconds: float) -> type[HeadersTimeout]:
    """`HeadersTimeout` with a deadline of `seconds` (uvicorn.Config's `http=` takes the class)."""
    return type("HeadersTimeout", (HeadersTimeout,), {"seconds": seconds})


class DrainingServer(uvicorn.Server):
    """uvicorn, with SIGTERM and SIGINT draining the engine first (see the module docstring), and
    `ready_line()` printed on stdout once it listens."""

    def __init__(self, config: uvicorn.Config, runner: EngineRunner, drain_seconds: float,
                 ready_line: Callable[[], str]):
        super().__init__(config)
        self.runner, self.drain_seconds, self.ready_line = runner, drain_seconds, ready_line
        self.signalled = None

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)
        if self.started:
            print(self.ready_line(), flush=True)

    def handle_exit(self, sig, frame) -> None:
        # Not uvicorn's: it would re-raise the signal after shutting down (exit -15, not 0).
        if self.signalled is not None:  # a second signal: at once
            self.should_exit = self.force_exit = True
            return
        self.signalled = sig
        self.runner.drain()
        self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self._drain()))

    async def _drain(self) -> None:
        log.info("draining: new requests get 503; running ones have %.0f s to finish", self.drain_seconds)
        deadline = time.monotonic() + self.drain_seconds
        while self.runner.busy and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.runner.busy:
            log.info("cancelling the requests still running")
            self.runner.cancel_all()
            until = time.monotonic() + 10
            while self.runner.busy and time.monotonic() < until:
                await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)  # the streams' last chunks go out
        self.should_exit = True
