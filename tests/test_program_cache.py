"""Compiled programs kept between runs (`jaxattn.program_cache`): a second process reads back what the
first compiled; another config or kernel choice compiles anew; a damaged entry is compiled again with
a warning; `--no-program-cache` keeps nothing, nor does a folder that cannot be made; and the key's
folder names the machine."""

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from programs import tiny_sampling_config

from jaxattn import program_cache
from train import kept_programs

ROOT = Path(__file__).resolve().parents[1]
PROGRAMS_LINE = re.compile(r"programs: (\d+) programs? read back from the cache, (\d+) compiled")


def test_the_machine_key_holds_the_jax_version_the_architecture_and_the_cpu_flags(tmp_path):
    avx2, avx512 = tmp_path / "avx2", tmp_path / "avx512"
    avx2.write_text("processor : 0\nflags : fpu sse2 avx2 fma\n")
    avx512.write_text("processor : 0\nflags : fpu sse2 avx2 fma avx512f avx512_vnni\n")
    arm = tmp_path / "arm"
    arm.write_text("processor : 0\nFeatures : fp asimd asimddp\n")
    keys = {program_cache.machine_key(str(path)) for path in (avx2, avx512, arm)}
    assert len(keys) == 3 and all(key.startswith(f"jax-{jax.__version__}-") for key in keys)
    same = tmp_path / "same"
    same.write_text("processor : 0\nflags : fma avx2 sse2 fpu\n")  # the same flags in another order
    assert program_cache.machine_key(str(same)) == program_cache.machine_key(str(avx2))


def test_the_folder_is_jaxattn_cache_dir_else_the_user_s_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("JAXATTN_CACHE_DIR", str(tmp_path / "mine"))
    assert program_cache.program_dir() == tmp_path / "mine"
    monkeypatch.delenv("JAXATTN_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert program_cache.program_dir() == tmp_path / "xdg" / "jaxattn" / "programs"


def sample(cache: Path, tiny: str, *extra: str) -> tuple[subprocess.CompletedProcess, tuple[int, int] | None]:
    """`train.sample` in a fresh process keeping its programs in `cache` -> (the run, (read, compiled))."""
    done = subprocess.run([sys.executable, "-m", "train.sample", "--random-init", tiny, "--prompt", "ROMEO:",
                           "--max-new-tokens", "4", "--temperature", "0", *extra], cwd=ROOT, capture_output=True,
                          text=True, timeout=300,
                          env={**os.environ, "JAXATTN_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    found = PROGRAMS_LINE.search(done.stderr)
    return done, (int(found[1]), int(found[2])) if found else None


def entries(cache: Path) -> list[Path]:
    return [path for path in cache.rglob("*") if path.is_file() and not path.name.endswith("-atime")]


@pytest.mark.slow
def test_a_second_process_reads_back_what_the_first_compiled(tmp_path, monkeypatch):
    tiny, cache = tiny_sampling_config(tmp_path, monkeypatch), tmp_path / "programs"
    first, (read, compiled) = sample(cache, tiny)
    assert compiled > 0 and read == 0
    assert [path.parent.name for path in entries(cache)] == [program_cache.machine_key()] * len(entries(cache))
    second, (read, compiled) = sample(cache, tiny)
    assert read > 0 and compiled == 0
    assert second.stdout == first.stdout  # the same greedy tokens from the programs read back

    _, (read, compiled) = sample(cache, tiny, "--kv-cache", "int8")  # another cache layout: other programs
    assert compiled > 0

    for path in entries(cache):  # every entry damaged: each is compiled again, with JAX's warning
        path.write_bytes(b"not a compiled program")
    damaged, (read, compiled) = sample(cache, tiny)
    assert compiled > 0 and read == 0 and damaged.stdout == first.stdout
    assert "Error reading persistent compilation cache entry" in damaged.stderr

    before = sorted(path.stat().st_mtime_ns for path in entries(cache))
    kept_none, counts = sample(cache, tiny, "--no-program-cache")
    assert counts is None and "programs: not kept (--no-program-cache)" in kept_none.stderr
    assert sorted(path.stat().st_mtime_ns for path in entries(cache)) == before


def test_a_cache_folder_that_cannot_be_made_keeps_nothing_and_says_why(monkeypatch, tmp_path):
    blocker = tmp_path / "a file"
    blocker.write_text("")
    monkeypatch.setenv("JAXATTN_CACHE_DIR", str(blocker / "programs"))  # below a file: mkdir fails
    before = jax.config.jax_compilation_cache_dir
    kept = kept_programs.KeptPrograms(argparse.Namespace(no_program_cache=False))
    assert kept.counts is None and jax.config.jax_compilation_cache_dir == before
    assert kept.describe().startswith(f"programs: not kept (cannot write {blocker / 'programs'}: ")
