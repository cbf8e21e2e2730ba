"""`ExperimentConfig`: a named experiment, its tables together (`[model]`, `[train]`, `[runtime]`,
`[lora]`), the checks that span them, and a config a run saved read back (`from_dict`)."""

import dataclasses
import json
from typing import Any, Mapping, Self

from pydantic import ValidationError, ValidationInfo, model_validator

from jaxattn.config import ModelConfig
from jaxattn.config.moe import MoEConfig
from train.config.base import SAVED, Table, is_saved
from train.config.errors import one_line
from train.config.tables import LoraTable, RuntimeConfig, TrainConfig

TABLES = ("model", "train", "runtime", "lora")
OPTIONAL_TABLES = ("lora",)  # absent unless a config file or an override has it


class ExperimentConfig(Table):
    """A named experiment: the model, how to train it, and how this machine runs it (and, for LoRA
    fine-tuning, the adapters: `lora`)."""

    _where = ""  # its fields are the tables: errors name `train.lr`

    name: str
    model: ModelConfig
    train: TrainConfig
    runtime: RuntimeConfig = RuntimeConfig()
    lora: LoraTable | None = None

    @classmethod
    def table_keys(cls) -> dict[str, list[str]]:
        """The keys of each top-level table (a model's are `jaxattn.ModelConfig`'s fields), by its name."""
        tables = {"train": TrainConfig, "runtime": RuntimeConfig, "lora": LoraTable}
        return {"model": sorted(f.name for f in dataclasses.fields(ModelConfig)),
                **{name: sorted(kind.model_fields) for name, kind in tables.items()}}

    @model_validator(mode="after")
    def _lora_needs_a_base(self, info: ValidationInfo) -> Self:
        """Adapters on random weights would train a random model's corrections: refused."""
        if self.lora is not None and not is_saved(info):
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
            raise one_line(err, "", cls.table_keys()) from None

