"""The package's layout: no module imports another in a circle, and ghost internals stay inside.

The import graph is read from the source (every ``import`` and ``from ... import``
statement, also inside functions and ``if TYPE_CHECKING:`` blocks), so a circle
that Python happens to tolerate at import time still counts.
"""

import ast
from pathlib import Path

import dpfunc

PACKAGE = Path(dpfunc.__file__).parent
# what the rest of dpfunc may import of dpfunc.ghost: its public API and the rule registry
GHOST_PUBLIC = {"dpfunc.ghost", "dpfunc.ghost.registry"}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported(name: str) -> set[str]:
    """The dpfunc modules that module ``name`` imports anywhere in its source."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1] + [node.module or ""]
                base = ".".join(p for p in parts if p)
            else:
                base = node.module or ""
            # ``from .x import y`` imports the submodule x.y when there is one, else x
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base
                for alias in node.names
            ]
        else:
            continue
        found.update(t for t in targets if t in MODULES and t != name)
    return found


GRAPH = {name: imported(name) for name in MODULES}


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One circle of imports as ``[a, b, ..., a]``, or ``[]`` when the graph is acyclic."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" after

    def visit(node: str, path: list[str]) -> list[str]:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return path[path.index(nxt) :] + [node, nxt] if nxt in path else [node, nxt]
            if nxt not in state:
                cycle = visit(nxt, path + [node])
                if cycle:
                    return cycle
        state[node] = "done"
        return []

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node, [])
            if cycle:
                return cycle
    return []


def test_the_reader_sees_the_imports_python_sees():
    assert "dpfunc.ghost" in GRAPH["dpfunc.step"]  # from .ghost import ...
    assert "dpfunc.optim" in GRAPH["dpfunc.step"]  # from . import optim
    assert "dpfunc.clipping" in GRAPH["dpfunc.ghost.runtime"]  # from ..clipping import ...
    assert "dpfunc.ghost.linear" in GRAPH["dpfunc.ghost"]  # from . import (linear, ...)
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


def test_the_import_graph_has_no_circle():
    cycle = find_cycle(GRAPH)
    assert not cycle, "import circle: " + " -> ".join(cycle)


def test_only_the_ghost_package_imports_its_internals():
    reaching_in = {
        name: sorted(t for t in targets if t.startswith("dpfunc.ghost.") and t not in GHOST_PUBLIC)
        for name, targets in GRAPH.items()
        if not name.startswith("dpfunc.ghost")
    }
    assert not {name: ts for name, ts in reaching_in.items() if ts}
