"""Checkpoints with orbax: the latest state and the best state by val loss.

Layout under a run's out_dir:
  checkpoints/latest/<step>/   params, optimizer state, step, rng + meta.json (config, tokenizer)
  checkpoints/best/<step>/     the same, for the lowest val loss seen so far

`load_for_sampling` is the one loader of a trained model (sampling, attention maps).
Checkpoints of format 1 (before the model config and the runtime were separate)
are upgraded when read.

Each is an orbax CheckpointManager keeping one step. Orbax writes a step into
`<step>.orbax-checkpoint-tmp-*` and renames it to `<step>` only once every file is on
disk; readers only see renamed steps, so a process killed mid-save leaves the previous
checkpoint as the latest valid one (tests/test_checkpoint.py kills a real save).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint.checkpoint_managers import LatestN

from jaxattn.config import ModelConfig
from jaxattn.model import DecoderLM
from train.config import ExperimentConfig
from train.tokenizer import Tokenizer, from_dict as tokenizer_from_dict

FORMAT_VERSION = 2
KINDS = ("latest", "best")
_MLA_FIELDS = ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


class CheckpointError(ValueError):
    """A checkpoint is missing, unreadable or does not match the run."""


def _manager(directory: Path, *, create: bool) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(
        preservation_policy=LatestN(n=1), create=create, enable_async_checkpointing=False,
        cleanup_tmp_directories=create)
    return ocp.CheckpointManager(directory.absolute(), options=options, item_names=("state", "meta"))


class Checkpointer:
    """Saves and restores a run's train state: {'params', 'opt_state', 'step', 'rng'}."""

    def __init__(self, out_dir: str | Path):
        self.root = Path(out_dir) / "checkpoints"
        self._managers = {kind: _manager(self.root / kind, create=True) for kind in KINDS}

    def save(self, kind: str, step: int, state: Any, *, config: ExperimentConfig,
             tokenizer: Tokenizer, val_loss: float | None, best_val_loss: float | None) -> None:
        meta = {"format": FORMAT_VERSION, "step": int(step), "val_loss": _finite_or_none(val_loss),
                "best_val_loss": _finite_or_none(best_val_loss), "config": config.to_dict(),
                "tokenizer": tokenizer.to_dict()}
        self._managers[kind].save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)

    def latest_step(self, kind: str = "latest") -> int | None:
        return self._managers[kind].latest_step()

    def restore(self, kind: str, abstract_state: Any) -> tuple[Any, dict]:
        """(state shaped like `abstract_state`, meta) of the newest `kind` checkpoint."""
        return _restore(self._managers[kind], self.root / kind, abstract_state)

    def close(self) -> None:
        for manager in self._managers.values():
            manager.close()


