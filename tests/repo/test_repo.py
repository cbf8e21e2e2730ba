"""What the layout promises: public JAX only, no machine paths, code that cites the theory guide."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MACHINE_PATH = re.compile(r"(?<![\w.])/(work|root|home|Users|opt|mnt|scratch)/")


def tracked_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if listed.returncode != 0:  # not a git checkout (an unpacked archive): every file
        return [p for p in ROOT.rglob("*") if p.is_file() and ".venv" not in p.parts and ".git" not in p.parts]
    return [ROOT / name for name in listed.stdout.splitlines()]


def python_modules(*folders) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py"))


def test_the_training_program_is_a_thin_cli():
    assert len((ROOT / "train" / "tiny_lm.py").read_text().splitlines()) < 150


def test_only_public_jax_apis():
    private = [p.relative_to(ROOT).as_posix() for p in python_modules("jaxattn", "train", "bench", "tests")
               if re.search(r"\bjax\._src\b", p.read_text()) and p.name != "test_repo.py"]
    assert private == []


def test_no_absolute_machine_path_in_any_tracked_file():
    found = []
    for path in tracked_files():
        if path.name == "test_repo.py" or not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:  # a picture
            continue
        found += [f"{path.relative_to(ROOT)}:{i}" for i, line in enumerate(text.splitlines(), 1)
                  if MACHINE_PATH.search(line)]
    assert found == []


def test_code_cites_the_theory_guide_not_notes_users_do_not_have():
    cited = [p.relative_to(ROOT).as_posix() for p in python_modules("jaxattn", "train", "bench")
             if re.search(r"\bseed \d{3}\b|study notes", p.read_text())]
    assert cited == []
