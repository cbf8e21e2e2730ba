"""Checkpoints with orbax: the latest states and the best state by val loss.

Layout under a run's out_dir:
  checkpoints/latest/<step>/   params, optimizer state, step, rng + meta.json (config, tokenizer,
                               a sha256 of every array); the two newest steps are kept
  checkpoints/best/<step>/     the same, for the lowest val loss seen so far

Orbax writes a step into `<step>.orbax-checkpoint-tmp-*` and renames it to `<step>` only
once every file is on disk; readers only see renamed steps, so a process killed mid-save
leaves the previous checkpoint as the latest valid one (tests/test_checkpoint.py kills a
real save). A restore recomputes every array's sha256 and compares it with the one saved:
a corrupted or truncated step gives a CheckpointError naming it and, where the caller
allows, the previous valid step is used instead, with a warning.

`load_for_sampling` is the one loader of a trained model (sampling, attention maps).
Checkpoints of format 1 (before the model config and the runtime were separate)
are upgraded when read.
"""

from __future__ import annotations

import hashlib
import math
import sys
from pathlib import Path
from typing import Any, Callable

import flax.linen as nn
import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from orbax.checkpoint.checkpoint_managers import LatestN

from jaxattn.config import ModelConfig
from jaxattn.model import abstract_params
from train.config import ExperimentConfig
from train.shards import tokenizer_hash
from train.tokenizer import JSON_KINDS, Tokenizer, from_dict as tokenizer_from_dict

FORMAT_VERSION = 2
KINDS = ("latest", "best")
KEEP = {"latest": 2, "best": 1}  # latest keeps a previous step to fall back to
META_FILE = "meta/metadata"  # where orbax's JsonSave puts a step's meta (config, tokenizer, checksums)
_MLA_FIELDS = ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


class CheckpointError(ValueError):
    """A checkpoint is missing, unreadable, corrupted or does not match the run."""


def _manager(directory: Path, keep: int, *, create: bool) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(
        preservation_policy=LatestN(n=keep), create=create, enable_async_checkpointing=False,
        cleanup_tmp_directories=create)
    return ocp.CheckpointManager(directory.absolute(), options=options, item_names=("state", "meta"))


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:300] if text else ''}"


def _path_name(path) -> str:
    """'opt_state/0/count' for a key path, whatever the containers (a restore may give dicts
    where the saved state had named tuples)."""
    parts = (getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in path)
    return "/".join(str(part) for part in parts)


def _on_host(leaf) -> np.ndarray:
    """The whole array in this process; one split over processes is gathered (every process calls this)."""
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
    return np.asarray(leaf)


def checksums(state: Any) -> dict[str, str]:
    """sha256 of every array of a pytree, by its path (the same in every process of a run)."""
    return {_path_name(path): hashlib.sha256(np.ascontiguousarray(_on_host(leaf)).tobytes()).hexdigest()
            for path, leaf in jax.tree_util.tree_leaves_with_path(state)}


