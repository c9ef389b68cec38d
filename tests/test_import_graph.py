"""No import circles in the installed packages, and none of them imports the research scripts of tools/.

Every ``import`` / ``from ... import`` of every module, wherever it stands (top level, inside a
function, under ``if TYPE_CHECKING:``), is an edge from that module to the module it names; an edge
to a package means its ``__init__``. A strongly connected component of more than one module is a
circle: the layering (transports <- collectives <- moe <- benchmarks) and each package's own
modules must import one way.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("transports", "collectives", "moe", "benchmarks")


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the packages (a package is its __init__)."""
    mods = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


def _targets(module: str, is_package: bool, node: ast.Import | ast.ImportFrom, mods: dict[str, Path]) -> list[str]:
    """The modules an import statement of ``module`` names (its names that are submodules, else the module)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        if node.level:
            base = module.split(".") if is_package else module.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        names = [f"{source}.{a.name}" if f"{source}.{a.name}" in mods else source for a in node.names]
    out = []
    for name in names:
        while name and name not in mods and "." in name:  # a name inside a module: the module
            name = name.rsplit(".", 1)[0]
        if name in mods and name != module:
            out.append(name)
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports."""
    mods = _modules()
    graph = {}
    for module, path in mods.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        edges = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges.update(_targets(module, path.name == "__init__.py", node, mods))
        graph[module] = edges
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root, edges in graph.items():
        if root in index:
            continue
        work = [(root, iter(sorted(edges)))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_the_walk_finds_a_circle():
    # the check itself: a made-up graph with one circle and a tail
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert circles(graph) == [["a", "b", "c"]]
    mods = {"p": Path("p/__init__.py"), "p.x": Path("p/x.py"), "p.y": Path("p/y.py")}
    node = ast.parse("from . import y\nfrom .. import p\nfrom .y import f").body
    assert _targets("p.x", False, node[0], mods) == ["p.y"]
    assert _targets("p.x", False, node[2], mods) == ["p.y"]


def test_the_installed_packages_never_import_tools():
    # tools/ (research scripts, not installed) may import the packages, never the other way round
    found = []
    for module, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            found += [f"{module} imports {name}" for name in names if name.split(".")[0] == "tools"]
    assert not found, "; ".join(found)


def test_no_import_circles():
    graph = import_graph()
    assert {"collectives.communicator", "moe.dispatcher", "benchmarks.cli"} <= set(graph)
    found = circles(graph)
    assert not found, "import circles (modules that import each other, directly or around a loop): " + "; ".join(
        " <-> ".join(c) for c in found)
