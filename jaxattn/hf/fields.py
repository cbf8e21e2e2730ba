"""Typed reads of a checkpoint's JSON files (config.json and the rest), failures naming the file and key.

`read_json_object(path)` reads a file that must hold a JSON object;
`Fields` wraps that object with one getter per JSON type (`integer`,
`number`, `flag`, `text`, `texts`, `section`). Each getter applies the
key's default when the key is absent, and checks the value otherwise:
a string where an int belongs, a bool where a number belongs (JSON's
`true` is no 1 here), a list where an object belongs, a size below 1
or a non-finite number all raise `InvalidCheckpoint` naming the file and
the key (dotted inside a section: "rope_parameters.factor").

JSON `null` for a key with a default means the default (transformers treats
a `None` attribute so almost everywhere); where null means something else
(`sliding_window: null` is no window) the caller passes `null=`. A required
key (no default) that is absent or null is an error.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterator, Mapping

from jaxattn._validate import is_int
from jaxattn.hf.errors import InvalidCheckpoint

REQUIRED = object()  # `default=`: the key must be present
DEFAULT = object()  # `null=`: JSON null means the default


def read_text(path: Path, missing: str = "") -> str:
    """The UTF-8 text of `path`; InvalidCheckpoint (naming it) if it is missing, unreadable or not UTF-8.

    `missing` is added to the message of a missing file (what it is for, e.g. ": not a checkpoint directory").
    """
    if not path.is_file():
        raise InvalidCheckpoint(path, None, f"{'is a directory, not a file' if path.is_dir() else 'does not exist'}"
                                f"{missing}")
    try:
        return path.read_bytes().decode("utf-8")
    except OSError as err:
        raise InvalidCheckpoint(path, None, f"cannot be read ({err.strerror or err})") from None
    except UnicodeDecodeError as err:
        raise InvalidCheckpoint(path, None, f"is not UTF-8 text (byte {err.start})") from None


def read_json_object(path: Path, missing: str = "") -> dict[str, Any]:
    """The JSON object `path` holds; InvalidCheckpoint if it is missing, unreadable, not JSON or not an object."""
    try:
        value = json.loads(read_text(path, missing))
    except json.JSONDecodeError as err:
        raise InvalidCheckpoint(path, None, f"is not JSON ({err.msg} at line {err.lineno} column {err.colno})") \
            from None
    except (ValueError, RecursionError) as err:  # an integer of over 4300 digits, nesting deeper than Python's stack
        raise InvalidCheckpoint(path, None, f"is not JSON jaxattn can read ({type(err).__name__}: {err})") from None
    if not isinstance(value, dict):
        raise InvalidCheckpoint(path, None, f"holds {json_type(value)}, expected a JSON object {{...}}")
    return value


def json_type(value: Any) -> str:
    """The JSON type of a parsed value, with an article: "a string", "a boolean", "null"."""
    if value is None:
        return "null"
    for kind, name in ((bool, "a boolean"), (int, "an integer"), (float, "a number"), (str, "a string"),
                       (list, "an array"), (dict, "an object")):
        if isinstance(value, kind):
            return name
    return type(value).__name__


def _shown(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


class Fields(Mapping):
    """A JSON object read from `path`, with typed getters that raise InvalidCheckpoint naming file and key.

    A read-only Mapping of the raw values too (`fields.get(key)` is unchecked).
    """

    def __init__(self, data: Mapping[str, Any], path: str | Path = "config.json", prefix: str = ""):
        self.data, self.path, self.prefix = dict(data), Path(path), prefix

    def __getitem__(self, key: str) -> Any:
        return self.data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.data)

    def __len__(self) -> int:
        return len(self.data)

    def invalid(self, key: str, problem: str) -> InvalidCheckpoint:
        """The error for `key` of this object (the caller raises it)."""
        return InvalidCheckpoint(self.path, self.prefix + key, problem)

    def _raw(self, key: str, default: Any, null: Any) -> tuple[Any, bool]:
        """(value, True) when the key's default or null value applies; (the stored value, False) otherwise."""
        value = self.data.get(key)
        if value is not None:
            return value, False
        if default is REQUIRED:
            raise self.invalid(key, "is missing (a required key)" if key not in self.data
                               else "is null, expected a value (a required key)")
        return (default if key not in self.data or null is DEFAULT else null), True

    def _wrong(self, key: str, value: Any, expected: str) -> InvalidCheckpoint:
        return self.invalid(key, f"expected {expected}, got {_shown(value)} ({json_type(value)})")

    def integer(self, key: str, default: Any = REQUIRED, *, null: Any = DEFAULT, minimum: int = 1) -> Any:
        """An int >= `minimum` (1: a size or count)."""
        value, fallback = self._raw(key, default, null)
        if fallback:
            return value
        if not is_int(value, numpy=False) or value < minimum:
            raise self._wrong(key, value, "a positive integer" if minimum == 1 else f"an integer >= {minimum}")
        return value

    def number(self, key: str, default: Any = REQUIRED, *, null: Any = DEFAULT, positive: bool = True) -> Any:
        """A finite float, > 0 when `positive`, else >= 0 (an int is a number too; a boolean is not)."""
        value, fallback = self._raw(key, default, null)
        if fallback:
            return value
        ok = (is_int(value, numpy=False) or isinstance(value, float)) and math.isfinite(value)
        if not ok or value < 0 or (positive and value == 0):
            raise self._wrong(key, value, "a positive number" if positive else "a number >= 0")
        return float(value)

    def flag(self, key: str, default: Any = REQUIRED, *, null: Any = DEFAULT) -> Any:
        """`true` or `false`."""
        value, fallback = self._raw(key, default, null)
        if not fallback and not isinstance(value, bool):
            raise self._wrong(key, value, "true or false")
        return value

    def text(self, key: str, default: Any = REQUIRED, *, null: Any = DEFAULT) -> Any:
        """A string."""
        value, fallback = self._raw(key, default, null)
        if not fallback and not isinstance(value, str):
            raise self._wrong(key, value, "a string")
        return value

    def texts(self, key: str, default: Any = REQUIRED, *, null: Any = DEFAULT) -> Any:
        """A list of strings."""
        value, fallback = self._raw(key, default, null)
        if not fallback and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise self._wrong(key, value, "an array of strings")
        return value

    def section(self, key: str) -> "Fields | None":
        """The nested object at `key` as `Fields` (its keys reported as "key.inner"); None when absent or null."""
        value, fallback = self._raw(key, None, None)
        if fallback:
            return None
        if not isinstance(value, dict):
            raise self._wrong(key, value, "an object {...}")
        return Fields(value, self.path, f"{self.prefix}{key}.")
