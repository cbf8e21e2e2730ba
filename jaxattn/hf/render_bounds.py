"""Bounds on what a chat template renders for a server's client: its size, its time, and loops that spin.

A model's template is code from its checkpoint, run on a client's messages. `bounded` joins the pieces a
template yields (Jinja's `generate`), abandoning it past `max_chars` characters or `max_seconds`. A
template can also loop without yielding anything (`{% for i in range(99999) %}{% for j in range(99999) %}
{% endfor %}{% endfor %}`: 1e10 turns, no piece to check the time between), so the templates' `range`
is `deadline_range`, which checks the render's deadline as it counts. `TemplateTooCostly` says which
bound was passed; the chat template turns it into its one-line error.
"""

from __future__ import annotations

import contextlib
import contextvars
import time

from jinja2.sandbox import safe_range

CHECK_EVERY = 4096  # range turns between looks at the clock: ~0.1 ms of a loop, a negligible share of it

_deadline: contextvars.ContextVar[tuple[float, float] | None] = contextvars.ContextVar("render_deadline", default=None)


class TemplateTooCostly(Exception):
    """A render passed `max_chars` or `max_seconds`."""


def _too_slow(max_seconds: float) -> TemplateTooCostly:
    return TemplateTooCostly(f"the chat template took more than {max_seconds:g} s to render these messages; the "
                             "most this server waits")


def _check() -> None:
    held = _deadline.get()
    if held is not None and time.monotonic() > held[0]:
        raise _too_slow(held[1])


def deadline_range(*args):
    """The sandbox's `range` (at most `MAX_RANGE` items), checking the render's deadline as it counts."""
    for index, value in enumerate(safe_range(*args)):
        if index % CHECK_EVERY == CHECK_EVERY - 1:
            _check()
        yield value


@contextlib.contextmanager
def time_limit(max_seconds: float | None):
    """The renders in this block (this thread's) end with TemplateTooCostly past `max_seconds` (None: never)."""
    token = _deadline.set(None if max_seconds is None else (time.monotonic() + max_seconds, max_seconds))
    try:
        yield
    finally:
        _deadline.reset(token)


def bounded(pieces, max_chars: int | None, max_seconds: float | None) -> str:
    """The rendered `pieces` joined (run inside `time_limit(max_seconds)`); TemplateTooCostly once they pass
    `max_chars` characters or the deadline."""
    kept, size = [], 0
    for piece in pieces:
        kept.append(piece)
        size += len(piece)
        if max_chars is not None and size > max_chars:
            raise TemplateTooCostly(f"the chat template rendered more than {max_chars:,} characters from these "
                                    "messages; the most this server renders")
        if max_seconds is not None:
            _check()
    return "".join(kept)
