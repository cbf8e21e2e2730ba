"""A run's directory: never destroyed silently, never shared by two live runs.

* A new run into a directory that already holds a run is refused, with the way out:
  `--resume` continues it, `--overwrite` replaces it, `--out-dir` picks another.
* `RunLock` holds an exclusive lock on `out_dir/.lock` for the run's life (`flock`:
  the operating system releases it if the process dies), so a second run into the
  same directory fails at once instead of interleaving files.
* `repair_metrics` makes `metrics.jsonl` hold each step once after a resume: lines
  past the checkpoint (written after it, before a crash) and a torn last line go.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from pathlib import Path

RUN_FILES = ("config.json", "metrics.jsonl", "result.json", "loss.png", "checkpoints")
LOCK_FILE = ".lock"
RESUME_OR_OVERWRITE = "--resume continues the run in --out-dir, --overwrite replaces it: pick one"


class RunDirectoryError(RuntimeError):
    """The run directory cannot be used as asked (it holds a run, is locked, or is not a directory)."""


def existing_run(out: Path) -> list[str]:
    """The names of a run's files in `out` (empty when there is no run there)."""
    return [name for name in RUN_FILES if (out / name).exists()]


class RunLock:
    """An exclusive lock on a run directory, released by `release` or when the process ends."""

    def __init__(self, out: Path):
        self.path = out / LOCK_FILE
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(self._fd, 32).decode(errors="replace").strip() or "another process"
            os.close(self._fd)
            raise RunDirectoryError(f"{out} is in use by another run (pid {holder}); wait for it to finish "
                                    "or choose another --out-dir") from None
        os.ftruncate(self._fd, 0)
        os.write(self._fd, str(os.getpid()).encode())

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def claim(out: Path, *, resume: bool, overwrite: bool) -> RunLock:
    """Locks `out` for a run, refusing to replace a run there unless asked; returns the lock.

    With `overwrite`, the previous run's files (RUN_FILES) are removed, nothing else. With `resume`,
    a directory that holds no run (or does not exist) is refused before anything is made there:
    no directory, no lock file.
    """
    if resume and overwrite:
        raise RunDirectoryError(RESUME_OR_OVERWRITE)
    if out.exists() and not out.is_dir():
        raise RunDirectoryError(f"--out-dir {out} is a file, not a directory")
    if resume and not existing_run(out):
        why = "no such directory" if not out.exists() else f"none of {', '.join(RUN_FILES)} is there"
        raise RunDirectoryError(f"--resume: no checkpoint to continue: there is no run in {out} ({why}); "
                                "leave out --resume to start one")
    try:
        out.mkdir(parents=True, exist_ok=True)
        lock = RunLock(out)
    except OSError as err:
        raise RunDirectoryError(f"cannot use {out} as the run directory: {err.strerror or err}") from err
    found = existing_run(out)
    if found and not (resume or overwrite):
        lock.release()
        raise RunDirectoryError(f"{out} already holds a run ({', '.join(found)}): --resume continues it, "
                                "--overwrite replaces it, or choose another --out-dir")
    if overwrite:
        for name in found:
            shutil.rmtree(out / name) if (out / name).is_dir() else (out / name).unlink()
    return lock


def repair_metrics(path: Path, step: int, *, evaluates_again: bool) -> None:
    """Keeps the lines of `metrics.jsonl` up to a resumed run's start `step`.

    Loss lines up to `step` stay; the evaluation at `step` stays unless the resumed run
    evaluates it again; a torn or unreadable line (a crash mid-write) is dropped.
    """
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record["step"] < step or (record["step"] == step and ("loss" in record or not evaluates_again)):
            kept.append(json.dumps(record))
    path.write_text("".join(line + "\n" for line in kept))


def claim_on_main(out_dir: Path, *, resume: bool, overwrite: bool) -> "RunLock | None":
    """Process 0 claims and locks the run directory (None elsewhere); every process learns whether it could."""
    from train.run import distributed
    if not distributed.is_main():
        distributed.agree(True, "claim the run directory")
        return None
    try:
        lock = claim(out_dir, resume=resume, overwrite=overwrite)
    except BaseException:
        distributed.agree(False, "claim the run directory")
        raise
    distributed.agree(True, "claim the run directory")
    return lock
