"""The training tests' shared fixture: a slice of the corpus to train on (helpers: tests/train/run/tiny_runs.py)."""

import os
from pathlib import Path

import pytest

from train.data.corpus import ENV_PATH


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    """The first 20k characters of Tiny Shakespeare when available, else a repetitive text."""
    path = tmp_path_factory.mktemp("data") / "slice.txt"
    source = os.environ.get(ENV_PATH)
    if source and Path(source).is_file():
        path.write_text(Path(source).read_text(encoding="utf-8")[:20_000], encoding="utf-8")
    else:
        path.write_text("To be, or not to be, that is the question.\n" * 500)
    return path