class Checkpointer:
    """Saves and restores a run's train state: {'params', 'opt_state', 'step', 'rng'}.

    Each kind's directory is created by its first save, so opening a run to resume it
    writes nothing. Arrays split over a mesh are saved as they lie, each device's shard
    by the process that holds it, and every process of a run calls `save` and `restore`
    alike; a restore lays the arrays out as its `abstract_state` says, so a run resumes
    on a mesh of another shape.
    """

    def __init__(self, out_dir: str | Path):
        self.root = Path(out_dir) / "checkpoints"
        self._managers: dict[str, ocp.CheckpointManager] = {}

    def _get(self, kind: str, *, create: bool) -> ocp.CheckpointManager | None:
        """The manager of `kind`; None when its directory does not exist and `create` is False.

        An existing directory is opened for writing, which also removes a save that a killed
        process left unfinished (safe: the run directory is locked by this run).
        """
        if kind not in self._managers:
            if not create and not (self.root / kind).is_dir():
                return None
            self._managers[kind] = _manager(self.root / kind, KEEP[kind], create=True)
        return self._managers[kind]

    def save(self, kind: str, step: int, state: Any, *, config: ExperimentConfig, tokenizer: Tokenizer,
             val_loss: float | None, best_val_loss: float | None, extra: dict | None = None) -> None:
        """Writes `state` (`init`'s logical-axis boxes removed) as step `step` of `kind`; `extra` goes
        into its meta.json."""
        state = nn.unbox(state)
        meta = {"format": FORMAT_VERSION, "step": int(step), "val_loss": _finite_or_none(val_loss),
                "best_val_loss": _finite_or_none(best_val_loss), "config": config.to_dict(),
                "tokenizer": tokenizer.to_dict(), "checksums": checksums(state), **(extra or {})}
        try:
            self._get(kind, create=True).save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)
        except Exception as err:  # a full disk, a read-only folder: one line, not orbax's traceback
            raise CheckpointError(f"saving {self.root / kind / str(step)} failed: {_first_line(err)}") from err

    def latest_step(self, kind: str = "latest") -> int | None:
        manager = self._get(kind, create=False)
        return None if manager is None else manager.latest_step()

    def restore(self, kind: str, abstract_state: Any, *, on_skip: Callable[[str], None] | None = None,
                check: Callable[[dict], None] | None = None) -> tuple[Any, dict]:
        """(state shaped like `abstract_state`, meta) of the newest valid `kind` checkpoint.

        Step by step, newest first: the step's meta is read and passed to `check` before any
        array is read (what `check` raises propagates: a checkpoint that does not match the run
        is not skipped), then its arrays are read and verified. A step whose meta or arrays
        cannot be read, or fail their checksums, raises CheckpointError, or, given `on_skip`,
        is reported to it and the next older step is tried.
        """
        manager = self._get(kind, create=False)
        if manager is None or manager.latest_step() is None:
            raise CheckpointError(f"no finished checkpoint in {self.root / kind}")
        return _restore_newest_valid(manager, self.root / kind, lambda step: abstract_state, on_skip, check)

    def set_aside_newer(self, kind: str, step: int, label: str) -> list[Path]:
        """Renames the steps of `kind` newer than `step` to `<step>.<label>`, which orbax ignores,
        so that a run resumed from `step` can write those steps again (the ones a resume skipped as
        damaged, or a best step from the part of the run being replayed); nothing is deleted.
        Returns the new paths."""
        manager = self._get(kind, create=False)
        newer = [] if manager is None else [s for s in manager.all_steps() if s > step]
        moved = []
        for old in newer:
            target, n = self.root / kind / f"{old}.{label}", 1
            while target.exists():
                target, n = self.root / kind / f"{old}.{label}.{n}", n + 1
            (self.root / kind / str(old)).rename(target)
            moved.append(target)
        if moved:
            self._managers.pop(kind).close()  # reopened on next use, without the steps set aside
        return moved

    def close(self) -> None:
        for manager in self._managers.values():
            manager.close()
        self._managers.clear()


