"""Experiment configs: typed tables, configs/NAME.toml files and `--set` overrides.

A config file has up to four tables:

* `[model]`: the maths, `jaxattn.ModelConfig` fields (`mla = {kv_lora_rank = 32, ...}`
  for Multi-head Latent Attention; per-layer kinds as `[[model.layer_pattern]]` tables
  or `layer_pattern = [{local = true}, {}]`);
* `[train]`: how to train, `TrainConfig`;
* `[runtime]`: how this machine runs it, `RuntimeConfig` (kernels, devices, XLA
  flags); every field defaults to "auto", resolved when the run starts;
* `[lora]`: only where a run trains LoRA adapters on a checkpoint (`train.init_from`), `LoraTable`;
  its presence (in a file, or one `--set lora.FIELD=...`) turns LoRA on.

`base = "other_name"` at the top inherits another file and overrides some of its
values. Overrides use TOML's value syntax: `--set model.d_model=256 train.lr=3e-4
model.num_kv_heads=none runtime.matmul=xla`. An inline table is merged into the table it
overrides (`model.moe={aux_loss_coef = 0}` keeps the file's other `[model.moe]` keys), and
`model.moe.aux_loss_coef=0` sets one key of it; `model.moe=none` first drops the file's table.

The tables are validated by pydantic as JSON data, the types TOML and a saved config.json
share: an integer field takes only integers, a float field integers or floats, a bool field
only true/false, a string field only strings. Unknown keys, wrong types and bad choices are
one-line errors naming the field, e.g. `train.lr must be a valid number, got 'fast'`.

Settings no run can use are refused the same way: every float, in every table and the model's,
must be finite (`train.lr=inf` would only stop on the first NaN loss); paths must not be empty.
The checks of settings a run could still train with, though not as asked (Muon's momentum
warm-up going down, a WSD run that ends inside its warmup, a negative target loss, an empty
path), apply to configs being made, not to a config a run saved: `ExperimentConfig.from_dict`
reads a run from before such a check as it was written (train.sample, export, the checkpoint a
`--resume` compares with).
"""

import dataclasses
import json
import tomllib
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Mapping, Self, Sequence

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PlainSerializer,
    PlainValidator,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from jaxattn import kernels, lora
from jaxattn.axes import MeshShape
from jaxattn.config import ModelConfig
from jaxattn.config.moe import MoEConfig

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
DEFAULT_CONFIG = "shakespeare_char_baby"
TABLES = ("model", "train", "runtime", "lora")
OPTIONAL_TABLES = ("lora",)  # absent unless a config file or an override has it

OpenFraction = Annotated[float, Field(gt=0, lt=1)]
SAVED = "saved"  # the validation context's key: True while reading a config a run saved (`from_dict`)


def _saved(info: ValidationInfo) -> bool:
    """Whether the table is read back from a run (`ExperimentConfig.from_dict`), not made now."""
    return bool((info.context or {}).get(SAVED))


class _OneLineErrors(type(BaseModel)):
    """Building a table directly, `TrainConfig(lr=...)`, raises one line naming the field (`_one_line`).

    Here, not in `__init__`: a table with its own `__init__` is validated through it, in Python
    mode, even by `model_validate_json`."""

    def __call__(cls, *args, **kwargs):
        try:
            return super().__call__(*args, **kwargs)
        except ValidationError as err:
            raise _one_line(err, cls._where) from None


