"""peagle's own modules import each other one way: no import cycles, and no import up a layer or
across stages, read from the source (ast).

Every import statement counts: module level, inside ``if TYPE_CHECKING:`` and inside functions. A
cycle hidden behind ``TYPE_CHECKING`` or a function-level import still means two modules each need
the other's definitions, the knot this test exists to keep out (``stages/train/batch.py`` and
``methods/`` once were one). What is not counted is the implicit import of a parent package by a
submodule: a package's ``__init__`` listing its submodules, which import their siblings, is the
ordinary shape of a package, not a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "peagle"


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(name: str, source: str, is_package: bool, known: set[str]) -> set[str]:
    """The known modules that ``name``'s source imports, wherever the import statement sits.

    ``from a.b import c`` is an edge to ``a.b.c`` when that is a module, else to ``a.b``.
    """
    edges: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            edges.update(alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".") if is_package else name.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join(package + ([node.module] if node.module else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                if full in known:
                    edges.add(full)
                elif base in known:
                    edges.add(base)
    edges.discard(name)
    return edges


def import_graph(package: Path, root: Path) -> dict[str, set[str]]:
    paths = {module_name(path, root): path for path in sorted(package.rglob("*.py"))}
    known = set(paths)
    return {name: imported_modules(name, path.read_text(encoding="utf-8"), path.name == "__init__.py", known)
            for name, path in paths.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def test_peagle_has_no_import_cycles():
    graph = import_graph(PACKAGE, ROOT)
    assert len(graph) > 50 and "peagle.stages.train.batch" in graph
    cycles = find_cycles(graph)
    assert not cycles, "import cycles among peagle's modules:\n" + "\n".join(" <-> ".join(c) for c in cycles)


LAYERS = ("schemas", "pipeline", "model", "stages", "demo", "cli", "testing")
"""peagle's layers, lowest first (docs/README.md): a module imports its own layer and those below it.
``testing`` is the top: fixtures and fault helpers that only tests use, so no product module imports it."""


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Imports up a layer, and imports between two stages (stages never import each other)."""
    def layer(name: str) -> str | None:
        parts = name.split(".")
        return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None

    found = []
    for module, imported in sorted(graph.items()):
        for other in sorted(imported):
            mine, theirs = layer(module), layer(other)
            if mine is None or theirs is None:
                continue
            if LAYERS.index(theirs) > LAYERS.index(mine):
                found.append(f"{module} imports {other}: up from {mine} to {theirs}")
            elif mine == theirs == "stages" and module.split(".")[2] != other.split(".")[2]:
                found.append(f"{module} imports {other}: one stage imports another")
    return found


def test_no_module_imports_up_a_layer_or_another_stage():
    graph = import_graph(PACKAGE, ROOT)
    assert {name.split(".")[1] for name in graph if name.count(".")} - {"__main__"} == set(LAYERS)
    assert not layer_violations(graph), "\n".join(layer_violations(graph))


def test_the_layer_check_sees_an_upward_import_and_one_between_stages():
    graph = {"peagle.pipeline.store": {"peagle.testing.store_faults", "peagle.schemas.store"},
             "peagle.stages.eval.run": {"peagle.stages.train.loop", "peagle.stages.eval.report", "peagle.model.draft"},
             "peagle.cli.demo": {"peagle.demo.target"}}
    assert layer_violations(graph) == [
        "peagle.pipeline.store imports peagle.testing.store_faults: up from pipeline to testing",
        "peagle.stages.eval.run imports peagle.stages.train.loop: one stage imports another"]


def test_the_finder_sees_cycles_behind_type_checking_and_in_functions(tmp_path):
    """The finder itself: a cycle through a TYPE_CHECKING import and one through a function-level
    import are both found; a package __init__ listing submodules that import each other is not one."""
    files = {
        "pkg/__init__.py": "from pkg.a import A\nfrom pkg.c import C\n",
        "pkg/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\nA = 1\n",
        "pkg/b.py": "from pkg import a\nB = 2\n",
        "pkg/c.py": "from .d import D\nC = 3\n",
        "pkg/d.py": "def f():\n    from . import c\nD = 4\n",
        "pkg/e.py": "from pkg.a import A\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    graph = import_graph(tmp_path / "pkg", tmp_path)
    assert graph["pkg.b"] == {"pkg.a"} and graph["pkg.d"] == {"pkg.c"}
    assert sorted(find_cycles(graph)) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.d"]]