def _finite_or_none(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(float(x)) else float(x)


def _restore_newest_valid(manager, directory: Path, abstract_state: Callable[[int], Any], on_skip, check=None):
    """(state, meta) of the newest step that reads and verifies; see `Checkpointer.restore`."""
    steps = sorted(manager.all_steps(), reverse=True)
    for i, step in enumerate(steps):
        try:
            meta = _read_meta(manager, directory, step)
        except CheckpointError as err:
            _skip(err, steps, i, on_skip)
            continue
        if check is not None:
            check(meta)  # a mismatch is the run's, not the step's: no older step is tried
        try:
            return _restore_step(manager, directory, step, abstract_state(step), meta), meta
        except CheckpointError as err:
            _skip(err, steps, i, on_skip)
    raise CheckpointError(f"no finished checkpoint in {directory}")


def _skip(err: CheckpointError, steps: list[int], i: int, on_skip) -> None:
    """Reports a damaged step to `on_skip` when an older one is left to try; re-raises otherwise."""
    if on_skip is None or i == len(steps) - 1:
        raise err
    on_skip(f"{err}; using step {steps[i + 1]} instead")


def _read_meta(manager, directory: Path, step: int) -> dict:
    """The meta of one step (no arrays read), upgraded to today's format; CheckpointError if unreadable."""
    where = directory / str(step) / META_FILE
    try:
        meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    except Exception as err:  # a missing or torn file surfaces from orbax as assorted errors
        raise CheckpointError(f"checkpoint {directory / str(step)}: its meta ({where}) cannot be read: "
                              f"{_first_line(err)}") from err
    if isinstance(meta, dict) and meta.get("format") == 1:
        meta = upgrade_format_1(meta)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION or "config" not in meta:
        raise CheckpointError(f"checkpoint {directory / str(step)}: its meta ({where}) has an unknown format: "
                              f"{meta!r:.200}")
    return meta


def _restore_step(manager, directory: Path, step: int, abstract_state, meta: dict):
    """The state of one step, verified against its `meta` (already read by `_read_meta`)."""
    where = directory / str(step)
    state_args = ocp.args.StandardRestore(abstract_state) if abstract_state is not None \
        else ocp.args.StandardRestore()
    try:
        restored = manager.restore(step, args=ocp.args.Composite(state=state_args))
    except (ValueError, KeyError, TypeError) as err:
        if "checksum" in str(err).lower() or "corrupt" in str(err).lower():
            raise CheckpointError(f"checkpoint {where} is corrupted: {_first_line(err)}") from err
        raise CheckpointError(f"checkpoint {where} cannot be read or does not match this model/optimizer "
                              f"(different config?): {_first_line(err)}") from err
    except Exception as err:  # truncated or missing files surface from tensorstore as assorted errors
        raise CheckpointError(f"checkpoint {where} cannot be read: {_first_line(err)}") from err
    _verify(restored["state"], meta, where)
    return restored["state"]


def _verify(state, meta: dict, where: Path) -> None:
    """CheckpointError naming the first array whose sha256 differs from the saved one."""
    saved = meta.get("checksums")
    if saved is None:  # written before checksums existed
        return
    for key, digest in checksums(state).items():
        if saved.get(key) != digest:
            raise CheckpointError(f"checkpoint {where} is corrupted: array {key} does not match its saved "
                                  "sha256")


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


def check_tokenizer(meta: dict, tokenizer: Tokenizer, corpus: str) -> None:
    """CheckpointError unless `tokenizer` (this run's corpus's) is the checkpoint's: with another
    one every token id would mean another character, and the run would go on training on noise."""
    saved = tokenizer_from_dict(meta["tokenizer"])
    if saved == tokenizer:
        return
    if saved.kind == tokenizer.kind == "char":
        added, missing = sorted(set(tokenizer.chars) - set(saved.chars)), sorted(set(saved.chars) - set(tokenizer.chars))
        detail = (f"its characters differ from the run's ({saved.vocab_size} then, {tokenizer.vocab_size} now; "
                  f"new {''.join(added)!r}, gone {''.join(missing)!r})")
    elif saved.kind == tokenizer.kind and saved.kind in JSON_KINDS:
        detail = (f"it is another {saved.kind} tokenizer ({saved.vocab_size} ids then, {tokenizer.vocab_size} now; "
                  f"hash (prepared.json's tokenizer.hash) {tokenizer_hash(saved.json).hex()} then, "
                  f"{tokenizer_hash(tokenizer.json).hex()} now)")
    else:
        detail = f"it is a {tokenizer.kind} tokenizer and the run's is a {saved.kind} tokenizer"
    was = meta["config"]["train"].get("data_path") or "the default corpus"
    raise CheckpointError(f"--resume: the corpus {corpus} does not give the run's tokenizer: {detail}, so every "
                          f"token id would mean something else. Resume with the run's corpus ({was}), or start "
                          "a new run in another --out-dir")


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
        raise CheckpointError(f"cannot read the checkpoint metadata in {state_dir}: {_first_line(err)}") from err
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), saved)


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


def load_for_sampling(directory: str | Path, *, on_skip: Callable[[str], None] = _warn
                      ) -> tuple[Any, ModelConfig, Tokenizer]:
    """(params, model config, tokenizer) of a run's best checkpoint (else its latest).

    Accepts a run directory, its checkpoints/ directory or checkpoints/{best,latest}.
    A step that fails to read or its checksums is reported to `on_skip` (a warning on
    stderr) and an older one of the same kind is used; CheckpointError when none is
    valid, or when the arrays do not have the shapes `DecoderLM(config)` expects.
    """
    path = Path(directory)
    if not path.exists():
        raise CheckpointError(f"checkpoint directory {str(path)!r} does not exist")
    found = _find_manager_dir(path)
    manager = _manager(found, 1, create=False)
    try:
        state, meta = _restore_newest_valid(manager, found, lambda step: _on_one_device(found / str(step) / "state"),
                                            on_skip)
    finally:
        manager.close()
    try:
        config, tokenizer = ExperimentConfig.from_dict(meta["config"]), tokenizer_from_dict(meta["tokenizer"])
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"checkpoint in {found}: its meta ({META_FILE}) holds no usable config or "
                              f"tokenizer: {_first_line(err)}") from err
    params = jax.tree.map(np.asarray, state["params"])
    _check_params_match(params, config.model)
    _check_finite(params, found)
    return params, config.model, tokenizer


def _check_finite(params, where: Path) -> None:
    """CheckpointError naming the first array holding NaN or infinity (training never saves one)."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        bad = int(np.size(leaf) - np.count_nonzero(np.isfinite(leaf)))
        if bad:
            raise CheckpointError(f"checkpoint in {where}: parameter {_path_name(path)} holds {bad} NaN or "
                                  "infinite value(s); it cannot be sampled from")


def _check_params_match(params, config: ModelConfig) -> None:
    """CheckpointError unless the arrays have the shapes `DecoderLM(config)` expects."""
    expected = nn.unbox(abstract_params(config))
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
