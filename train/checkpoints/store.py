"""The checkpoint store (orbax): a run's latest states and its best state by val loss.

Layout under a run's out_dir:
  checkpoints/latest/<step>/   params, optimizer state, step, rng + meta (config, tokenizer,
                               a sha256 of every array: `train.checkpoints.meta`); the two newest
                               steps are kept
  checkpoints/best/<step>/     the same, for the lowest val loss seen so far

Orbax writes a step into `<step>.orbax-checkpoint-tmp-*` and renames it to `<step>` only
once every file is on disk; readers only see renamed steps, so a process killed mid-save
leaves the previous checkpoint as the latest valid one (tests/train/checkpoints/test_checkpoint.py and
tests/train/run/test_runs.py kill real saves). A restore recomputes every array's sha256 and compares
it with the one saved: a corrupted or truncated step gives a CheckpointError naming it and,
where the caller allows, the previous valid step is used instead, with a warning
(`restore_newest_valid`, the one fallback loop of both readers: a resumed run and
`train.models.runs`).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable

import flax.linen as nn
import orbax.checkpoint as ocp
from orbax.checkpoint.checkpoint_managers import LatestN

from train.checkpoints.meta import CheckpointError, build_meta, current_format, verify_checksums
from train.config import ExperimentConfig
from train.data.tokenizer import Tokenizer
from train.run import crash_points

KINDS = ("latest", "best")
KEEP = {"latest": 2, "best": 1}  # latest keeps a previous step to fall back to
META_FILE = "meta/metadata"  # where orbax's JsonSave puts a step's meta (config, tokenizer, checksums)


def open_manager(directory: Path, keep: int, *, create: bool) -> ocp.CheckpointManager:
    """Orbax's manager of one kind's directory; `create` also makes it writable (and removes the
    unfinished save a killed process left)."""
    options = ocp.CheckpointManagerOptions(
        preservation_policy=LatestN(n=keep), create=create, enable_async_checkpointing=False,
        cleanup_tmp_directories=create, temporary_path_class=crash_points.save_path_class())
    return ocp.CheckpointManager(directory.absolute(), options=options, item_names=("state", "meta"))


def first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:300] if text else ''}"


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
            self._managers[kind] = open_manager(self.root / kind, KEEP[kind], create=True)
        return self._managers[kind]

    def save(self, kind: str, step: int, state: Any, *, config: ExperimentConfig, tokenizer: Tokenizer,
             val_loss: float | None, best_val_loss: float | None, extra: dict | None = None) -> None:
        """Writes `state` (`init`'s logical-axis boxes removed) as step `step` of `kind`; `extra` goes
        into its meta.json."""
        state = nn.unbox(state)
        meta = build_meta(step, state, config=config, tokenizer=tokenizer, val_loss=val_loss,
                          best_val_loss=best_val_loss, extra=extra)
        try:
            self._get(kind, create=True).save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)
        except Exception as err:  # a full disk, a read-only folder: one line, not orbax's traceback
            raise CheckpointError(f"saving {self.root / kind / str(step)} failed: {first_line(err)}") from err

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
        return restore_newest_valid(manager, self.root / kind, lambda step: abstract_state, on_skip, check)

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
        """Closes every manager this opened, each after its background work has finished (orbax's
        `close` waits for it), all of them even if one fails; idempotent."""
        managers, self._managers = list(self._managers.values()), {}
        with contextlib.ExitStack() as stack:
            for manager in managers:
                stack.callback(manager.close)


def read_newest_valid(directory: Path, abstract_state: Callable[[int], Any],
                      on_skip: Callable[[str], None] | None) -> tuple[Any, dict]:
    """`restore_newest_valid` of one kind's `directory`, opened read-only for the call."""
    manager = open_manager(directory, 1, create=False)
    try:
        return restore_newest_valid(manager, directory, abstract_state, on_skip)
    finally:
        manager.close()


def restore_newest_valid(manager: ocp.CheckpointManager, directory: Path, abstract_state: Callable[[int], Any],
                         on_skip: Callable[[str], None] | None, check: Callable[[dict], None] | None = None
                         ) -> tuple[Any, dict]:
    """(state, meta) of the newest step that reads and verifies, the arrays shaped like
    `abstract_state(step)`; see `Checkpointer.restore`."""
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
                              f"{first_line(err)}") from err
    return current_format(meta, directory / str(step), where)


def _restore_step(manager, directory: Path, step: int, abstract_state, meta: dict):
    """The state of one step, verified against its `meta` (already read by `_read_meta`)."""
    where = directory / str(step)
    state_args = ocp.args.StandardRestore(abstract_state) if abstract_state is not None \
        else ocp.args.StandardRestore()
    try:
        restored = manager.restore(step, args=ocp.args.Composite(state=state_args))
    except (ValueError, KeyError, TypeError) as err:
        if "checksum" in str(err).lower() or "corrupt" in str(err).lower():
            raise CheckpointError(f"checkpoint {where} is corrupted: {first_line(err)}") from err
        raise CheckpointError(f"checkpoint {where} cannot be read or does not match this model/optimizer "
                              f"(different config?): {first_line(err)}") from err
    except Exception as err:  # truncated or missing files surface from tensorstore as assorted errors
        raise CheckpointError(f"checkpoint {where} cannot be read: {first_line(err)}") from err
    verify_checksums(restored["state"], meta, where)
    return restored["state"]