class _Table(BaseModel, metaclass=_OneLineErrors):
    """A frozen config table: strict types, unknown keys refused, every float finite.

    `allow_inf_nan=False` reaches the dataclasses a table holds too (pydantic validates a stdlib
    dataclass with its parent's config): `model.norm_eps=inf` is refused like `train.lr=inf`."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, allow_inf_nan=False)
    _where: ClassVar[str]  # how errors name this table when it is built directly

    def replace(self, **changes: Any) -> Self:
        """A copy with `changes`, checked as a new table is."""
        return type(self)(**{**dict(self), **changes})

    def to_dict(self) -> dict[str, Any]:
        """Plain values: what config.json holds (a mesh as its "data:D,fsdp:F,tensor:T" text)."""
        return self.model_dump()


class TrainConfig(_Table):
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
        AdamW at lr for embeddings, head, norms and biases (train.run.optim).
      muon_momentum, muon_momentum_start, muon_momentum_warmup: Muon's Nesterov momentum,
        linear from start to muon_momentum over the first muon_momentum_warmup steps.
      beta1, beta2, weight_decay: AdamW (weight_decay also Muon's, decoupled).
      adam_states: AdamW's two moments in "float32", or "int8": one byte per value in blocks of 256
        with a float32 scale each, on a dynamic code (bitsandbytes' 8-bit Adam; train.run.adam8bit), a
        quarter of the memory, for parameters of at least 4096 values.
      decay_embeddings: apply weight decay to embedding tables too (nanoGPT does).
      grad_clip: clip_by_global_norm threshold (0 = off).
      eval_interval, eval_iters: evaluate every N steps on eval_iters fixed batches per split.
      eval_whole_val: the val loss over every token of the validation split instead (windows
        of block_size), the train loss still on eval_iters batches.
      target_loss: report the training seconds and step of the first evaluation whose val
        loss is at or below this (`--target-loss`); a loss, so not negative.
      log_interval: steps between progress-bar/metrics updates.
      steps_per_dispatch: optimizer steps fused into one jitted call with lax.scan.
      seed: the one seed of params, batches and dropout.
      out_dir: where checkpoints, metrics.jsonl, config.json and loss.png go (not empty: that
        would be the current directory).
      checkpoint: save latest and best-by-val-loss checkpoints at each eval.
      data_path: the corpus: a text file or a directory made by `python -m train.prepare`
        (None: Tiny Shakespeare, see train.data.corpus).
      tokenizer: "char" or "byte" (built from a text file when the run starts), "bpe" or "hf"
        (a prepared directory's, which must be of this kind).
      val_fraction: the last fraction of a text file held out (a prepared directory keeps its split).
      sample_tokens, sample_temperature, sample_prompt: the sample printed at the end.
      plot: write the loss curve PNG at the end.
      init_from: start from a trained checkpoint instead of random weights: "hf:DIR" (a transformers
        directory with its tokenizer.json) or "gguf:FILE" (`train.init_from`). Its model config replaces
        `[model]` and its tokenizer the corpus's (`train.tokenizer` is not used). A `data_path` ending in
        .jsonl is then chat data, rendered with its chat template and packed (`train.data.corpus.open_chat_corpus`).
      train_on: which predictions of chat data count toward the loss: "assistant" (the assistant's turns,
        `train.data.chats.render_conversation`) or "all".
    """

    _where = "TrainConfig"

    batch_size: PositiveInt = 12
    block_size: PositiveInt = 64
    max_iters: PositiveInt = 2000
    lr: PositiveFloat = 1e-3
    min_lr: NonNegativeFloat = 1e-4
    warmup_iters: NonNegativeInt = 100
    lr_decay_iters: PositiveInt = 2000
    schedule: Literal["cosine", "wsd"] = "cosine"
    decay_fraction: Annotated[float, Field(ge=0, le=1)] = 0.2
    optimizer: Literal["adamw", "muon"] = "adamw"
    muon_lr: PositiveFloat = 0.02
    muon_momentum: OpenFraction = 0.95
    muon_momentum_start: OpenFraction = 0.85
    muon_momentum_warmup: NonNegativeInt = 300
    beta1: OpenFraction = 0.9
    beta2: OpenFraction = 0.99
    weight_decay: NonNegativeFloat = 0.1
    adam_states: Literal["float32", "int8"] = "float32"
    decay_embeddings: bool = True
    grad_clip: NonNegativeFloat = 1.0
    eval_interval: PositiveInt = 250
    eval_iters: PositiveInt = 20
    eval_whole_val: bool = False
    target_loss: float | None = None  # >= 0: `_a_loss`
    log_interval: PositiveInt = 10
    steps_per_dispatch: PositiveInt = 1
    seed: Annotated[int, Field(ge=0, lt=2 ** 63)] = 1337
    out_dir: str = "runs/shakespeare_char_baby"
    checkpoint: bool = True
    data_path: str | None = None
    tokenizer: Literal["char", "byte", "bpe", "hf"] = "char"
    val_fraction: OpenFraction = 0.1
    sample_tokens: NonNegativeInt = 300
    sample_temperature: NonNegativeFloat = 0.8
    sample_prompt: str = "\n"
    plot: bool = True
    init_from: str | None = None
    train_on: Literal["assistant", "all"] = "assistant"

    @model_validator(mode="after")
    def _min_lr_at_most_lr(self) -> Self:
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr={self.min_lr} exceeds lr={self.lr}")
        return self

    @field_validator("out_dir", "data_path")
    @classmethod
    def _a_path(cls, value: str | None, info: ValidationInfo) -> str | None:
        """An empty path is the current directory: `out_dir=""` would write the run among the user's
        files, `data_path=""` read the current directory as a corpus."""
        if value is not None and not value.strip() and not _saved(info):
            raise PydanticCustomError("empty_path", "Input should be a non-empty path")
        return value

    @field_validator("init_from")
    @classmethod
    def _a_checkpoint(cls, value: str | None, info: ValidationInfo) -> str | None:
        kind, sep, path = (value or "").partition(":")
        if value is not None and not _saved(info) and (not sep or kind not in ("hf", "gguf") or not path.strip()):
            raise PydanticCustomError("checkpoint", "Input should be hf:DIR (a transformers directory) or gguf:FILE")
        return value

    @field_validator("target_loss")
    @classmethod
    def _a_loss(cls, value: float | None, info: ValidationInfo) -> float | None:
        if value is not None and value < 0 and not _saved(info):
            raise PydanticCustomError("greater_than_equal", "Input should be greater than or equal to 0 (a loss)")
        return value

    @model_validator(mode="after")
    def _runnable(self, info: ValidationInfo) -> Self:
        """Settings a run would train with, but not as asked: refused when a config is made.

        * Muon's momentum rises from `muon_momentum_start` to `muon_momentum` over
          `muon_momentum_warmup` steps (`train.run.optim.momentum_schedule`); a start above the end
          would make the warm-up lower it.
        * WSD (`train.run.optim.lr_schedule`) warms up linearly to `lr` over `warmup_iters` steps, holds
          it, then decays to `min_lr`. With `warmup_iters >= max_iters` the run ends inside the
          warmup, its rate still rising below `lr`: neither the stable part nor the decay, which
          is what a WSD run's final loss comes from, ever happens. That is refused rather than
          warned about: nothing can come of such a run but a loss taken at a high rate, and a
          shorter warmup (or the cosine schedule) is one setting away. The cosine schedule is
          nanoGPT's and keeps nanoGPT's behaviour: a short trial of a config with a long warmup
          (`--set train.max_iters=50` on the baby's 100 warmup steps) still runs.
        """
        if _saved(info):
            return self
        if self.muon_momentum_warmup and self.muon_momentum_start > self.muon_momentum:
            raise ValueError(f"muon_momentum_start={self.muon_momentum_start} is above muon_momentum="
                             f"{self.muon_momentum}: the warm-up over muon_momentum_warmup={self.muon_momentum_warmup} "
                             "steps would lower the momentum; set muon_momentum_start <= muon_momentum")
        if self.schedule == "wsd" and self.warmup_iters >= self.max_iters:
            raise ValueError(f"schedule 'wsd' with warmup_iters={self.warmup_iters} >= max_iters={self.max_iters}: "
                             "the run would end inside the warmup, the rate still rising, never held at lr or "
                             "decayed to min_lr; set warmup_iters below max_iters")
        return self


