"""The floors of the code: the import graph of jaxattn/ and train/ has no circle, and generic code
asks no layer what it is.

Imports are read with `ast`, those inside functions and under `if TYPE_CHECKING:` included, so
an import moved into a function to dodge a circle is still seen. `from package import name`
imports the submodule `package.name` where there is one, else the package's `__init__`.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("jaxattn", "train")
# The modules that may branch on a mixture of experts: its own, its kernels, the configs that
# describe it and the checkpoint families that map their names onto it.
MOE_AWARE = ("jaxattn/layers/moe.py", "jaxattn/kernels/moe.py", "jaxattn/config/",
             "jaxattn/hf/families/")


def modules() -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, whether it is a package's `__init__`)."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {module it imports: the line of the first such import}, within `PACKAGES`."""
    known = modules()

    def resolve(name: str | None) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, (path, is_package) in known.items():
        package = name if is_package else name.rpartition(".")[0]
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
                source = ".".join(base + ([node.module] if node.module else []))
                targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in known else source
                           for alias in node.names]
            else:
                continue
            for target in map(resolve, targets):
                if target and target != name:
                    edges.setdefault(target, node.lineno)
        graph[name] = edges
    return graph


def circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_import_graph_has_no_circle():
    graph = import_graph()
    assert len(graph) > 80 and "jaxattn.axes" in graph["jaxattn.model"]  # the graph was read
    report = [f"{a} -> {b} (line {graph[a][b]})" for component in circles(graph)
              for a in component for b in graph[a] if b in component]
    assert report == []


def test_the_circle_finder_finds_circles():
    assert circles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}) == [["a", "b", "c"]]
    assert circles({"a": {"b": 1}, "b": {}}) == []


def _layer_classes() -> set[str]:
    """The Flax modules of jaxattn (classes deriving from `nn.Module` or from one of them)."""
    bases = {}
    for path in (ROOT / "jaxattn").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases[node.name] = {ast.unparse(b).rpartition(".")[2] for b in node.bases}
    layers, grown = {"Module", "Embed"}, True
    while grown:
        new = {name for name, parents in bases.items() if parents & layers} - layers
        layers |= new
        grown = bool(new)
    return layers - {"Module", "Embed"}


def test_generic_code_never_asks_a_layer_what_it_is():
    layers = _layer_classes()
    assert {"MoE", "MLP", "Attention", "MultiHeadLatentAttention", "Block"} <= layers
    asked = []
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if (isinstance(node, ast.Call) and ast.unparse(node.func) == "isinstance" and len(node.args) == 2
                        and {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)} & layers):
                    asked.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert asked == []


def _mentions_moe(node: ast.AST) -> bool:
    names = [n.id for n in ast.walk(node) if isinstance(n, ast.Name)]
    names += [n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)]
    return any("moe" in name.lower() for name in names)


def test_only_the_mixture_of_experts_own_modules_branch_on_it():
    branches = []
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            where = path.relative_to(ROOT).as_posix()
            if where.startswith(MOE_AWARE):
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                tests = [node.test] if isinstance(node, (ast.If, ast.IfExp, ast.While)) else []
                tests += node.ifs if isinstance(node, ast.comprehension) else []
                branches += [f"{where}:{node.lineno}: {ast.unparse(t)}" for t in tests if _mentions_moe(t)]
    assert branches == []


def _mentions(node: ast.AST, names: set[str]) -> bool:
    found = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
    found |= {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}
    return bool(found & names)


def test_the_caches_never_ask_which_attention_a_layer_has():
    """Each attention kind declares its cache (`cache_fields`, `cache_type`); the caches, the model, the
    mesh layout and the engine are built from that declaration, without a branch on the kind."""
    kinds = {"mla", "MLAConfig", "KVCache", "LatentCache", "Attention", "MultiHeadLatentAttention"}
    generic = ["jaxattn/cache/containers.py", "jaxattn/cache/build.py", "jaxattn/model.py", "jaxattn/model_checks.py",
               "jaxattn/layers/block.py", "jaxattn/sharding.py",
               *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "jaxattn" / "serving").rglob("*.py"))]
    asked = []
    for where in generic:
        for node in ast.walk(ast.parse((ROOT / where).read_text())):
            tests = [node.test] if isinstance(node, (ast.If, ast.IfExp, ast.While)) else []
            tests += node.ifs if isinstance(node, ast.comprehension) else []
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "isinstance":
                tests.append(node)
            asked += [f"{where}:{node.lineno}: {ast.unparse(t)}" for t in tests if _mentions(t, kinds)]
    assert len(generic) >= 8 and asked == []
