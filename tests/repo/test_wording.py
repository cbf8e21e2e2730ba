"""The repository speaks to its users: no work-log wording in tracked text, no measured figures in library text.

Measurements live in docs/performance.md, each with the machine and the command that made it;
code, configs and guides say what is faster in general terms and point there.
"""

import io
import re
import subprocess
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
THIS = Path(__file__).resolve()

# Wording that records how the project was built rather than telling a user something.
WORK_LOG = {
    "an issue number": r"\bissues? #?\d+",
    "a session number": r"\bsessions? #?\d+",
    "a work session": r"\b(this|that|earlier|later|previous|same|first|last|next) sessions?\b|\bsession notes\b",
    "a git branch as a place of work": r"\bbranch(es)? `[\w./-]+`|\(branch [\w./-]+\)"
                                       r"|\b(first|earlier|later|previous|feature) branch(es)?\b",
    "a first-person account": r"\b(I|we) (tried|measured|found|ran)\b",
    "the machines the project was built on": r"\bnobody here\b|\bmachines? the project (was|is) built on\b"
                                             r"|\bthe CPUs this project\b|\bthe workplace\b",
    "a colleague's report": r"\b(perf|lead) engineer\b",
}

# Figures of one machine, which belong in docs/performance.md with their machine and command.
FIGURES = {
    "a speed-up": r"~?\b\d+(\.\d+)?x ([\w`]+ )?(faster|slower|at|the speed|the time|a )",
    "a range of ratios": r"\b\d+(\.\d+)?-\d+(\.\d+)?x\b",
    "a throughput": r"\b\d[\d,.]*\s*(tok(en)?s/s|tokens per second|GFLOP/s|GB/s)",
    "a share of a measured time": r"\b\d+(\.\d+)? ?% of (the|a) (step|time|run)\b",
    "a timing against another": r"\b\d+(\.\d+)? ?(ms|µs|s) (against|vs\.?) \d",
}


def tracked_text_files() -> list[Path]:
    """The tracked .py, .md and .toml files, the Makefile and the CI scripts (all files outside git)."""
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if listed.returncode == 0:
        paths = [ROOT / name for name in listed.stdout.splitlines()]
    else:  # an unpacked archive: every file
        paths = [p for p in ROOT.rglob("*") if not {".venv", ".git"} & set(p.parts)]
    return sorted(p for p in paths if p.is_file() and p != THIS and (
        p.suffix in (".py", ".md", ".toml") or p.name == "Makefile" or p.relative_to(ROOT).parts[0] == ".ci"))


def hits(lines: list[tuple[int, str]], patterns: dict[str, str], where: str) -> list[str]:
    return [f"{where}:{number}: {what}: {match.group(0)!r}"
            for what, pattern in patterns.items() for number, line in lines
            for match in [re.search(pattern, line, flags=re.IGNORECASE)] if match]


def prose(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of a Python file's comments, docstrings and string literals."""
    found = []
    for token in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if token.type in (tokenize.COMMENT, tokenize.STRING):
            found += [(token.start[0] + i, line) for i, line in enumerate(token.string.splitlines())]
    return found


@pytest.mark.parametrize("what", sorted(WORK_LOG))
def test_no_tracked_text_reads_like_a_work_log(what):
    found = []
    for path in tracked_text_files():
        lines = list(enumerate(path.read_text(encoding="utf-8").splitlines(), 1))
        found += hits(lines, {what: WORK_LOG[what]}, path.relative_to(ROOT).as_posix())
    assert found == []


@pytest.mark.parametrize("folder", ["jaxattn", "train"])
def test_library_text_quotes_no_measured_figures(folder):
    found = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        found += hits(prose(path), FIGURES, path.relative_to(ROOT).as_posix())
    assert found == []


@pytest.mark.parametrize("text, patterns", [
    ("see issue 14 for the targets", WORK_LOG), ("measured in session 3", WORK_LOG),
    ("notes from branch `decode-perf`", WORK_LOG), ("I tried a where over all slots", WORK_LOG),
    ("Elsewhere, which nobody here has measured", WORK_LOG),
    ("blocked 8.5x xla_cpu at 256 filled", FIGURES), ("(1.0-1.5x at 1024 slots)", FIGURES),
    ("~20x a dict lookup", FIGURES), ("12,600 tokens/s", FIGURES), ("48% of the step", FIGURES),
    ("0.48 s against 1.12 s", FIGURES),
])
def test_the_patterns_catch_what_they_are_for(text, patterns):
    assert hits([(1, text)], patterns, "example")


@pytest.mark.parametrize("text", [
    "git branch -a", "the MLP branch of the block", "both branches of the CPU rule", "a tensor of 16x16",
    "every session of a notebook", "issue a warning", "struct.Struct('<8sHHIQ16s24x')",
    "f'{tokens / seconds:,.0f} tokens/s'", "faster in a large cache until it is about half full",
])
def test_the_patterns_leave_ordinary_text_alone(text):
    assert hits([(1, text)], {**WORK_LOG, **FIGURES}, "example") == []
