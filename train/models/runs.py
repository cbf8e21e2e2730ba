"""A training run's model: `load_for_sampling` reads a run's best (else latest) checkpoint, in a
process of its own, on one device whatever the run's mesh was (`train.models.load.load_model`'s
`--checkpoint`); `load_adapted` a LoRA run's adapters on their base (`python -m train.export`);
`is_lora_run` which of the two a run is."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Callable

import flax.linen as nn
import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxattn import lora
from jaxattn.config import ModelConfig
from jaxattn.model import abstract_params
from train.checkpoints import init_from
from train.checkpoints.meta import CheckpointError, path_name
from train.checkpoints.store import META_FILE, first_line, read_newest_valid
from train.config import ExperimentConfig
from train.data.tokenizer import Tokenizer
from train.data.tokenizer import from_dict as tokenizer_from_dict


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


def load_for_sampling(directory: str | Path, *, on_skip: Callable[[str], None] = _warn
                      ) -> tuple[Any, ModelConfig, Tokenizer]:
    """(params, model config, tokenizer) of a run's best checkpoint (else its latest); a LoRA run's
    adapters merged into its base (`load_adapted`, `jaxattn.lora.merge_lora`).

    Accepts a run directory, its checkpoints/ directory or checkpoints/{best,latest}.
    A step that fails to read or its checksums is reported to `on_skip` (a warning on
    stderr) and an older one of the same kind is used; CheckpointError when none is
    valid, or when the arrays do not have the shapes `DecoderLM(config)` expects.
    """
    params, config, tokenizer, meta, found = _restore(directory, on_skip)
    if config.lora is not None:  # a LoRA run saved its adapters alone: merged into the base they were trained on
        params = jax.tree.map(np.asarray, lora.merge_lora(init_from.adapted_params(config, meta, params)))
    _check_params_match(params, config.model)
    _check_finite(params, found)
    return params, config.model, tokenizer


def load_adapted(directory: str | Path, *, on_skip: Callable[[str], None] = _warn
                 ) -> tuple[Any, ExperimentConfig, Tokenizer]:
    """(params with `jaxattn.lora.LoraWeight`s, the run's config, tokenizer) of a LoRA run's best checkpoint
    (else its latest): its adapters on the base it was trained from (`train.checkpoints.init_from.adapted_params`).
    CheckpointError as `load_for_sampling` raises it, and for a run that is no LoRA run."""
    adapters, config, tokenizer, meta, found = _restore(directory, on_skip)
    if config.lora is None:
        raise CheckpointError(f"the run in {found} trained every weight, not LoRA adapters (its config has no "
                              "[lora] table)")
    _check_finite(adapters, found)
    return init_from.adapted_params(config, meta, adapters), config, tokenizer


def _restore(directory: str | Path, on_skip: Callable[[str], None]
             ) -> tuple[Any, ExperimentConfig, Tokenizer, dict, Path]:
    """(the saved params as numpy, the run's config, tokenizer, meta, the directory of the kind read)."""
    path = Path(directory)
    if not path.exists():
        raise CheckpointError(f"checkpoint directory {str(path)!r} does not exist")
    found = _find_manager_dir(path)
    state, meta = read_newest_valid(found, lambda step: _on_one_device(found / str(step) / "state"), on_skip)
    try:
        config, tokenizer = ExperimentConfig.from_dict(meta["config"]), tokenizer_from_dict(meta["tokenizer"])
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"checkpoint in {found}: its meta ({META_FILE}) holds no usable config or "
                              f"tokenizer: {first_line(err)}") from err
    return jax.tree.map(np.asarray, state["params"]), config, tokenizer, meta, found


def is_lora_run(directory: str | Path) -> bool:
    """Whether the run at `directory` (as `load_for_sampling` accepts it) trained LoRA adapters: its
    config.json, or a checkpoint's meta, has a [lora] table. False when neither can be read (the loader
    then says why)."""
    path = Path(directory)
    for candidate in (path / "config.json", path.parent / "config.json", path.parent.parent / "config.json"):
        if candidate.is_file():
            try:
                return json.loads(candidate.read_text()).get("lora") is not None
            except (OSError, ValueError, AttributeError):
                return False
    return False


def _find_manager_dir(path: Path) -> Path:
    """Accepts a run dir, its checkpoints/ dir, or checkpoints/{best,latest}."""
    for candidate in (path / "checkpoints" / "best", path / "checkpoints" / "latest",
                      path / "best", path / "latest", path):
        if candidate.is_dir() and any(p.name.isdigit() for p in candidate.iterdir()):
            return candidate
    raise CheckpointError(
        f"no checkpoint found under {path}: expected a run directory with checkpoints/best or "
        "checkpoints/latest holding a finished step (train with `python -m train.tiny_lm` first)")


def _on_one_device(state_dir: Path) -> Any:
    """The saved state's shapes and dtypes, placed on this process's first device: a checkpoint
    of a data-parallel run (replicated over N host devices) then loads in a one-device process."""
    try:
        saved = ocp.StandardCheckpointHandler().metadata(state_dir.absolute())
    except Exception as err:  # a missing or truncated metadata file
        raise CheckpointError(f"cannot read the checkpoint metadata in {state_dir}: {first_line(err)}") from err
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), saved)


def _check_finite(params, where: Path) -> None:
    """CheckpointError naming the first array holding NaN or infinity (training never saves one)."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        bad = int(np.size(leaf) - np.count_nonzero(np.isfinite(leaf)))
        if bad:
            raise CheckpointError(f"checkpoint in {where}: parameter {path_name(path)} holds {bad} NaN or "
                                  "infinite value(s); it cannot be sampled from")


def _check_params_match(params, config: ModelConfig) -> None:
    """CheckpointError unless the arrays have the shapes `DecoderLM(config)` expects."""
    got, want = _shapes_by_path(params), _shapes_by_path(nn.unbox(abstract_params(config)))
    if got != want:
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        wrong = sorted(k for k in set(got) & set(want) if got[k] != want[k])
        raise CheckpointError(
            "checkpoint is incompatible with its model config: "
            f"missing {missing[:5]}, unexpected {extra[:5]}, "
            f"wrong shapes {[(k, got[k], want[k]) for k in wrong[:5]]}")


def _shapes_by_path(tree) -> dict[str, tuple]:
    return {jax.tree_util.keystr(path): tuple(np.shape(x)) for path, x in jax.tree_util.tree_leaves_with_path(tree)}
