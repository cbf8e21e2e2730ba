"""docs/theory.md cites functions and tests: every citation must exist; its python blocks run."""

import ast
import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
THEORY = (ROOT / "docs" / "theory.md").read_text()


def test_every_cited_test_exists():
    cited = sorted(set(re.findall(r"`(tests/(?:\w+/)?test_\w+\.py)::(test_\w+)`", THEORY)))
    assert len(cited) > 40
    missing = []
    for path, name in cited:
        tree = ast.parse((ROOT / path).read_text())
        names = {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
        if name not in names:
            missing.append(f"{path}::{name}")
    assert missing == []


def test_every_cited_function_exists():
    cited = sorted(set(re.findall(r"`(jaxattn(?:\.\w+)+)`", THEORY)))
    assert len(cited) > 20
    missing = []
    for dotted in cited:
        parts = dotted.split(".")
        for split in range(len(parts), 0, -1):  # the longest importable module, then attributes
            try:
                obj = importlib.import_module(".".join(parts[:split]))
            except ModuleNotFoundError:
                continue
            for attr in parts[split:]:
                obj = getattr(obj, attr, None)
            break
        if obj is None:
            missing.append(dotted)
    assert missing == []


def test_the_sections_docstrings_cite_exist():
    sections = {int(n) for n in re.findall(r"^## (\d+)\.", THEORY, flags=re.M)}
    cited = set()
    for path in list((ROOT / "jaxattn").rglob("*.py")) + list((ROOT / "train").rglob("*.py")):
        cited |= {int(n) for n in re.findall(r"docs/theory\.md §(\d+)", path.read_text())}
        cited |= {int(n) for match in re.findall(r"docs/theory\.md §(\d+)-§(\d+)", path.read_text())
                  for n in range(int(match[0]), int(match[1]) + 1)}
    assert sections == set(range(1, 29)) and cited <= sections


def test_the_theory_python_blocks_run():
    """docs/theory.md's python blocks (§26's quantized matrix) run as written, in one namespace."""
    blocks = re.findall(r"^```python\n(.*?)^```", THEORY, flags=re.S | re.M)
    assert blocks
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "docs/theory.md", "exec"), namespace)  # noqa: S102 - the document's own code