def _kernel_choice(field: str):
    """The names `runtime.FIELD` takes: `jaxattn.kernels`' implementations of FIELD, or "auto"."""
    return Literal[kernels.choices(field) + (kernels.AUTO,)]


def _mesh_or_auto(value: Any) -> MeshShape | Literal["auto"]:
    """"auto", or a mesh: its text ("data:2,fsdp:2") is parsed here, once."""
    if value == "auto" or isinstance(value, MeshShape):
        return value
    if not isinstance(value, str):
        raise PydanticCustomError("mesh_type", "Input should be \"auto\" or a mesh like \"data:2,fsdp:2\"")
    return MeshShape.parse(value)  # ValueError naming what is wrong


class RuntimeConfig(_Table):
    """How this machine runs an experiment; never the model's maths (docs/theory.md §15).

    Attributes:
      attention, decode, matmul, mla, moe, paged: `jaxattn.Kernels` implementation names, or "auto":
        chosen for the platform when the run starts (`train.run.runtime`), printed with the
        reason and saved resolved.
      mesh: "auto" or the device mesh, a `MeshShape`, written "data:D,fsdp:F,tensor:T" (axes
        left out are 1; see `jaxattn.sharding`); its product must equal the device count.
        "auto": the batch split over one host device per CPU core that divides it (on a CPU),
        or over the devices that divide it (on a GPU or TPU).
      cpu_devices: host devices to make on a CPU (JAX's `jax_num_cpu_devices`, set before
        JAX starts); "auto": the mesh's size, or one per core for an "auto" mesh.
      xla_flags: extra XLA_FLAGS, applied before JAX starts.
    """

    _where = "RuntimeConfig"

    attention: _kernel_choice("attention") = "auto"
    decode: _kernel_choice("decode") = "auto"
    matmul: _kernel_choice("matmul") = "auto"
    mla: _kernel_choice("mla") = "auto"
    moe: _kernel_choice("moe") = "auto"
    paged: _kernel_choice("paged") = "auto"
    quantized: _kernel_choice("quantized") = "auto"
    mesh: Annotated[MeshShape | Literal["auto"], PlainValidator(_mesh_or_auto), PlainSerializer(str)] = "auto"
    cpu_devices: PositiveInt | Literal["auto"] = "auto"
    xla_flags: str = ""

    def requested_kernels(self) -> kernels.Kernels:
        """The kernels asked for (fields may be "auto")."""
        return kernels.Kernels(**{field: getattr(self, field) for field in kernels.IMPLEMENTATIONS})


