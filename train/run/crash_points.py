"""Fault injection, a testing aid: with `JAXATTN_CRASH_AT=EVENT:STEP` in its environment a training
process kills itself with SIGKILL at one exact moment, so that a test can check what `--resume`
makes of a run killed there (tests/train/run/test_runs.py). Unset, nothing changes.

  step:N   right after the chunk of steps that reaches step N is dispatched: its steps are
           running, none of them recorded
  eval:N   in the evaluation at step N: its losses computed, nothing of it logged or saved
  save:N   in the first save of step N (the latest checkpoint): every file written, orbax's
           commit (the rename of its temporary directory) not done
"""

from __future__ import annotations

import os
import signal

from orbax.checkpoint.path import atomicity

ENV = "JAXATTN_CRASH_AT"
EVENTS = ("step", "eval", "save")


def planned() -> tuple[str, int] | None:
    """(event, step) named by JAXATTN_CRASH_AT; None when it is unset or empty."""
    value = os.environ.get(ENV, "")
    if not value:
        return None
    event, _, step = value.partition(":")
    if event not in EVENTS or not step.isdigit():
        raise ValueError(f"{ENV}={value!r}: expected EVENT:STEP, EVENT one of {', '.join(EVENTS)} and STEP an "
                         "integer >= 0 (e.g. save:10)")
    return event, int(step)


def kill_if_planned(event: str, *steps: int) -> None:
    """SIGKILLs this process when JAXATTN_CRASH_AT names `event` at one of `steps`."""
    plan = planned()
    if plan is not None and plan[0] == event and plan[1] in steps:
        os.kill(os.getpid(), signal.SIGKILL)


class _KilledBeforeCommit(atomicity.AtomicRenameTemporaryPath):
    """Orbax's atomic-rename save of a step, killed before the rename when that save is planned."""

    async def finalize(self):
        name = self.get_final().name
        if name.isdigit():  # a step's folder (the folders of its items are finalized here too)
            kill_if_planned("save", int(name))
        await super().finalize()


def save_path_class() -> type[atomicity.AtomicRenameTemporaryPath] | None:
    """The temporary-path class for orbax's saves: None (orbax's default) unless a save is planned."""
    plan = planned()
    return _KilledBeforeCommit if plan is not None and plan[0] == "save" else None
