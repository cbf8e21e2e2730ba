"""Where a fine-tuning run starts: `train.init_from`, a checkpoint someone else trained.

    train.init_from = "hf:DIR"     a transformers directory (config.json, *.safetensors, tokenizer.json)
    train.init_from = "gguf:FILE"  a llama.cpp file (its weights dequantized to float32)

The run then trains that model: its config replaces the experiment's `[model]` table (what the
checkpoint computes is not the run's to change) except for how the model runs, `RUN_SETTINGS`, which
`--set model.dtype=bfloat16`, `--set model.dropout=0.1` or `--set model.scan_layers=true` (the layers
compiled once, `params_for` stacking the checkpoint's weights) still sets (any other `--set model.X` is
refused: it would be lost), and the corpus is tokenized with its tokenizer
(a text file when the run starts; a prepared directory must have been prepared with the same
tokenizer.json, `python -m train.prepare --tokenizer hf:DIR`). The weights are read once, as float32,
and their sha256 (`Initial.digest`, over every array in path order) goes into each checkpoint's
meta: a run resumed on a checkpoint whose weights changed since is refused (`check_same_base`), since
its adapters or its optimizer state would continue from other weights than they were trained on.

Reading the config alone (`model_config`) touches no tensor, so it can come before JAX starts and
the runtime picks kernels for the real model.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Any, Sequence

import jax
import numpy as np

from jaxattn import lora
from jaxattn.config import ModelConfig
from jaxattn.hf.chat_template import ChatTemplate, ChatTemplateError
from jaxattn.scan_plan import relayout
from train.checkpoints.meta import CheckpointError, path_name
from train.config import ExperimentConfig, parse_override
from train.data.tokenizer import JSONTokenizer
from train.models import pretrained

KINDS = pretrained.KINDS  # "hf:DIR", "gguf:FILE"
# How the model runs, not what it computes: the compute dtype of activations and matmuls, dropout, and whether
# the repeated layers run under one scan (the same maths; the weights stacked, `params_for`).
RUN_SETTINGS = ("dtype", "dropout", "scan_layers")
META_KEY = "init_from"  # the checkpoint meta's record of the base: {"source": spec, "sha256": digest}


@dataclasses.dataclass(frozen=True)
class Initial:
    """A checkpoint a run starts from.

    Attributes:
      source: the spec as given ("hf:DIR" or "gguf:FILE").
      config: its model config.
      params: its parameters, float32 numpy arrays in `DecoderLM(config)`'s tree.
      tokenizer: its tokenizer.json as the run's tokenizer (kind "hf", as `train.prepare --tokenizer hf:DIR`
        makes it), ids as the checkpoint's.
      digest: sha256 of every parameter, in path order.
      chat_template: its chat template (how a chat JSONL corpus is rendered), None when it has none.
    """

    source: str
    config: ModelConfig
    params: Any
    tokenizer: JSONTokenizer
    digest: str
    chat_template: ChatTemplate | None = None


def parse_source(spec: str) -> tuple[str, Path]:
    """("hf" or "gguf", path) of a `train.init_from` value; ValueError naming what is wrong."""
    kind, sep, path = str(spec).partition(":")
    if not sep or kind not in KINDS or not path.strip():
        raise ValueError(f"train.init_from must be hf:DIR (a transformers directory) or gguf:FILE (a llama.cpp "
                         f"file), got {spec!r}")
    return kind, Path(path).expanduser()


def model_config(spec: str) -> ModelConfig:
    """The model config of the checkpoint `spec` names, without reading a tensor; CheckpointError when
    it cannot be read."""
    return pretrained.read_config(*parse_source(spec))


def model_settings(overrides: Sequence[str]) -> dict[str, Any]:
    """The `RUN_SETTINGS` that `--set model.X=V` items give (values as the config reads them), for a run
    from a checkpoint; ValueError naming an item that sets another model field, which the checkpoint's
    model would silently replace."""
    settings = {}
    for item in overrides:
        table, field, value = parse_override(item)
        if table != "model":
            continue
        if field not in RUN_SETTINGS:
            allowed = ", ".join(f"model.{f}" for f in RUN_SETTINGS)
            raise ValueError(f"--set {item}: a run from a checkpoint (train.init_from) takes its model from the "
                             f"checkpoint; only {allowed} can be set")
        settings[field] = value
    return settings


def with_base_model(config: ExperimentConfig, initial: Initial | ModelConfig,
                    settings: dict[str, Any] | None = None) -> ExperimentConfig:
    """`config` with the checkpoint's model in place of its `[model]` table, its `RUN_SETTINGS` from
    `settings` (`model_settings`) where given, else kept from `config.model` where that already is the
    checkpoint's model (a second call, a run's saved config), else the checkpoint's; ValueError (one line) when
    train.block_size is longer than the checkpoint's max_seq_len."""
    model = initial.config if isinstance(initial, Initial) else initial
    if model.max_seq_len < config.train.block_size:
        raise ValueError(f"train.block_size={config.train.block_size} is longer than the checkpoint's max_seq_len="
                         f"{model.max_seq_len} ({config.train.init_from})")
    own = {field: getattr(config.model, field) for field in RUN_SETTINGS}
    if config.model.replace(**{field: getattr(model, field) for field in RUN_SETTINGS}) != model:
        own = {}  # the file's [model], not the checkpoint's: its settings were not chosen for this model
    model = model.replace(**{**own, **(settings or {})})
    return config if config.model == model else config.replace(model=model)


