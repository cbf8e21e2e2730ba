"""The house's sizes: no module of jaxattn/ or train/ over MODULE_LINES, no function over FUNCTION_LINES,
and every package's docstring names each of its modules (a registry's code lists them), so a newcomer
finds a room from its door.

A function's lines run from its first decorator to its last line, docstring included (what a reader
must hold in mind); a class is not a function, its methods are.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("jaxattn", "train")
MODULE_LINES = 400
FUNCTION_LINES = 60


def python_modules() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def function_lengths(path: Path) -> list[tuple[str, int]]:
    """("file:line name", lines) of every function and method of a module, nested ones included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            found.append((f"{path.name}:{node.lineno} {node.name}", node.end_lineno - first + 1))
    return found


def test_no_module_is_longer_than_the_limit():
    modules = python_modules()
    assert len(modules) > 100  # the tree was read
    long = {p.relative_to(ROOT).as_posix(): n for p in modules if (n := len(p.read_text().splitlines())) > MODULE_LINES}
    assert long == {}


def test_no_function_is_longer_than_the_limit():
    lengths = [(path.parent.relative_to(ROOT) / where, n) for path in python_modules()
               for where, n in function_lengths(path)]
    assert len(lengths) > 1000
    assert [f"{where}: {n} lines" for where, n in lengths if n > FUNCTION_LINES] == []


def test_the_length_counts_decorators_docstrings_and_nested_functions(tmp_path):
    module = tmp_path / "m.py"
    module.write_text('@decorator\ndef outer():\n    """Doc."""\n    def inner():\n        return 1\n    return inner\n')
    lengths = {where.rsplit(" ", 1)[1]: n for where, n in function_lengths(module)}
    assert lengths == {"outer": 6, "inner": 2}


def packages() -> list[Path]:
    return sorted(p.parent for package in PACKAGES for p in (ROOT / package).rglob("__init__.py"))


def members(package: Path) -> list[str]:
    """The modules and sub-packages of a package, by name, private ones left out."""
    names = [p.stem for p in package.glob("*.py") if p.stem != "__init__"]
    names += [p.name for p in package.iterdir() if (p / "__init__.py").is_file()]
    return sorted(n for n in names if not n.startswith("_"))


def test_every_package_docstring_names_its_modules():
    unnamed = {}
    for package in packages():
        source = (package / "__init__.py").read_text()
        # A registry (`jaxattn.hf.families`) lists its modules in its code, one line each, and imports them by name.
        doc = source if "importlib.import_module" in source else ast.get_docstring(ast.parse(source)) or ""
        missing = [name for name in members(package) if not re.search(rf"(?<![\w]){re.escape(name)}(?![\w])", doc)]
        if missing:
            unnamed[package.relative_to(ROOT).as_posix()] = missing
    assert len(packages()) >= 10 and unnamed == {}
