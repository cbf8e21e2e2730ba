"""The programs' compiled programs kept between runs (`jaxattn.program_cache`): the `--no-program-cache`
flag, and the part of a start-up line that says how many were read back and how many compiled."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from jaxattn import program_cache, program_store


def add_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-program-cache", action="store_true",
                        help="compile every program anew and keep none (default: keep them in $JAXATTN_CACHE_DIR, "
                             "else ~/.cache/jaxattn/programs, and read them back on the next start)")


class KeptPrograms:
    """Started before the program compiles anything: the cache enabled (unless `--no-program-cache`)
    and its reads and writes counted."""

    def __init__(self, args: argparse.Namespace):
        self.folder: Path | None = None
        self.why_not = "--no-program-cache"
        if not args.no_program_cache:
            try:
                self.folder = program_cache.enable()
            except OSError as err:  # a cache that cannot be written costs the run its reuse, nothing more
                self.why_not = f"cannot write {program_cache.program_dir()}: {err.strerror or err}"
        self.counts = program_cache.ProgramCounts.start() if self.folder is not None else None

    def describe(self) -> str:
        """"programs: 14 read back from the cache, 0 compiled (~/.cache/jaxattn/programs/...)" (with "; traced
        programs: 14 read back, 0 traced and kept" where the engine's were kept traced too), or
        "programs: not kept (--no-program-cache)" (or the reason the folder could not be made)."""
        if self.counts is None:
            return f"programs: not kept ({self.why_not})"
        home = Path.home()
        folder = f"~/{self.folder.relative_to(home)}" if self.folder.is_relative_to(home) else str(self.folder)
        traced = program_store.default_store().counts  # the engine's step programs; none elsewhere
        kept_traced = (f"; traced programs: {traced['read']} read back, {traced['written']} traced and kept"
                       if any(traced.values()) else "")
        return f"programs: {self.counts.describe()}{kept_traced} ({folder})"

    def report(self, quiet: bool = False) -> None:
        """Prints `describe()` on stderr, unless `quiet`."""
        if not quiet:
            print(self.describe(), file=sys.stderr)