def with_checkpoint_model(config: ExperimentConfig, overrides: Sequence[str] = ()) -> ExperimentConfig:
    """`config` with the model of its `train.init_from` checkpoint, read from its config alone (unchanged
    without one), and the `RUN_SETTINGS` of `overrides` (`--set` items); CheckpointError when the
    checkpoint cannot be read, ValueError when its model does not fit the run (a block longer than its
    max_seq_len) or an override sets what the checkpoint decides."""
    if config.train.init_from is None:
        return config
    return with_base_model(config, model_config(config.train.init_from), model_settings(overrides))


def load(spec: str) -> Initial:
    """The checkpoint `spec` names, read whole by the programs' reader of such checkpoints
    (`train.models.pretrained`, as `train.sample --hf`/`--gguf` reads them); CheckpointError (one line
    naming the file) when it cannot be."""
    kind, path = parse_source(spec)
    params, config, tokenizer = pretrained.read(kind, path)
    params = jax.tree.map(lambda leaf: np.asarray(leaf, np.float32), params)
    run_tokenizer = JSONTokenizer("hf", tokenizer.tokenizer.to_str())
    return Initial(source=spec, config=config, params=params, tokenizer=run_tokenizer, digest=digest(params),
                   chat_template=_chat_template(kind, path))


def _chat_template(kind: str, path: Path) -> ChatTemplate | None:
    """The checkpoint's chat template (a directory's chat_template.jinja or tokenizer_config.json, a GGUF
    file's metadata) with its special tokens (`train.models.pretrained.read_chat`); CheckpointError when it
    is there and does not parse."""
    try:
        source, special = pretrained.read_chat(kind, path)
        return None if source is None else ChatTemplate(source, special)
    except ChatTemplateError as err:
        raise CheckpointError(f"cannot load {path}'s chat template: {err}") from None


def digest(params: Any) -> str:
    """sha256 over every array of `params` (its path, shape, dtype and bytes), in path order."""
    hasher = hashlib.sha256()
    leaves = sorted(((path_name(path), np.asarray(leaf)) for path, leaf in jax.tree_util.tree_leaves_with_path(params)),
                    key=lambda item: item[0])
    for name, leaf in leaves:
        hasher.update(f"{name}:{leaf.shape}:{leaf.dtype}".encode())
        hasher.update(np.ascontiguousarray(leaf).tobytes())
    return hasher.hexdigest()


def params_for(initial: Initial, model: ModelConfig) -> Any:
    """`initial.params` in the layout of the run's `model` (the checkpoint's model with the run's
    `RUN_SETTINGS`): the repeated layers' weights stacked for a scan with `model.scan_layers`, else per
    layer. Host arrays stay host arrays."""
    params, _ = relayout(initial.params, model.replace(scan_layers=initial.config.scan_layers), model.scan_layers)
    return params


def meta_record(initial: Initial | None) -> dict:
    """What a checkpoint's meta says of the run's base (nothing for a run from scratch)."""
    return {} if initial is None else {META_KEY: {"source": initial.source, "sha256": initial.digest}}


def check_same_base(meta: dict, initial: Initial | None) -> None:
    """CheckpointError unless the checkpoint was trained from the same base as this run."""
    saved = meta.get(META_KEY)
    if saved is None and initial is None:
        return
    if saved is None:
        raise CheckpointError(f"--resume: the checkpoint is of a run from scratch and this run starts from "
                              f"{initial.source}")
    if initial is None:
        raise CheckpointError(f"--resume: the checkpoint's run started from {saved['source']} (train.init_from) "
                              "and this one from scratch")
    if saved["sha256"] != initial.digest:
        raise CheckpointError(f"--resume: the base's weights changed: {initial.source} has sha256 "
                              f"{initial.digest[:16]}..., the checkpoint was trained from {saved['source']} with "
                              f"{saved['sha256'][:16]}...; resume with the base it was trained from")


def adapted_params(config: ExperimentConfig, meta: dict, adapters: Any) -> Any:
    """A LoRA run's model: the base it was trained from (read again from `train.init_from` and checked
    against the checkpoint's sha256) with the checkpoint's `adapters` (`jaxattn.lora.LoraWeight`s, float32);
    CheckpointError when the base cannot be read or has changed."""
    base = load(config.train.init_from)
    check_same_base(meta, base)
    on_base = jax.tree.map(jax.numpy.asarray, params_for(base, config.model))
    structure = lora.add_lora(on_base, config.model, config.lora.settings(),
                              jax.random.PRNGKey(0))  # the adapters' places; their values are the checkpoint's
    try:
        return lora.combine_lora(lora.split_lora(structure)[1], adapters)
    except ValueError as err:
        raise CheckpointError(f"the checkpoint's adapters do not fit its [lora] settings: {err}") from None
