"""The documents work as written: README.md and the guides in docs/ run, name real flags, link to real files.

* Each document's python blocks run, in order, in one namespace (a later block may use what an
  earlier one made).
* Each `python -m train.PROGRAM ...` line of a shell block (and `make train ARGS="..."`) is a
  command line that program's own parser accepts.
* Each relative link of README.md and docs/*.md points to a file that exists, and each `#anchor`
  to a heading of its document.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import re
import shlex
from pathlib import Path

import pytest

from train import cli

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
NOT_GUIDES = ("theory.md", "performance.md")  # the derivations and the measurements, checked elsewhere
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", flags=re.S | re.M)
SHELL = ("bash", "sh", "shell", "console")
OPERATORS = {"|", "||", "&", "&&", ";", ">", ">>", "<", "2>", "2>&1"}


def every_document() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def guides() -> list[Path]:
    """README.md and the user guides: every document but the theory and the measurements."""
    return [path for path in every_document() if path.name not in NOT_GUIDES]


def name(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def blocks(path: Path, languages: tuple[str, ...]) -> list[str]:
    return [body for language, body in FENCE.findall(path.read_text()) if language in languages]


# ----------------------------------------------------------------------------- python blocks

DOCUMENTS_WITH_CODE = [name(p) for p in guides() if blocks(p, ("python",))]


def test_the_readme_and_the_guides_have_python_to_run():
    assert "README.md" in DOCUMENTS_WITH_CODE and len(DOCUMENTS_WITH_CODE) >= 6


@pytest.mark.slow  # compiles small models: tens of seconds for all the documents together
@pytest.mark.parametrize("document", DOCUMENTS_WITH_CODE)
def test_the_python_blocks_run_as_written(document, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # whatever a block writes stays out of the repository
    namespace = {"__name__": "__guide__"}
    for block in blocks(ROOT / document, ("python",)):
        exec(compile(block, document, "exec"), namespace)


# ----------------------------------------------------------------------------- command lines

def shell_lines(path: Path) -> list[str]:
    """The lines of a document's shell blocks, a line continued with a backslash joined to the next."""
    return [line.strip() for body in blocks(path, SHELL)
            for line in body.replace("\\\n", " ").splitlines() if line.strip()]


def words(line: str) -> list[str]:
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    return list(lexer)


def until_operator(tokens: list[str]) -> list[str]:
    end = next((i for i, token in enumerate(tokens) if token in OPERATORS), len(tokens))
    return tokens[:end]


def program_commands(line: str) -> list[tuple[str, list[str]]]:
    """(program, argv) of each `python -m train.PROGRAM ...` in a shell line, and of `make train ARGS=...`."""
    tokens, found = words(line), []
    for i, token in enumerate(tokens[:-1]):
        if token == "-m" and tokens[i + 1].startswith("train."):
            found.append((tokens[i + 1].removeprefix("train."), until_operator(tokens[i + 2:])))
    if tokens[:2] == ["make", "train"]:
        args = [t.removeprefix("ARGS=") for t in until_operator(tokens[2:]) if t.startswith("ARGS=")]
        found.append(("tiny_lm", [word for arg in args for word in shlex.split(arg)]))
    return found


COMMANDS = [pytest.param(name(path), line, id=f"{name(path)}:{n}") for path in guides()
            for n, line in enumerate((line for line in shell_lines(path) if program_commands(line)), 1)]


class Parsed(BaseException):
    """Raised once a program's parser has accepted its arguments, so that nothing of the program runs."""


def parse_only(program: str, argv: list[str], monkeypatch) -> str | None:
    """None when `python -m train.PROGRAM argv` gets past its parser; else the program's error line."""
    try:
        module = importlib.import_module(f"train.{program}")
    except ModuleNotFoundError:
        return f"there is no program train.{program}"
    parse = cli.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        parse(self, args, namespace)
        raise Parsed

    stderr = io.StringIO()
    with monkeypatch.context() as patch, contextlib.redirect_stderr(stderr):
        patch.setattr(cli.ArgumentParser, "parse_args", parse_then_stop)
        try:
            module.main(argv)
        except Parsed:
            return None
        except SystemExit:  # the program's one `error:` line
            return stderr.getvalue().strip() or "exited before parsing"
    return "returned without parsing its arguments"