def _finite_or_none(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(float(x)) else float(x)


def _restore(manager: ocp.CheckpointManager, directory: Path, abstract_state: Any | None):
    step = manager.latest_step()
    if step is None:
        raise CheckpointError(f"no finished checkpoint in {directory}")
    state_args = ocp.args.StandardRestore(abstract_state) if abstract_state is not None \
        else ocp.args.StandardRestore()
    try:
        restored = manager.restore(step, args=ocp.args.Composite(
            state=state_args, meta=ocp.args.JsonRestore()))
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(
            f"checkpoint {directory / str(step)} does not match this model/optimizer "
            f"(different config?): {err}") from err
    meta = restored["meta"]
    if isinstance(meta, dict) and meta.get("format") == 1:
        meta = upgrade_format_1(meta)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {directory / str(step)} has an unknown format: {meta!r:.200}")
    return restored["state"], meta


def upgrade_format_1(meta: dict) -> dict:
    """A format-1 meta with its config in today's form: MLA's sizes in `model.mla`, the
    implementation choices (matmul_dtype, attention_impl, mla_path, data_parallel, xla_flags)
    in `runtime`. The arrays did not change."""
    model, train = dict(meta["config"]["model"]), dict(meta["config"]["train"])
    mla = {name: model.pop(name) for name in _MLA_FIELDS if name in model}
    model["mla"] = mla if model.pop("attention", "standard") == "mla" else None
    matmul = {"float32": "xla", "bfloat16": "bfloat16_cpu"}.get(model.pop("matmul_dtype", "float32"), "auto")
    runtime = {"attention": model.pop("attention_impl", "xla"), "mla": model.pop("mla_path", "naive"),
               "matmul": matmul, "data_parallel": train.pop("data_parallel", 1),
               "xla_flags": train.pop("xla_flags", "")}
    config = {**meta["config"], "model": model, "train": train, "runtime": runtime}
    return {**meta, "format": FORMAT_VERSION, "config": config}


def check_compatible(meta: dict, config: ExperimentConfig) -> list[str]:
    """Raises if the checkpoint's model differs; returns warnings for train settings that
    change the batches or schedule (a resume is exact only when these match)."""
    saved = ExperimentConfig.from_dict(meta["config"])
    if saved.model != config.model:
        diff = {k: (v, getattr(config.model, k)) for k, v in saved.model.to_dict().items()
                if getattr(config.model, k) != v and k != "rope_scaling"}
        raise CheckpointError(f"checkpoint model config differs from this run's: "
                              f"{{field: (checkpoint, now)}} = {diff or 'rope_scaling'}")
    exact = ("seed", "batch_size", "block_size", "lr", "min_lr", "warmup_iters",
             "lr_decay_iters", "beta1", "beta2", "weight_decay", "grad_clip", "data_path")
    warnings = [f"train.{k} was {getattr(saved.train, k)!r}, now {getattr(config.train, k)!r}"
                for k in exact if getattr(saved.train, k) != getattr(config.train, k)]
    kernels = ("attention", "matmul")  # the ones whose rounding reaches the training losses
    return warnings + [f"runtime.{k} was {getattr(saved.runtime, k)!r}, now {getattr(config.runtime, k)!r}"
                       for k in kernels if getattr(saved.runtime, k) != getattr(config.runtime, k)]


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
    except (OSError, ValueError) as err:
        raise CheckpointError(f"cannot read the checkpoint metadata in {state_dir}: {err}") from err
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), saved)


def load_for_sampling(directory: str | Path) -> tuple[Any, ModelConfig, Tokenizer]:
    """(params, model config, tokenizer) of a run's best checkpoint (else its latest).

    Accepts a run directory, its checkpoints/ directory or checkpoints/{best,latest}.
    Raises CheckpointError when there is none, or when the arrays do not have the
    shapes `DecoderLM(config)` expects.
    """
    path = Path(directory)
    if not path.exists():
        raise CheckpointError(f"checkpoint directory {str(path)!r} does not exist")
    found = _find_manager_dir(path)
    manager = _manager(found, create=False)
    try:
        step = manager.latest_step()
        target = None if step is None else _on_one_device(found / str(step) / "state")
        state, meta = _restore(manager, found, target)
    finally:
        manager.close()
    config = ExperimentConfig.from_dict(meta["config"])
    params = jax.tree.map(np.asarray, state["params"])
    _check_params_match(params, config.model)
    return params, config.model, tokenizer_from_dict(meta["tokenizer"])


def _check_params_match(params, config: ModelConfig) -> None:
    """CheckpointError unless the arrays have the shapes `DecoderLM(config)` expects."""
    expected = jax.eval_shape(lambda: DecoderLM(config).init(jax.random.PRNGKey(0),
                                                             np.zeros((1, 1), np.int32))["params"])
    got = _shapes_by_path(params)
    want = _shapes_by_path(expected)
    if got != want:
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        wrong = sorted(k for k in set(got) & set(want) if got[k] != want[k])
        raise CheckpointError(
            "checkpoint is incompatible with its model config: "
            f"missing {missing[:5]}, unexpected {extra[:5]}, "
            f"wrong shapes {[(k, got[k], want[k]) for k in wrong[:5]]}")


def _shapes_by_path(tree) -> dict[str, tuple]:
    return {jax.tree_util.keystr(path): tuple(np.shape(x)) for path, x in jax.tree_util.tree_leaves_with_path(tree)}
