"""The package's layout: no module imports another in a circle, ghost internals stay inside,
private modules (a leading underscore) declare no ``__all__``, and the size limits a reader
relies on hold.

The import graph is read from the source (every ``import`` and ``from ... import``
statement, also inside functions and ``if TYPE_CHECKING:`` blocks), so a circle
that Python happens to tolerate at import time still counts. The size limits are
read from the source too (``ast``): ``dpfunc/trainer.py`` under 400 lines, no
function body over 80 lines, no public function with more than 15 parameters.
"""

import ast
import importlib
import inspect
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
    assert "dpfunc.ghost" in GRAPH["dpfunc.clipper"]  # from .ghost import ...
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


def defines_all(path: Path) -> bool:
    """Whether the module at ``path`` assigns ``__all__`` at its top level."""
    for node in ast.parse(path.read_text(), str(path)).body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            return True
    return False


def test_private_modules_export_nothing():
    """A module named with a leading underscore is internal: it declares no ``__all__``."""
    private = {name for name in MODULES if name.rpartition(".")[2].startswith("_")}
    assert {"dpfunc._checks", "dpfunc._compiling", "dpfunc._plan"} <= private
    assert sorted(name for name in private if defines_all(MODULES[name])) == []
    assert defines_all(MODULES["dpfunc"]) and defines_all(MODULES["dpfunc.trainer"])


# -- size limits ---------------------------------------------------------------------------

TRAINER_MAX_LINES = 399  # under 400
BODY_MAX_LINES = 80
PUBLIC_MAX_PARAMETERS = 16  # the Trainer: its run options named (users= is the 16th), none hidden
FunctionNode = ast.FunctionDef | ast.AsyncFunctionDef


def body_lines(function: FunctionNode) -> int:
    """Lines from the first statement after the docstring to the function's last line.

    The signature, decorators and docstring do not count; nested functions and
    comments between statements do (they are read as part of the body).
    """
    body = function.body
    first = body[0]
    if len(body) > 1 and isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
        body = body[1:] if isinstance(first.value.value, str) else body  # the docstring
    return function.end_lineno - body[0].lineno + 1


def parameter_count(function: FunctionNode) -> int:
    """Positional, keyword-only, ``*args``, ``**kwargs``: one each; ``self`` and ``cls``: none."""
    arguments = function.args
    names = [a.arg for a in arguments.posonlyargs + arguments.args + arguments.kwonlyargs]
    names += [a.arg for a in (arguments.vararg, arguments.kwarg) if a is not None]
    return len([name for name in names if name not in ("self", "cls")])


def functions(tree: ast.Module):
    """``(qualified name, node, public)`` for every function in ``tree``, nested ones included.

    Public: a module-level function or a method of a module-level class whose
    names do not start with ``_``; a public class's ``__init__`` and ``__call__``
    are public too (their parameters are the class's call signature). Functions
    nested in functions are not.
    """

    def visit(node, prefix, public_scope):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                public = public_scope and not child.name.startswith("_")
                yield from visit(child, f"{prefix}{child.name}.", public)
            elif isinstance(child, FunctionNode):
                in_class = isinstance(node, ast.ClassDef)
                named = not child.name.startswith("_") or (
                    in_class and child.name in ("__init__", "__call__")
                )
                yield f"{prefix}{child.name}", child, public_scope and named
                yield from visit(child, f"{prefix}{child.name}.", False)

    yield from visit(tree, "", True)


FUNCTIONS = [
    (f"{name}.{qualified}", node, public)
    for name, path in MODULES.items()
    for qualified, node, public in functions(ast.parse(path.read_text(), str(path)))
]


def test_the_size_measures_read_the_source_as_described():
    source = '''
def f(a, /, b, *args, c, d=1, **kwargs):
    """Docstring
    of three lines.
    """
    x = 1

    def _g(self):
        return x

    return _g


class A:
    def __init__(self, a):
        pass

    def run(cls, a, b):
        return a

    def _helper(self, a):
        pass


class _B:
    def run(self):
        pass
'''
    found = {name: node for name, node, _ in functions(ast.parse(source))}
    public = sorted(name for name, _, is_public in functions(ast.parse(source)) if is_public)
    assert public == ["A.__init__", "A.run", "f"]
    assert "f._g" in found and "_B.run" in found
    assert body_lines(found["f"]) == 6  # from ``x = 1`` to ``return _g``
    assert body_lines(found["f._g"]) == 1
    assert parameter_count(found["f"]) == 6
    assert parameter_count(found["f._g"]) == 0
    assert parameter_count(found["A.run"]) == 2


