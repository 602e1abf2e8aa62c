"""The packages' import graph: the kernels stand alone, and no module reaches itself through imports."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kitty_core", "kernels")


def _modules() -> dict[str, Path]:
    found = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).glob("*.py")):
            found[pkg if path.stem == "__init__" else f"{pkg}.{path.stem}"] = path
    return found


def _runtime_nodes(tree: ast.AST):
    """Every node of a module but those under `if TYPE_CHECKING:` (names for annotations, never imported)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            yield from (n for part in node.orelse for n in [part, *_runtime_nodes(part)])
            continue
        yield node
        yield from _runtime_nodes(node)


def import_graph() -> dict[str, set[str]]:
    """module -> the project's modules it imports when it runs, at the top or inside a function alike."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        package = name if path.stem == "__init__" else name.rpartition(".")[0]
        targets = set()
        for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = f"{package}.{base}" if base else package
                targets |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
            elif isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def test_the_kernels_import_nothing_of_the_library():
    reach = {m: sorted(t for t in ts if t.split(".")[0] == "kitty_core")
             for m, ts in import_graph().items() if m.split(".")[0] == "kernels"}
    assert {m: ts for m, ts in reach.items() if ts} == {}


def test_no_module_imports_itself_through_others():
    assert cycles(import_graph()) == []


def test_the_graph_sees_relative_and_function_level_imports():
    graph = import_graph()
    assert "kitty_core.triton_engine" in graph["kitty_core.engines"]  # inside `make_engine`
    assert "kitty_core.cache" not in graph["kitty_core.layer"]  # only under TYPE_CHECKING
    assert "kernels.decode" in graph["kitty_core.triton_engine"]  # imported inside functions or at the top
    assert "kernels.state" in graph["kernels.decode"]  # `from .state import ...`