def test_the_guides_show_commands_of_every_program():
    programs = {program for command in COMMANDS for program, _ in program_commands(command.values[1])}
    assert programs == {"tiny_lm", "prepare", "sample", "export", "serve", "compare", "attention_maps",
                        "distill_draft"}


@pytest.mark.parametrize("document, line", COMMANDS)
def test_each_command_line_is_one_its_program_accepts(document, line, monkeypatch):
    refused = [f"train.{program}: {error}" for program, argv in program_commands(line)
               if (error := parse_only(program, argv, monkeypatch)) is not None]
    assert refused == []


def test_a_command_with_a_flag_its_program_lacks_is_refused(monkeypatch):
    assert parse_only("sample", ["--checkpoint", "runs/x", "--out-dir", "y"], monkeypatch) is not None
    assert parse_only("export", ["--checkpoint", "runs/x"], monkeypatch) is not None  # --out is required
    assert parse_only("no_such_program", [], monkeypatch) is not None
    assert parse_only("export", ["--checkpoint", "runs/x", "--out", "y"], monkeypatch) is None


def test_shell_lines_are_split_into_each_programs_arguments():
    line = """echo "JULIET:" | python -m train.sample --checkpoint runs/a --top-k 40  # three samples"""
    assert program_commands(line) == [("sample", ["--checkpoint", "runs/a", "--top-k", "40"])]
    assert program_commands('make train ARGS="--set train.max_iters=5 --out-dir runs/b"') == [
        ("tiny_lm", ["--set", "train.max_iters=5", "--out-dir", "runs/b"])]


# ----------------------------------------------------------------------------- links

def prose(path: Path) -> str:
    """The document without its code blocks and inline code, where brackets are not links."""
    return re.sub(r"`[^`\n]*`", "", FENCE.sub("", path.read_text()))


def links(path: Path) -> list[str]:
    return re.findall(r"\]\(([^)\s]+)\)", prose(path))


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a document's headings; a repeated heading's get -1, -2, ... as on GitHub."""
    found, times = set(), {}
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", FENCE.sub("", path.read_text()), flags=re.M):
        base = slug(heading)
        found.add(f"{base}-{times[base]}" if base in times else base)
        times[base] = times.get(base, 0) + 1
    return found


def broken_link(document: Path, target: str) -> str | None:
    if re.match(r"[a-z][a-z+.-]*:", target):  # https:, mailto:: not checked here
        return None
    path_part, _, anchor = target.partition("#")
    linked = (document.parent / path_part).resolve() if path_part else document
    if not linked.exists():
        return "no such file"
    if anchor and linked.suffix == ".md" and anchor not in anchors(linked):
        return f"no heading with the anchor #{anchor}"
    return None


@pytest.mark.parametrize("document", [name(p) for p in every_document()])
def test_every_relative_link_points_to_something_that_exists(document):
    path = ROOT / document
    broken = [f"{target}: {why}" for target in links(path) if (why := broken_link(path, target))]
    assert broken == []


def test_every_guide_is_linked_from_the_readme_or_another_guide():
    linked = {(p.parent / t.partition("#")[0]).resolve() for p in every_document() for t in links(p)}
    assert [name(p) for p in sorted(DOCS.glob("*.md")) if p.resolve() not in linked] == []


def test_the_link_checker_finds_what_is_broken(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("# A title: with (punctuation)\n\n## A title: with (punctuation)\n\nsee `[x](nowhere.md)`\n")
    assert anchors(doc) == {"a-title-with-punctuation", "a-title-with-punctuation-1"}
    assert links(doc) == []
    assert broken_link(doc, "#a-title-with-punctuation") is None
    assert broken_link(doc, "#missing") is not None
    assert broken_link(doc, "other.md") == "no such file"
    assert broken_link(doc, "https://example.com/x.md") is None
