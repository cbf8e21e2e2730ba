"""Streaming text out of token ids: whole characters only, and stop strings.

A byte-level tokenizer's token can end inside a UTF-8 character; decoding it alone gives the
replacement character U+FFFD. The stream decodes all the ids so far and releases text only up
to the last complete character (the held-back tail is released once the next tokens complete
it, or at the end). A stop string ends the text before its first occurrence, even when it spans
tokens. Decoding the whole output each time is O(n) per token; the outputs an engine streams are
short enough that this is cheaper than being clever (transformers' TextStreamer does the same).
"""

from __future__ import annotations

from typing import Callable


def _held(ready: str, stops: tuple[str, ...]) -> int:
    """The length of the longest tail of `ready` that begins a stop string (it may still become one).

    Only the places where a stop string holds `ready`'s last character can end such a tail: `rfind` finds
    them at C speed, longest first, so a long stop string costs little more than a short one."""
    last, best = ready[-1:], 0
    for stop in stops:
        upper = min(len(stop) - 1, len(ready))  # a whole stop string would have been found, not held
        while upper > best:
            k = stop.rfind(last, 0, upper) + 1  # stop[k - 1] == last
            if k <= best:
                break
            if ready.endswith(stop[:k]):
                best = k
                break
            upper = k - 1
    return best


class TextStream:
    """The text of a growing list of ids, released in whole characters, cut at stop strings."""

    def __init__(self, detokenize: Callable[[list[int]], str], stop: tuple[str, ...] = ()):
        self._detokenize, self._stop = detokenize, stop
        self._ids: list[int] = []
        self.text = ""  # released so far (never contains a stop string)
        self._given = 0
        self.stopped = False

    def add(self, token: int, *, final: bool = False) -> bool:
        """Appends a token; returns True if a stop string has now appeared (the text ends before it)."""
        if self.stopped:
            return True
        self._ids.append(int(token))
        decoded = self._detokenize(self._ids)
        ready = decoded if final else decoded.rstrip("\ufffd")
        cut = min((i for i in (ready.find(s) for s in self._stop) if i >= 0), default=-1)
        if cut >= 0:
            self.text, self.stopped = ready[:cut], True
            return True
        hold = _held(ready, self._stop)
        self.text = ready[:len(ready) - hold] if not final else ready
        return False

    def finish(self) -> None:
        """The request ended: release what was held back (unless a stop string cut it)."""
        if not self.stopped and self._ids:
            decoded = self._detokenize(self._ids)
            self.text = decoded

    def take(self) -> str:
        """The text released since the last call."""
        new = self.text[self._given:]
        self._given = len(self.text)
        return new