def test_the_trainer_module_is_under_400_lines():
    lines = len((PACKAGE / "trainer.py").read_text().splitlines())
    assert lines <= TRAINER_MAX_LINES, f"dpfunc/trainer.py has {lines} lines"


def test_no_function_body_is_over_80_lines():
    """Every function, method and nested function, counted as :func:`body_lines` says."""
    long = {name: body_lines(node) for name, node, _ in FUNCTIONS}
    assert {name: n for name, n in long.items() if n > BODY_MAX_LINES} == {}
    assert max(long.values()) > 20  # the measure sees the package's functions


def test_no_public_function_has_more_than_15_parameters():
    counts = {name: parameter_count(node) for name, node, public in FUNCTIONS if public}
    assert {name: n for name, n in counts.items() if n > PUBLIC_MAX_PARAMETERS} == {}
    assert "dpfunc.trainer.Trainer.__init__" in counts
    assert "dpfunc.step.make_train_step" in counts


# -- the step's doors and the public surface ------------------------------------------------

# a logical batch in one micro-batch, in many, and the private gradient without the optimizer
STEP_DOORS = {"__call__", "logical_step", "logical_gradient"}
STEP_METHODS = STEP_DOORS | {"init", "compile", "explain", "draw_noise", "full_params"}
STEP_METHOD_MAX_LINES = 40
# ceilings, not targets: a new public name is a decision, made here
TOP_LEVEL_NAMES = 39  # dpfunc.__all__
# every public module's __all__ together, dpfunc's own (260: tune.Best, what a search releases;
# 263: datasets.Collated, per-step collation, and PrivateTrainer's BucketPadding, bucket_length;
# 268: user-level privacy, dpfunc.users' four and accounting.example_sampling_user_epsilon)
PUBLIC_NAMES = 268


def test_the_train_step_has_two_doors_and_the_gradient_only_one():
    methods = {
        name
        for name, value in vars(dpfunc.TrainStep).items()
        if callable(value) and (not name.startswith("_") or name in STEP_DOORS)
    }
    assert methods == STEP_METHODS
    takes_batches = {
        name
        for name in methods
        if {"batch", "micro_batches"}
        & set(inspect.signature(getattr(dpfunc.TrainStep, name)).parameters)
    }
    assert takes_batches == STEP_DOORS | {"explain"}  # explain plans, it releases nothing


def test_no_train_step_method_is_over_40_lines():
    methods = {
        name: body_lines(node)
        for name, node, _ in FUNCTIONS
        if name.startswith("dpfunc.step.TrainStep.")
    }
    assert len(methods) > 10
    assert {name: n for name, n in methods.items() if n > STEP_METHOD_MAX_LINES} == {}


def test_the_public_names_are_counted():
    public = [name for name in MODULES if not any(p.startswith("_") for p in name.split(".")[1:])]
    exported = {name: importlib.import_module(name).__dict__.get("__all__", ()) for name in public}
    assert len(dpfunc.__all__) <= TOP_LEVEL_NAMES
    assert sum(len(names) for names in exported.values()) <= PUBLIC_NAMES
    assert len(exported["dpfunc.clipper"]) > 0  # the measure reads the modules' __all__


def test_no_public_function_hides_options_in_a_dict():
    """Keyword forms are ``**settings`` (DPConfig's and SpeedConfig's fields, split by one
    function); no public function takes ``**options`` to pop run options out of."""
    kwargs = {
        name: node.args.kwarg.arg
        for name, node, public in FUNCTIONS
        if public and node.args.kwarg is not None
    }
    assert "options" not in kwargs.values(), kwargs
    assert kwargs["dpfunc.trainer.Trainer.__init__"] == "settings"
    assert "OPTIONS" not in vars(importlib.import_module("dpfunc.trainer"))
