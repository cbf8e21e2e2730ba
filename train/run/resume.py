"""Resuming a run (`--resume`): the newest valid checkpoint that matches it, restored onto this
run's mesh, and the checkpoints after it set aside, so that the run writes those steps again
(nothing is deleted)."""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

import jax

from train.checkpoints.init_from import Initial, check_same_base
from train.checkpoints.meta import CheckpointError, check_compatible, check_tokenizer
from train.checkpoints.store import Checkpointer
from train.config import ExperimentConfig
from train.data.corpus import Corpus
from train.run import distributed


def resume_from_checkpoint(checkpoints: Checkpointer, abstract_state: Any, config: ExperimentConfig,
                           corpus: Corpus, *, log: Callable[[str], None], warn: Callable[[str], None],
                           initial: Initial | None = None) -> tuple[Any, dict]:
    """(state laid out as `abstract_state`, meta) of the newest valid latest checkpoint.

    CheckpointError when there is none, when its model, tokenizer or base (`initial`: the checkpoint a
    fine-tuning run starts from, `train.checkpoints.init_from.check_same_base`) is not this run's, or when it
    is past train.max_iters; a damaged step skipped, and each setting that keeps the run from
    replaying exactly, is reported to `warn`. Writes nothing before the checkpoint is accepted.
    """
    if checkpoints.latest_step() is None:
        raise CheckpointError(f"--resume: no checkpoint in {checkpoints.root / 'latest'} (the run "
                              "stopped before its first save): --overwrite starts it again")
    check = partial(_check_matches, config, corpus, warn, initial)
    state, meta = checkpoints.restore("latest", abstract_state, check=check,
                                      on_skip=lambda message: warn(f"warning: {message}"))
    step, tc = meta["step"], config.train
    if step > tc.max_iters:
        raise CheckpointError(f"--resume: the checkpoint is at step {step} and train.max_iters="
                              f"{tc.max_iters}: nothing to train (raise train.max_iters)")
    if distributed.is_main():  # the resume is accepted: from here on the run writes
        _set_aside_newer(checkpoints, step, warn)
    if jax.process_count() > 1:  # the other processes see the steps set aside once process 0 is done
        distributed.agree(True, "set aside the checkpoints after the resumed step")
        checkpoints.close()
    finishing = " (the last: finishing the run: evaluation, sample, plot, result.json)" \
        if step == tc.max_iters else ""
    log(f"resumed from step {step} (val loss {meta['val_loss']}){finishing}")
    return state, meta


def _check_matches(config: ExperimentConfig, corpus: Corpus, warn: Callable[[str], None], initial: Initial | None,
                   meta: dict) -> None:
    """Before a checkpoint's arrays are read: the same tokenizer and model (else CheckpointError);
    the settings that make the resumed run differ from an uninterrupted one are warned about."""
    check_tokenizer(meta, corpus.tokenizer, corpus.path)
    check_same_base(meta, initial)
    for warning in check_compatible(meta, config):
        warn(f"warning: resumed run differs from the checkpoint ({warning}); it will not replay exactly")


def _set_aside_newer(checkpoints: Checkpointer, step: int, warn: Callable[[str], None]) -> None:
    """Checkpoints newer than the resumed `step` (damaged latest steps skipped, a best step of the
    part about to be replayed) are renamed, not deleted, so the run can write those steps again."""
    for moved in checkpoints.set_aside_newer("latest", step, "damaged"):
        warn(f"warning: the damaged checkpoint is kept as {moved}; the run writes that step again")
    for moved in checkpoints.set_aside_newer("best", step, "before-resume"):
        warn(f"warning: the best checkpoint after step {step} is kept as {moved}; the resumed run "
             "writes its own")
