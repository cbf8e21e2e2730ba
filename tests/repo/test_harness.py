"""The test harness itself: the kept compiled programs of `make test-fast` stay within their bound."""

import os

import conftest


def _entry(directory, name, size, used_at):
    path = directory / name
    path.write_bytes(b"x" * size)
    os.utime(path, (used_at, used_at))
    return path


def test_pruning_keeps_the_programs_used_last(tmp_path):
    oldest = _entry(tmp_path, "a-cache", 400, used_at=1_000)
    middle = _entry(tmp_path, "b-cache", 400, used_at=2_000)
    newest = _entry(tmp_path, "c-cache", 400, used_at=3_000)
    conftest._prune(tmp_path, keep_bytes=900)
    assert not oldest.exists()
    assert middle.exists() and newest.exists()


def test_a_read_counts_as_a_use(tmp_path):
    written_first_read_last = _entry(tmp_path, "a-cache", 400, used_at=1_000)
    os.utime(written_first_read_last, (5_000, 1_000))  # (access, modification)
    written_last = _entry(tmp_path, "b-cache", 400, used_at=3_000)
    conftest._prune(tmp_path, keep_bytes=500)
    assert written_first_read_last.exists()
    assert not written_last.exists()


def test_pruning_within_the_bound_deletes_nothing(tmp_path):
    entries = [_entry(tmp_path, f"{i}-cache", 100, used_at=1_000 + i) for i in range(3)]
    conftest._prune(tmp_path, keep_bytes=300)
    assert all(path.exists() for path in entries)