assert set(kernels.IMPLEMENTATIONS) <= set(RuntimeConfig.model_fields), "a kernel field is missing from [runtime]"


LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down", "experts")


class LoraTable(_Table):
    """LoRA fine-tuning (`jaxattn.lora`): a table `[lora]` trains low-rank adapters on a frozen base.

    Attributes:
      rank: r of each adapter (`A [in, r]`, `B [r, out]`).
      alpha: the adapters' output is scaled by alpha / r (alpha / sqrt(r) with `rslora`).
      dropout: dropout on an adapter's input while training (PEFT's `lora_dropout`).
      rslora: rank-stabilised scaling, alpha / sqrt(r).
      targets: the projections that get adapters, by logical name: q, k, v, o (attention), gate, up,
        down (the MLP), experts (a mixture's routed experts).
      base_dtype: the frozen base's storage, "float32" or "bfloat16" (half its memory; the adapters and
        their optimizer stay float32).
    The base is the run's `train.init_from`; only the adapters are trained, kept in the optimizer and
    saved in checkpoints (with the base's source and sha256, checked when the run resumes).
    """

    _where = "LoraTable"

    rank: PositiveInt = 8
    alpha: PositiveFloat = 16.0
    dropout: Annotated[float, Field(ge=0, lt=1)] = 0.0
    rslora: bool = False
    targets: tuple[Literal[LORA_TARGETS], ...] = ("q", "k", "v", "o", "gate", "up", "down")
    base_dtype: Literal["float32", "bfloat16"] = "float32"

    def settings(self) -> lora.LoraConfig:
        """The adapters' settings as `jaxattn.lora` takes them."""
        return lora.LoraConfig(rank=self.rank, alpha=self.alpha, dropout=self.dropout, rslora=self.rslora,
                               targets=self.targets)

    @field_validator("targets")
    @classmethod
    def _some_targets(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value:
            raise PydanticCustomError("no_targets", f"Input should name at least one of {LORA_TARGETS}")
        if len(set(value)) != len(value):
            raise PydanticCustomError("repeated_targets", "Input should name each target once")
        return value


class ExperimentConfig(_Table):
    """A named experiment: the model, how to train it, and how this machine runs it (and, for LoRA
    fine-tuning, the adapters: `lora`)."""

    _where = ""  # its fields are the tables: errors name `train.lr`

    name: str
    model: ModelConfig
    train: TrainConfig
    runtime: RuntimeConfig = RuntimeConfig()
    lora: LoraTable | None = None

    @model_validator(mode="after")
    def _lora_needs_a_base(self, info: ValidationInfo) -> Self:
        """Adapters on random weights would train a random model's corrections: refused."""
        if self.lora is not None and not _saved(info):
            if self.train.init_from is None:
                raise ValueError("a [lora] table trains adapters on a checkpoint: set train.init_from (hf:DIR or "
                                 "gguf:FILE), or leave out [lora] for a run from scratch")
            if self.train.optimizer != "adamw":
                raise ValueError(f"[lora] trains its adapters with AdamW; train.optimizer is "
                                 f"{self.train.optimizer!r}")
        return self

    @model_validator(mode="after")
    def _block_fits_the_model(self) -> Self:
        """A run from a checkpoint (`train.init_from`) is checked once its model is the checkpoint's
        (`train.checkpoints.init_from.with_base_model`): the file's [model] is not the one it trains."""
        if self.train.init_from is None and self.model.max_seq_len < self.train.block_size:
            raise ValueError(f"model.max_seq_len={self.model.max_seq_len} is shorter than "
                             f"train.block_size={self.train.block_size}")
        return self

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True, ensure_ascii=False)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], *, saved: bool = True) -> "ExperimentConfig":
        """Inverse of to_dict, with the checks of a config file (values of JSON's types); a saved
        config's older MoE field names are read as today's (`MoEConfig.upgrade`).

        `saved`: the values are a config a run saved, so the checks that only a config being made
        gets (`TrainConfig._runnable`, empty paths, a negative target loss) are skipped: a run saved
        before they existed still loads. `load_config` passes False."""
        model = values.get("model")
        if isinstance(model, Mapping) and isinstance(model.get("moe"), Mapping):
            values = {**values, "model": {**model, "moe": MoEConfig.upgrade(model["moe"])}}
        try:  # JSON mode: tables and arrays become the dataclasses and tuples of the fields
            return cls.model_validate_json(json.dumps(values, default=str), context={SAVED: saved})
        except ValidationError as err:
            raise _one_line(err, "") from None


