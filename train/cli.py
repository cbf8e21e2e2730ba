"""How every program ends: one line on stderr and a documented exit code, never a traceback.

Exit codes (docs/training.md, "Resuming, and what is never lost"):

* 0: done.
* 1: a runtime failure: a file that cannot be read or written, a damaged checkpoint, a
  diverged run, a process that did not come. The line names the file, key or flag.
* 2: a usage error: a bad flag or config value. The line ends with a pointer to `--help`.
* 130: stopped by Ctrl-C (SIGINT) or SIGTERM, after keeping what was done; the line says what.

`ArgumentParser` reports usage errors in that one line (argparse prints its usage block
first). `guard(program, body)` runs a program and turns whatever escapes it into its line and
code. An exception that is none of the expected kinds is a bug: its line names the exception
and the file its traceback was written to (`JAXATTN_TRACEBACK=1` prints it instead).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from typing import Callable, Iterable, Iterator, NoReturn, TypeVar

T = TypeVar("T")
TRACEBACK_ENV = "JAXATTN_TRACEBACK"
EXIT_RUNTIME, EXIT_USAGE, EXIT_STOPPED = 1, 2, 130


class UsageError(ValueError):
    """The command line or config asks for something that cannot be done (exit 2)."""


class Stopped(Exception):
    """A program stopped by SIGINT or SIGTERM after keeping what it had done (exit 130).

    The message says what was kept and how to go on, e.g. "SIGINT at step 250: saved ...".
    """


class ArgumentParser(argparse.ArgumentParser):
    """argparse with usage errors as one `error:` line pointing at `--help`, raised as `UsageError`."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def one_line(text: str) -> str:
    """`text` with its lines joined by "; " (messages that list problems keep every item)."""
    return "; ".join(line.strip() for line in str(text).strip().splitlines() if line.strip())


def describe(err: BaseException) -> str:
    """An exception as one line: its message, or for an OSError the file and the system's reason."""
    if isinstance(err, OSError) and err.strerror:  # not "[Errno 13] Permission denied: 'x'"
        return f"{err.filename}: {err.strerror}" if err.filename else err.strerror
    return one_line(str(err)) or type(err).__name__


def _out_of_memory(err: BaseException) -> bool:
    return isinstance(err, MemoryError) or "RESOURCE_EXHAUSTED" in str(err)


def _save_traceback(program: str, err: BaseException) -> str | None:
    """Writes the traceback of `err` to a file in the temp directory; its path, or None if that failed."""
    name = f"jaxattn-{program.replace(' ', '-').replace('.', '-')}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.txt"
    path = os.path.join(tempfile.gettempdir(), name)
    try:
        with open(path, "w") as f:
            traceback.print_exception(err, file=f)
    except OSError:
        return None
    return path


def _bug(program: str, err: BaseException) -> str:
    """The line of an unexpected exception, its traceback kept in a file (or printed when asked)."""
    if os.environ.get(TRACEBACK_ENV):
        traceback.print_exception(err, file=sys.stderr)
        return f"unexpected {type(err).__name__} ({TRACEBACK_ENV} is set: its traceback is above)"
    where = _save_traceback(program, err)
    kept = f"; its traceback is in {where}" if where else ""
    return (f"unexpected {type(err).__name__}: {describe(err)[:400]} (a failure jaxattn does not "
            f"expect{kept}: please report it)")


@contextlib.contextmanager
def sigterm_as_interrupt():
    """SIGTERM raises KeyboardInterrupt like Ctrl-C, so both keep what was done (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class StopSignals:
    """While active, SIGINT and SIGTERM only ask the program to stop at its next safe point; a second
    one stops it at once (KeyboardInterrupt: what was not saved is lost), or, inside `deferred()`
    (a checkpoint being written), as soon as that block has finished. Only possible in the main
    thread; elsewhere signals keep their handlers."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.requested = None  # the signal's name once one arrived
        self._deferring = False  # inside `deferred()`
        self._pending = False  # a second signal arrived there

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """A block a second signal does not cut short: it stops the program (KeyboardInterrupt) when
        the block has finished. For writing a checkpoint: cut short, orbax's background threads
        would outlive the manager that owns them and print their errors after the program's last line."""
        self._deferring = True
        try:
            yield
        finally:
            self._deferring = False
        if self._pending:
            self._pending = False
            raise KeyboardInterrupt

    def __enter__(self) -> "StopSignals":
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        return self

    def until_requested(self, items: Iterable[T]) -> Iterator[T]:
        """The items of `items` until a signal has been requested (the item in hand when it came is the last)."""
        for item in items:
            yield item
            if self.requested:
                return

    def _handle(self, signum, frame) -> None:
        if self.requested is not None:
            if self._deferring:
                self._pending = True
                return
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _exit(code: int, line: str | None) -> NoReturn:
    if line is not None:
        print(line, file=sys.stderr, flush=True)
    sys.exit(code)


def guard(program: str, body: Callable[[], T], *, expected: tuple[type[BaseException], ...] = ()) -> T:
    """Runs `body()` and returns its value, or exits with one line and the documented code.

    Args:
      program: the command, e.g. "python -m train.sample" (the `--help` pointer, the traceback file).
      body: the program; it raises `UsageError` for usage, `Stopped` after a signal, one of
        `expected` (or an OSError) for a runtime failure.
      expected: the program's runtime error types: their message is the line.
    """
    try:
        with sigterm_as_interrupt():
            return body()
    except UsageError as err:
        _exit(EXIT_USAGE, f"error: {describe(err)} (see {program} --help)")
    except Stopped as stop:
        _exit(EXIT_STOPPED, f"stopped: {describe(stop)}")
    except KeyboardInterrupt:
        _exit(EXIT_STOPPED, f"stopped: interrupted before {program} had finished")
    except BrokenPipeError:  # `... | head`: the reader is gone, and so is the place to say so
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        _exit(EXIT_RUNTIME, None)
    except SystemExit:
        raise
    except Exception as err:  # noqa: BLE001: every failure ends in one line
        if _out_of_memory(err):
            _exit(EXIT_RUNTIME, f"error: out of memory: {describe(err)[:300]} (a smaller batch, model or "
                                "--max-new-tokens needs less)")
        if isinstance(err, (OSError, *expected)):
            _exit(EXIT_RUNTIME, f"error: {describe(err)}")
        _exit(EXIT_RUNTIME, f"error: {_bug(program, err)}")
