"""Experiment configs: typed tables, configs/NAME.toml files and `--set` overrides.

A config file has up to three tables:

* `[model]`: the maths, `jaxattn.ModelConfig` fields (`mla = {kv_lora_rank = 32, ...}`
  for Multi-head Latent Attention; per-layer kinds as `[[model.layer_pattern]]` tables
  or `layer_pattern = [{local = true}, {}]`);
* `[train]`: how to train, `TrainConfig`;
* `[runtime]`: how this machine runs it, `RuntimeConfig` (kernels, devices, XLA
  flags); every field defaults to "auto", resolved when the run starts.

`base = "other_name"` at the top inherits another file and overrides some of its
values. Unknown keys, wrong types and bad choices are errors. Overrides use TOML's
value syntax: `--set model.d_model=256 train.lr=3e-4 model.num_kv_heads=none
runtime.matmul=xla`.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

from jaxattn import kernels
from jaxattn.config import ModelConfig
from jaxattn.sharding import MeshShape

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
DEFAULT_CONFIG = "shakespeare_char_baby"
TABLES = ("model", "train", "runtime")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """How to train. Defaults are nanoGPT's CPU "baby" Shakespeare run.

    Attributes:
      batch_size, block_size: B sequences of T tokens per step.
      max_iters: optimizer steps.
      lr, min_lr: peak and final learning rate.
      warmup_iters: linear warmup from 0 to lr.
      lr_decay_iters: the schedule reaches min_lr here (then stays).
      schedule: "cosine" (nanoGPT's) or "wsd": warmup-stable-decay, flat at lr, then linear
        to min_lr over the last `decay_fraction` of lr_decay_iters (docs/theory.md §22).
      optimizer: "adamw", or "muon": Muon for the hidden matrices at `muon_lr` (same schedule),
        AdamW at lr for embeddings, head, norms and biases (train.optim).
      muon_momentum, muon_momentum_start, muon_momentum_warmup: Muon's Nesterov momentum,
        linear from start to muon_momentum over the first muon_momentum_warmup steps.
      beta1, beta2, weight_decay: AdamW (weight_decay also Muon's, decoupled).
      decay_embeddings: apply weight decay to embedding tables too (nanoGPT does).
      grad_clip: clip_by_global_norm threshold (0 = off).
      eval_interval, eval_iters: evaluate every N steps on eval_iters fixed batches per split.
      eval_whole_val: the val loss over every token of the validation split instead (windows
        of block_size), the train loss still on eval_iters batches.
      target_loss: report the training seconds and step of the first evaluation whose val
        loss is at or below this (`--target-loss`).
      log_interval: steps between progress-bar/metrics updates.
      steps_per_dispatch: optimizer steps fused into one jitted call with lax.scan.
      seed: the one seed of params, batches and dropout.
      out_dir: where checkpoints, metrics.jsonl, config.json and loss.png go.
      checkpoint: save latest and best-by-val-loss checkpoints at each eval.
      data_path: the corpus: a text file or a directory made by `python -m train.prepare`
        (None: Tiny Shakespeare, see train.data).
      tokenizer: "char" or "byte" (built from a text file when the run starts), "bpe" or "hf"
        (a prepared directory's, which must be of this kind).
      val_fraction: the last fraction of a text file held out (a prepared directory keeps its split).
      sample_tokens, sample_temperature, sample_prompt: the sample printed at the end.
      plot: write the loss curve PNG at the end.
    """

    batch_size: int = 12
    block_size: int = 64
    max_iters: int = 2000
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_iters: int = 100
    lr_decay_iters: int = 2000
    schedule: Literal["cosine", "wsd"] = "cosine"
    decay_fraction: float = 0.2
    optimizer: Literal["adamw", "muon"] = "adamw"
    muon_lr: float = 0.02
    muon_momentum: float = 0.95
    muon_momentum_start: float = 0.85
    muon_momentum_warmup: int = 300
    beta1: float = 0.9
    beta2: float = 0.99
    weight_decay: float = 0.1
    decay_embeddings: bool = True
    grad_clip: float = 1.0
    eval_interval: int = 250
    eval_iters: int = 20
    eval_whole_val: bool = False
    target_loss: float | None = None
    log_interval: int = 10
    steps_per_dispatch: int = 1
    seed: int = 1337
    out_dir: str = "runs/shakespeare_char_baby"
    checkpoint: bool = True
    data_path: str | None = None
    tokenizer: Literal["char", "byte", "bpe", "hf"] = "char"
    val_fraction: float = 0.1
    sample_tokens: int = 300
    sample_temperature: float = 0.8
    sample_prompt: str = "\n"
    plot: bool = True

    def __post_init__(self):
        for name in ("batch_size", "block_size", "max_iters", "eval_interval", "eval_iters",
                     "log_interval", "steps_per_dispatch", "lr_decay_iters"):
            if getattr(self, name) <= 0:
                raise ValueError(f"TrainConfig.{name} must be positive, got {getattr(self, name)}")
        for name in ("warmup_iters", "sample_tokens", "weight_decay", "grad_clip", "min_lr", "muon_momentum_warmup"):
            if getattr(self, name) < 0:
                raise ValueError(f"TrainConfig.{name} must be >= 0, got {getattr(self, name)}")
        if not 0 < self.lr:
            raise ValueError(f"TrainConfig.lr must be positive, got {self.lr}")
        if self.min_lr > self.lr:
            raise ValueError(f"TrainConfig.min_lr={self.min_lr} exceeds lr={self.lr}")
        if not 0 < self.muon_lr:
            raise ValueError(f"TrainConfig.muon_lr must be positive, got {self.muon_lr}")
        for name in ("beta1", "beta2", "val_fraction", "muon_momentum", "muon_momentum_start"):
            if not 0.0 < getattr(self, name) < 1.0:
                raise ValueError(f"TrainConfig.{name} must be in (0, 1), got {getattr(self, name)}")
        if not 0.0 <= self.decay_fraction <= 1.0:
            raise ValueError(f"TrainConfig.decay_fraction must be in [0, 1], got {self.decay_fraction}")
        if not self.sample_temperature >= 0:
            raise ValueError(f"TrainConfig.sample_temperature must be >= 0, got {self.sample_temperature}")
        if not 0 <= self.seed < 2 ** 63:
            raise ValueError(f"TrainConfig.seed must be in [0, 2**63), got {self.seed}")
        for name, allowed in (("tokenizer", ("char", "byte", "bpe", "hf")), ("schedule", ("cosine", "wsd")),
                              ("optimizer", ("adamw", "muon"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"TrainConfig.{name} must be one of {allowed}, got {getattr(self, name)!r}")

    def replace(self, **changes) -> "TrainConfig":
        return dataclasses.replace(self, **changes)


def _check_positive_or_auto(name: str, value: Any) -> None:
    if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise ValueError(f"{name} must be a positive integer or 'auto', got {value!r}")


@dataclasses.dataclass(frozen=True)
class RuntimeConfig:
    """How this machine runs an experiment; never the model's maths (docs/theory.md §15).

    Attributes:
      attention, decode, matmul, mla, moe: `jaxattn.Kernels` implementation names, or "auto":
        chosen for the platform when the run starts (`train.runtime`), printed with the
        reason and saved resolved.
      mesh: the device mesh, "data:D,fsdp:F,tensor:T" (axes left out are 1; see
        `jaxattn.sharding`); its product must equal the device count. "auto": the batch
        split over one host device per CPU core that divides it (on a CPU), or over the
        devices that divide it (on a GPU or TPU).
      cpu_devices: host devices to make on a CPU (JAX's `jax_num_cpu_devices`, set before
        JAX starts); "auto": the mesh's size, or one per core for an "auto" mesh.
      xla_flags: extra XLA_FLAGS, applied before JAX starts.

    `data_parallel = N` (the field before meshes) is read as `mesh = "data:N"`.
    """

    attention: str = "auto"
    decode: str = "auto"
    matmul: str = "auto"
    mla: str = "auto"
    moe: str = "auto"
    mesh: str = "auto"
    cpu_devices: int | Literal["auto"] = "auto"
    xla_flags: str = ""

    def __post_init__(self):
        for field in kernels.IMPLEMENTATIONS:
            allowed = kernels.choices(field) + (kernels.AUTO,)
            if getattr(self, field) not in allowed:
                raise ValueError(f"RuntimeConfig.{field} must be one of {allowed}, got {getattr(self, field)!r}")
        if self.mesh != "auto":
            MeshShape.parse(self.mesh)  # ValueError naming what is wrong
        _check_positive_or_auto("RuntimeConfig.cpu_devices", self.cpu_devices)

    def mesh_shape(self) -> MeshShape | None:
        """The mesh asked for (None for "auto")."""
        return None if self.mesh == "auto" else MeshShape.parse(self.mesh)

    def requested_kernels(self) -> kernels.Kernels:
        """The kernels asked for (fields may be "auto")."""
        return kernels.Kernels(**{field: getattr(self, field) for field in kernels.IMPLEMENTATIONS})

    def replace(self, **changes) -> "RuntimeConfig":
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    """A named experiment: the model, how to train it, and how this machine runs it."""

    name: str
    model: ModelConfig
    train: TrainConfig
    runtime: RuntimeConfig = RuntimeConfig()

    def __post_init__(self):
        if self.model.max_seq_len < self.train.block_size:
            raise ValueError(f"model.max_seq_len={self.model.max_seq_len} is shorter than "
                             f"train.block_size={self.train.block_size}")

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "model": self.model.to_dict(),
                "train": dataclasses.asdict(self.train), "runtime": dataclasses.asdict(self.runtime)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True, ensure_ascii=False)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "ExperimentConfig":
        """Inverse of to_dict, with the same checks as a config file."""
        _reject_unknown("experiment", values, {"name", *TABLES})
        return cls(name=str(values.get("name", "unnamed")),
                   model=_build(ModelConfig, values.get("model", {}), "model"),
                   train=_build(TrainConfig, values.get("train", {}), "train"),
                   runtime=_build(RuntimeConfig, values.get("runtime", {}), "runtime"))

    def replace(self, **changes) -> "ExperimentConfig":
        return dataclasses.replace(self, **changes)


# ----------------------------------------------------------------------------- type checks

def _reject_unknown(where: str, values: Mapping[str, Any], known) -> None:
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ValueError(f"unknown {where} keys {unknown}; known keys: {sorted(known)}")


def _coerce(name: str, value: Any, hint: Any) -> Any:
    """`value` checked against the type annotation `hint` (ints are accepted as floats)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:  # `X | None`: X's own error says best what is wrong
            return _coerce(name, value, options[0])
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(name, value, arg)
            except (TypeError, ValueError) as err:
                errors.append(str(err))
        raise TypeError(f"{name} must be one of {hint}, got {value!r}: {'; '.join(errors)}")
    if origin is Literal:
        if value not in args:
            raise ValueError(f"{name} must be one of {args}, got {value!r}")
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool (true/false), got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise TypeError(f"{name} must be a string, got {value!r}")
        return value
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:  # layer_pattern: an array (of tables)
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"{name} must be an array, got {value!r}")
        return tuple(_coerce(f"{name}[{i}]", item, args[0]) for i, item in enumerate(value))
    if dataclasses.is_dataclass(hint):  # RopeScaling, MLAConfig, LayerKind: a TOML table
        if isinstance(value, hint):
            return value
        if not isinstance(value, Mapping):
            raise TypeError(f"{name} must be a table like {{field = value, ...}} of {hint.__name__}, "
                            f"got {value!r}")
        return _build(hint, value, name)
    raise TypeError(f"{name}: unsupported annotation {hint!r}")


def _build(cls, values: Mapping[str, Any], where: str):
    """cls(**values) with unknown keys, types and choices checked first."""
    if isinstance(values, cls):
        return values
    if not isinstance(values, Mapping):
        raise TypeError(f"{where} must be a table, got {values!r}")
    if cls is RuntimeConfig and "data_parallel" in values:
        values = _mesh_from_data_parallel(values)
    hints = typing.get_type_hints(cls)
    _reject_unknown(where, values, hints)
    return cls(**{k: _coerce(f"{where}.{k}", v, hints[k]) for k, v in values.items()})


def _mesh_from_data_parallel(values: Mapping[str, Any]) -> dict[str, Any]:
    """A runtime table with the older `data_parallel = N | "auto"` read as `mesh = "data:N" | "auto"`."""
    values = dict(values)
    width = values.pop("data_parallel")
    if values.get("mesh", "auto") != "auto":
        raise ValueError("runtime.data_parallel is the older name of runtime.mesh = \"data:N\"; give only mesh")
    _check_positive_or_auto("runtime.data_parallel", width)
    values["mesh"] = "auto" if width == "auto" else f"data:{width}"
    return values


# ----------------------------------------------------------------------------- files and overrides

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
    _reject_unknown(f"config file {path.name}", raw, {"base", *TABLES})
    tables = _read_tables(raw["base"], seen + (str(path),)) if "base" in raw else {t: {} for t in TABLES}
    for table in TABLES:
        tables[table] = {**tables[table], **raw.get(table, {})}
    return tables


def parse_override(item: str) -> tuple[str, str, Any]:
    """'model.d_model=256' -> ('model', 'd_model', 256); values use TOML syntax, bare words are strings."""
    key, sep, text = item.partition("=")
    table, dot, field = key.strip().partition(".")
    if not sep or not dot or table not in TABLES or not field:
        raise ValueError(f"override {item!r} must look like TABLE.FIELD=VALUE with TABLE one of {TABLES}")
    text = text.strip()
    if text.lower() in ("none", "null"):
        return table, field, None
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text
    return table, field, value


def load_config(name_or_path: str | Path = DEFAULT_CONFIG,
                overrides: Sequence[str] = ()) -> ExperimentConfig:
    """Reads configs/NAME.toml (following `base`), applies overrides, validates everything."""
    tables = _read_tables(name_or_path)
    for item in overrides:
        table, field, value = parse_override(item)
        tables[table][field] = value
    return ExperimentConfig(name=Path(name_or_path).stem, model=_build(ModelConfig, tables["model"], "model"),
                            train=_build(TrainConfig, tables["train"], "train"),
                            runtime=_build(RuntimeConfig, tables["runtime"], "runtime"))
