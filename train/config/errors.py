"""pydantic's report on a config (several lines per error) as the one line a program ends with:
`train.lr must be a valid number, got 'fast'`, each field named by its path in the config."""

from typing import Mapping

from pydantic import ValidationError

SHOULD_BE = "Input should be "


def one_line(err: ValidationError, where: str, table_keys: Mapping[str, list[str]] | None = None
             ) -> ValueError | TypeError:
    """`err` as one line: for each field `PATH must be WANTED, got VALUE`, the members of a union joined
    by "or"; unknown keys listed per table, with the table's known keys where `table_keys` has them.
    `where` prefixes every path (a table built directly: "TrainConfig"). TypeError when the first problem
    is a type."""
    wanted: dict[str, list[str]] = {}
    strays: dict[str, list[str]] = {}  # table -> its unknown keys
    problems: dict[str, str] = {}
    for error in err.errors(include_url=False):
        path = _path(where, error["loc"])
        if error["type"] in ("extra_forbidden", "unexpected_keyword_argument"):
            table, _, key = path.rpartition(".")
            strays.setdefault(table, []).append(key)
            problems[f"{table} keys"] = _unknown_keys(table, strays[table], (table_keys or {}).get(table, []))
        elif error["msg"].startswith(SHOULD_BE):
            wanted.setdefault(path, []).append(error["msg"].removeprefix(SHOULD_BE).replace("an object", "a table"))
            problems[path] = f"{path} must be {' or '.join(wanted[path])}, got {error['input']!r}"
        else:
            text = str(error["ctx"]["error"]) if error["type"] == "value_error" else error["msg"]
            problems.setdefault(path, f"{path}: {text}" if path else text)
    kind = TypeError if err.errors()[0]["type"].endswith("_type") else ValueError
    return kind("; ".join(problems.values()))


def _unknown_keys(table: str, keys: list[str], known: list[str]) -> str:
    return f"unknown {table or 'experiment'} keys {keys}" + (f"; known keys: {known}" if known else "")


def _path(where: str, loc: tuple) -> str:
    """('model', 'layer_pattern', 0, 'rope') -> 'model.layer_pattern[0].rope'."""
    path = where
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part.isidentifier() and part.islower() and part not in ("int", "float", "bool", "str"):
            path += f".{part}" if path else part
        # else: the tag pydantic gives a union's member (bool, literal['auto'], RopeScaling): not a key
    return path
