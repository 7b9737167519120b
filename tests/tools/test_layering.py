"""The house's shape: imports only go downward (openai_frontend -> serving -> engine -> kernels;
Triton models and benchmarks -> serving), nothing under engine/ or kernels/ imports Triton, and no import cycles among the
project's modules, function-level (lazy) imports included. Read from the sources (ast), nothing imported."""
from __future__ import annotations

import ast
import functools
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# A package may import its own layer or lower; tritonllm (the command line) is the top: nothing imports it.
LAYERS = {"kernels": 0, "engine": 1, "serving": 2, "openai_frontend": 3, "tritonllm": 4}
TRITON_SERVER_MODULES = ("triton_python_backend_utils", "tritonclient", "tritonserver")


def project_modules() -> dict[str, str]:
    """Dotted module name -> file path, for every .py under the layered packages."""
    modules = {}
    for package in LAYERS:
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    dotted = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                    modules[dotted.removesuffix(".__init__")] = path
    return modules


def _outside_functions(node: ast.AST):
    """Nodes run at import time: everything but function bodies (``if TYPE_CHECKING:`` included,
    since a type checker follows those imports and a circle through them is still a circle)."""
    yield node
    for child in ast.iter_child_nodes(node):
        if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield from _outside_functions(child)


def imports_of(path: str, *, module_level_only: bool, module: str | None = None) -> set[str]:
    """Absolute names imported by the file (``from a.b import c`` gives a.b and a.b.c). ``module``:
    the file's dotted name, to resolve relative imports (``from .x import y`` in a.b.m gives a.b.x
    and a.b.x.y); without it they are skipped."""
    eager, every = _imports(path, module)
    return set(eager if module_level_only else every)


@functools.lru_cache(maxsize=None)
def _imports(path: str, module: str | None) -> tuple[frozenset[str], frozenset[str]]:
    """(names imported at import time, names imported anywhere) of the file: each file parsed once
    for this module's tests (import_graph asks for both, test_imports_only_go_downward for the second:
    three parses of every file until 2026-11-30, ~2 s)."""
    with open(path) as file:
        tree = ast.parse(file.read(), path)
    eager_nodes = {id(node) for node in _outside_functions(tree)}
    eager, every = set(), set()
    for node in ast.walk(tree):
        names = set()
        if isinstance(node, ast.Import):
            names = {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = _absolute_module(node, path, module)
            if base is not None:
                names = {base} | {f"{base}.{alias.name}" for alias in node.names}
        every |= names
        if id(node) in eager_nodes:
            eager |= names
    return frozenset(eager), frozenset(every)


def _absolute_module(node: ast.ImportFrom, path: str, module: str | None) -> str | None:
    """The absolute module an ``import from`` names; None for a relative one when ``module`` is not given."""
    if node.level == 0:
        return node.module
    if module is None:
        return None
    package = module.split(".") if path.endswith("__init__.py") else module.split(".")[:-1]
    package = package[:len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


MODULES = project_modules()


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_only_go_downward(module):
    layer = LAYERS[module.split(".")[0]]
    for name in imports_of(MODULES[module], module_level_only=False, module=module):
        top = name.split(".")[0]
        assert LAYERS.get(top, -1) <= layer, f"{module} imports {name}: a higher layer"
        if top in ("engine", "kernels") or module.split(".")[0] in ("engine", "kernels"):
            assert not name.startswith(TRITON_SERVER_MODULES), f"{module} imports {name}"


def import_graph() -> dict[str, dict[str, bool]]:
    """module -> {project module it imports: whether only inside functions (a lazy import)}, counting
    every import statement in the file: one run when a function is first called closes a circle as
    surely as one run at import time, it only hides it until then."""
    graph = {}
    for module, path in MODULES.items():
        eager = imports_of(path, module_level_only=True, module=module)
        every = imports_of(path, module_level_only=False, module=module)
        graph[module] = {name: name not in eager for name in every if name in MODULES and name != module}
    return graph


def import_cycles(graph: dict[str, dict[str, bool]]) -> list[list[str]]:
    """One circle [m0, m1, ..., m0] through each group of modules that import one another
    (each strongly connected component of more than one module, Tarjan's algorithm), shortest
    first from the group's first module by name."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def connect(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in sorted(graph[module]):
            if target not in index:
                connect(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            group = []
            while not group or group[-1] != module:
                group.append(stack.pop())
            if len(group) > 1:
                groups.append(sorted(group))

    for module in sorted(graph):
        if module not in index:
            connect(module)
    return [_shortest_circle(graph, group) for group in sorted(groups)]


def _shortest_circle(graph: dict[str, dict[str, bool]], group: list[str]) -> list[str]:
    """The shortest path from group[0] back to itself inside the group (breadth first)."""
    start, members = group[0], set(group)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for module in frontier:
            for target in sorted(graph[module]):
                if target == start:
                    path = [module]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [start] + path[::-1][1:] + [start]
                if target in members and target not in came_from:
                    came_from[target] = module
                    following.append(target)
        frontier = following
    raise AssertionError(f"no circle through {start} in {group}")


def describe_circle(graph: dict[str, dict[str, bool]], circle: list[str]) -> str:
    """'a -> b -[in a function]-> a': a step made only by a function-level import is marked so."""
    text = circle[0]
    for source, target in zip(circle, circle[1:]):
        text += (" -[in a function]-> " if graph[source][target] else " -> ") + target
    return text


def test_no_import_cycles():
    """No circle of imports among the project's modules, lazy (function-level) imports included:
    two modules that need each other's names share them through a module both import instead."""
    graph = import_graph()
    circles = [describe_circle(graph, circle) for circle in import_cycles(graph)]
    assert not circles, "import cycles:\n" + "\n".join(circles)


def test_the_cycle_finder_sees_lazy_imports():
    """The finder itself, on a made-up graph: a circle closed only by a function-level import is
    found and named; a chain without a way back is not a circle."""
    graph = {"kernels.a": {"kernels.b": False}, "kernels.b": {"kernels.c": False},
             "kernels.c": {"kernels.a": True}, "kernels.d": {"kernels.a": False}}
    assert import_cycles(graph) == [["kernels.a", "kernels.b", "kernels.c", "kernels.a"]]
    assert describe_circle(graph, import_cycles(graph)[0]) == \
        "kernels.a -> kernels.b -> kernels.c -[in a function]-> kernels.a"
    del graph["kernels.c"]["kernels.a"]
    assert import_cycles(graph) == []


def test_nothing_imports_the_openai_frontend():
    """The frontend is the top of the stack: the Triton models, benchmarks, scripts and tools run
    it as a process (``python -m openai_frontend``) at most, never import it."""
    for top in ("all_models", "benchmarks", "scripts", "tools"):
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            for name in (f for f in files if f.endswith(".py")):
                path = os.path.join(folder, name)
                imported = {n for n in imports_of(path, module_level_only=False) if n.split(".")[0] == "openai_frontend"}
                assert not imported, f"{os.path.relpath(path, ROOT)} imports {sorted(imported)}"
