"""The experiment's config: what a training run is told, read from configs/NAME.toml and `--set` overrides.

Not `jaxattn.config`, the model's own configs (`ModelConfig`, attention's and MoE's: the maths of a
network, which the library uses without any of `train/`). This package is the training machinery's:
an `ExperimentConfig` holds a `jaxattn.ModelConfig` as its `[model]` table and adds how to train it,
how this machine runs it and, for fine-tuning, LoRA adapters; it reads them from TOML files and
overrides and refuses what no run can use, in one line naming the key.

* `tables`: the tables `[train]` (`TrainConfig`), `[runtime]` (`RuntimeConfig`) and `[lora]` (`LoraTable`);
* `experiment`: `ExperimentConfig`, the tables together, and what a run saved read back (`from_dict`);
* `files`: configs/NAME.toml files, their `base`, and `--set` overrides (`load_config`);
* `base`: what every table is (strict types, frozen, finite floats); `errors`: pydantic's report as one line.

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

from train.config.base import SAVED, OpenFraction
from train.config.errors import SHOULD_BE
from train.config.experiment import OPTIONAL_TABLES, TABLES, ExperimentConfig
from train.config.files import CONFIG_DIR, DEFAULT_CONFIG, apply_override, config_path, load_config, parse_override
from train.config.tables import LORA_TARGETS, LoraTable, RuntimeConfig, TrainConfig

__all__ = [
    "CONFIG_DIR", "DEFAULT_CONFIG", "LORA_TARGETS", "OPTIONAL_TABLES", "SAVED", "SHOULD_BE", "TABLES",
    "ExperimentConfig", "LoraTable", "OpenFraction", "RuntimeConfig", "TrainConfig",
    "apply_override", "config_path", "load_config", "parse_override",
]
