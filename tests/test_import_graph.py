"""The packages of kvtrain/ and data_tools/ import one way: no import cycle.

The graph is read from the sources with ``ast`` (module-level and
function-level imports alike, since a lazy import inside a function is still a
dependency), at package level: ``kvtrain.<sub>`` for kvtrain's subpackages
and modules, ``data_tools`` as one node. A strongly connected component of
more than one node is a cycle.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kvtrain", "data_tools")


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every module of PACKAGES."""
    mods = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            name = ".".join(path.relative_to(root).with_suffix("").parts)
            mods[name.removesuffix(".__init__")] = path
    return mods


def imported(module: str, path: Path, node: ast.AST, mods: dict[str, Path]) -> list[str]:
    """The modules of ``mods`` an import statement names (``from a import b``
    names ``a`` and, when ``b`` is a module, ``a.b``)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in mods]
    assert isinstance(node, ast.ImportFrom)
    if node.level:
        base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        name = ".".join(base + ([node.module] if node.module else []))
    else:
        name = node.module or ""
    return [c for c in [name] + [f"{name}.{a.name}" for a in node.names] if c in mods]


def node_of(module: str) -> str:
    """The graph node of a module: ``kvtrain.<sub>`` or ``kvtrain`` / ``data_tools``."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "kvtrain" else parts[0]


def package_graph(root: Path = ROOT) -> dict[str, set[str]]:
    mods = module_files(root)
    graph: dict[str, set[str]] = defaultdict(set)
    for module, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in imported(module, path, node, mods):
                    if node_of(target) != node_of(module):
                        graph[node_of(module)].add(node_of(target))
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_cycle_finder_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle():
    found = cycles(package_graph())
    assert not found, f"import cycles between packages: {found}"


def test_layers_point_one_way():
    """config imports neither data nor train; the toy tasks are a leaf under
    config; data_tools never imports kvtrain."""
    graph = package_graph()
    assert not graph["kvtrain.config"] & {"kvtrain.data", "kvtrain.train", "kvtrain.experiments"}
    assert not graph["kvtrain.tasks"], graph["kvtrain.tasks"]
    assert not any(n.startswith("kvtrain") for n in graph["data_tools"])
    assert "kvtrain.experiments" not in graph["kvtrain.train"]


def test_checkpoint_uses_the_file_utility_not_the_shard_module():
    source = (ROOT / "kvtrain" / "train" / "checkpoint.py").read_text(encoding="utf-8")
    names = {n.module for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ImportFrom)}
    assert "data_tools.indexed" not in names