# ----------------------------------------------------------------------------- one-line errors

SHOULD_BE = "Input should be "


def _one_line(err: ValidationError, where: str) -> ValueError | TypeError:
    """pydantic's report (several lines per error) as one line: `train.lr must be a valid number, got 'fast'`
    for each field, the members of a union joined by "or". TypeError when the first problem is a type."""
    wanted: dict[str, list[str]] = {}
    strays: dict[str, list[str]] = {}  # table -> its unknown keys
    problems: dict[str, str] = {}
    for error in err.errors(include_url=False):
        path = _path(where, error["loc"])
        if error["type"] in ("extra_forbidden", "unexpected_keyword_argument"):
            table, _, key = path.rpartition(".")
            strays.setdefault(table, []).append(key)
            problems[f"{table} keys"] = _unknown_keys(table, strays[table])
        elif error["msg"].startswith(SHOULD_BE):
            wanted.setdefault(path, []).append(error["msg"].removeprefix(SHOULD_BE).replace("an object", "a table"))
            problems[path] = f"{path} must be {' or '.join(wanted[path])}, got {error['input']!r}"
        else:
            text = str(error["ctx"]["error"]) if error["type"] == "value_error" else error["msg"]
            problems.setdefault(path, f"{path}: {text}" if path else text)
    kind = TypeError if err.errors()[0]["type"].endswith("_type") else ValueError
    return kind("; ".join(problems.values()))


def _unknown_keys(table: str, keys: list[str]) -> str:
    known = _table_keys(table)
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


def _table_keys(table: str) -> list[str]:
    """The keys of a top-level table ("model", "train", "runtime"); [] for anything else."""
    kind = {"model": ModelConfig, "train": TrainConfig, "runtime": RuntimeConfig, "lora": LoraTable}.get(table)
    if kind is None:
        return []
    return sorted(f.name for f in dataclasses.fields(kind)) if kind is ModelConfig else sorted(kind.model_fields)


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
