"""Every path a program will write, checked before any work starts.

A program that trains for an hour and then cannot write its loss plot has lost the
hour's result; so each program checks its outputs first: the file's kind (an image
type matplotlib writes), and that the nearest existing folder above it is a folder
this process can create files in (by creating and removing a temporary file there,
which holds for root and read-only mounts alike). Folders that do not exist yet are
made only when the output is written.
"""

from __future__ import annotations

import tempfile
from pathlib import Path


class UnwritablePath(OSError):
    """An output path this process cannot write; the message names the flag and the path."""


def _nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def _probe(folder: Path, flag: str, path: Path) -> None:
    """UnwritablePath unless a file can be created in `folder` (the closest existing ancestor of `path`)."""
    if not folder.is_dir():
        raise UnwritablePath(f"{flag} {path}: {folder} is a file, so no folder can be made there")
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".jaxattn-probe-"):
            pass
    except OSError as err:
        raise UnwritablePath(f"{flag} {path}: cannot write in {folder} ({err.strerror or err})") from None


def check_file(path: str | Path, flag: str) -> Path:
    """`path` as a Path, once it is known that a file can be written there; UnwritablePath if not."""
    path = Path(path)
    if path.is_dir():
        raise UnwritablePath(f"{flag} {path} is a folder: give a file name")
    if path.exists():
        try:
            with open(path, "ab"):
                pass
        except OSError as err:
            raise UnwritablePath(f"{flag} {path} cannot be written ({err.strerror or err})") from None
    _probe(_nearest_existing(path.parent), flag, path)
    return path


def check_image_file(path: str | Path, flag: str) -> Path:
    """`check_file` for a picture: ValueError (a usage error) unless matplotlib writes its extension."""
    from train.run.plots import can_write, image_types
    if not can_write(path):
        from train.cli import UsageError
        raise UsageError(f"{flag} {path}: not an image type matplotlib writes ({', '.join(image_types())})")
    return check_file(path, flag)


def check_folder(path: str | Path, flag: str) -> Path:
    """`path` as a Path, once it is known that the folder exists or can be made and written; UnwritablePath if not."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UnwritablePath(f"{flag} {path} is a file, not a folder")
    _probe(_nearest_existing(path), flag, path)
    return path
