"""Where a prepare writes before its corpus is whole: a temporary folder inside --out, moved into place
at the end, so that a failed or stopped run leaves --out as it was.

The folder (TEMP_PREFIX + 8 characters) holds a marker file, locked while its run lives. A run killed
outright (SIGKILL, a power cut) leaves the folder behind; the next run into --out takes it for a
leftover (`leftover`) when its marker is unlocked and it holds nothing but what a prepare writes
(OWN_FILE), and removes it. Nothing else in --out is ever removed (`check_out`).
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

from train.data.errors import DataError
from train.data.shard_format import SHARD_NAME
from train.data.shards import MANIFEST, TOKENIZER
from train.data.text_chunks import special_kind
from train.outputs import check_folder

try:
    import fcntl
except ImportError:  # not POSIX: the marker of a running prepare is not locked
    fcntl = None

PROGRAM = "python -m train.prepare"  # the program that writes these folders, named in their marker
TEMP_PREFIX = ".prepare-"  # the temporary folder inside --out (tempfile.mkdtemp adds 8 characters)
MARKER = "PREPARING"  # in the temporary folder: says who made it; locked while that run lives
MARKER_TEXT = f"a temporary folder of {PROGRAM}"
SPOOL = "spool.tmp"  # a file's tokens, before they are cut into train and val shards
OWN_FILE = re.compile(rf"^((train|val)_\d{{5}}\.bin(\.part)?|{re.escape(TOKENIZER)}|"
                      rf"{re.escape(MANIFEST)}|{re.escape(SPOOL)}|{MARKER})$")  # what may lie in it


def check_out(out: Path, overwrite: bool) -> list[tuple[Path, int | None]]:
    """Refuses an --out that is not a directory, or holds anything but leftovers without `overwrite`;
    returns the leftover temporary folders to remove (`leftover`), locked."""
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {out} is {special_kind(out) or 'a file'}, not a directory")
    check_folder(out, "--out")
    leftovers, others = [], False
    for entry in sorted(out.iterdir()) if out.is_dir() else ():
        held = leftover(entry)
        if held is False:
            others = True
        else:
            leftovers.append((entry, held))
    if others and not overwrite:
        for _, fd in leftovers:
            release(fd)
        raise DataError(f"--out {out} is not empty: pass --overwrite to replace a prepared corpus there "
                        "(other files stay), or choose another directory")
    return leftovers


def hold(marker: Path, create: bool = False) -> int | bool | None:
    """The marker opened and locked (its descriptor; None where files cannot be locked), or False when
    another process holds it (or it cannot be opened)."""
    try:
        fd = os.open(marker, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o644)
    except OSError:
        return False
    if fcntl is None:
        os.close(fd)
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False
    return fd


def release(fd: int | None) -> None:
    """Unlocks and closes a marker `hold` opened (None: nothing to close)."""
    if fd is not None:
        os.close(fd)  # closing the descriptor drops its lock


def leftover(entry: Path) -> int | bool | None:
    """For a temporary folder a prepare left in --out when it was killed: its marker, locked (see
    `hold`); False for anything else, which is never removed: a name not TEMP_PREFIX + 8 characters, no
    marker of a prepare, a file in it a prepare does not write, or a marker a running prepare holds."""
    if not (entry.name.startswith(TEMP_PREFIX) and len(entry.name) == len(TEMP_PREFIX) + 8):
        return False
    if entry.is_symlink() or not entry.is_dir():
        return False
    try:
        if not (entry / MARKER).read_text(encoding="utf-8").startswith(MARKER_TEXT):
            return False
        if not all(OWN_FILE.match(p.name) and p.is_file() and not p.is_symlink() for p in entry.iterdir()):
            return False
    except (OSError, UnicodeDecodeError):
        return False
    return hold(entry / MARKER)


def make_temp(out: Path) -> tuple[Path, int | None]:
    """The temporary folder of this run in `out`, with its marker created locked (so that no other run
    takes the folder for a leftover while this one lives) and then filled in."""
    tmp = Path(tempfile.mkdtemp(prefix=TEMP_PREFIX, dir=out))
    fd = hold(tmp / MARKER, create=True)
    (tmp / MARKER).write_text(f"{MARKER_TEXT}, process {os.getpid()}: removed by the next run into "
                              f"{out} once this one has ended\n", encoding="utf-8")
    return tmp, (None if fd is False else fd)



def remove_leftovers(leftovers: list[tuple[Path, int | None]], out: Path) -> None:
    """Removes the leftover folders `check_out` found in `out`, saying so in a `note:` line on stderr each."""
    for folder, fd in leftovers:
        shutil.rmtree(folder, ignore_errors=True)
        release(fd)
        print(f"note: removed {folder}, the temporary folder of a {PROGRAM} into {out} that was killed before "
              "it finished", file=sys.stderr)


def move_into_place(tmp: Path, out: Path) -> None:
    """Replaces the prepared corpus in `out` (its shards, tokenizer.json and prepared.json; every other
    file stays) with what the temporary folder `tmp` holds, then drops its marker: `tmp` is left empty."""
    for old in out.iterdir():
        if old != tmp and (SHARD_NAME.match(old.name) or old.name in (MANIFEST, TOKENIZER)):
            old.unlink()
    for new in sorted(tmp.iterdir()):
        if new.name != MARKER:
            new.replace(out / new.name)
    (tmp / MARKER).unlink()
