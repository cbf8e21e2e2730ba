"""Config files and overrides: configs/NAME.toml (or a path), its `base = "other"` chain, and `--set
TABLE.FIELD=VALUE` items applied in order, into one checked `ExperimentConfig` (`load_config`)."""

import tomllib
from pathlib import Path
from typing import Any, Sequence

from train.config.experiment import OPTIONAL_TABLES, TABLES, ExperimentConfig

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
DEFAULT_CONFIG = "shakespeare_char_baby"


def config_path(name_or_path: str | Path) -> Path:
    """configs/NAME.toml for a bare name, else the given path."""
    path = Path(name_or_path)
    if path.suffix != ".toml":
        path = CONFIG_DIR / f"{name_or_path}.toml"
    if not path.is_file():
        available = sorted(p.stem for p in CONFIG_DIR.glob("*.toml"))
        raise FileNotFoundError(f"config {str(name_or_path)!r} not found at {path}; available: {available}")
    return path


def _read_tables(name_or_path: str | Path, seen: tuple[str, ...] = ()) -> dict[str, dict]:
    path = config_path(name_or_path)
    if str(path) in seen:
        raise ValueError(f"config inheritance cycle: {' -> '.join(seen + (str(path),))}")
    with open(path, "rb") as f:
        try:
            raw = tomllib.load(f)
        except tomllib.TOMLDecodeError as err:
            raise ValueError(f"config file {path} is not valid TOML: {err}") from None
    unknown = sorted(set(raw) - {"base", *TABLES})
    if unknown:
        raise ValueError(f"config file {path.name}: unknown keys {unknown}; known keys: {['base', *TABLES]}")
    # [lora] is there only when a file has the table: its presence turns LoRA on
    tables = _read_tables(raw["base"], seen + (str(path),)) if "base" in raw else \
        {t: {} for t in TABLES if t not in OPTIONAL_TABLES}
    for table in TABLES:
        if table in tables or table in raw:
            tables[table] = {**tables.get(table, {}), **raw.get(table, {})}
    return tables


def parse_override(item: str) -> tuple[str, str, Any]:
    """'model.d_model=256' -> ('model', 'd_model', 256); values use TOML syntax, bare words are strings.

    FIELD may name a key of a table field: 'model.moe.aux_loss_coef=0' -> ('model', 'moe.aux_loss_coef', 0)."""
    key, sep, text = item.partition("=")
    table, dot, field = key.strip().partition(".")
    if not sep or not dot or table not in TABLES or not all(part.strip() for part in field.split(".")):
        raise ValueError(f"override {item!r} must look like TABLE.FIELD=VALUE (or TABLE.FIELD.KEY=VALUE for a key of "
                         f"a table such as model.moe) with TABLE one of {TABLES}")
    field = ".".join(part.strip() for part in field.split("."))
    text = text.strip()
    if text.lower() in ("none", "null"):
        return table, field, None
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text
    return table, field, value


def _merged(old: Any, new: Any) -> Any:
    """`new` over `old`: a table's keys override those of the table it replaces, the others are kept
    (tables within tables alike); anything else, arrays included, replaces it whole."""
    if isinstance(old, dict) and isinstance(new, dict):
        return {**old, **{key: _merged(old.get(key), value) for key, value in new.items()}}
    return new


def apply_override(tables: dict[str, dict], item: str) -> None:
    """Sets one `--set` item in `tables` (the config file's, in place), merging an inline table into the
    table it overrides (`model.moe={aux_loss_coef = 0}` keeps the file's `num_experts`); a dotted field,
    `model.moe.aux_loss_coef=0`, is the same as `model.moe={aux_loss_coef = 0}`. `model.moe=none` drops
    the table (a later inline table then starts from nothing)."""
    table, field, value = parse_override(item)
    *outer, last = field.split(".")
    for key in reversed(outer):
        value = {last: value}
        last = key
    held, path = tables.setdefault(table, {}).get(last), f"{table}.{last}"
    if outer and held is not None and not isinstance(held, dict):
        kind = "an array" if isinstance(held, list) else repr(held)
        raise ValueError(f"override {item!r}: {path} is {kind}, not a table: set it whole, {path}=VALUE")
    tables[table][last] = _merged(held, value)


def load_config(name_or_path: str | Path = DEFAULT_CONFIG,
                overrides: Sequence[str] = ()) -> ExperimentConfig:
    """Reads configs/NAME.toml (following `base`), applies overrides in order (`apply_override`),
    validates everything."""
    tables = _read_tables(name_or_path)
    for item in overrides:
        apply_override(tables, item)
    return ExperimentConfig.from_dict({"name": Path(name_or_path).stem, **tables}, saved=False)
