"""The house's shape: imports only go downward (openai_frontend -> serving -> engine -> kernels;
Triton models and benchmarks -> serving), nothing under engine/ or kernels/ imports Triton, and no import cycles among the
project's modules. Read from the sources (ast), nothing imported."""
from __future__ import annotations

import ast
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


def imports_of(path: str, *, module_level_only: bool) -> set[str]:
    """Absolute names imported by the file (``from a.b import c`` gives a.b and a.b.c)."""
    tree = ast.parse(open(path).read(), path)
    nodes = list(_outside_functions(tree)) if module_level_only else list(ast.walk(tree))
    names = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


MODULES = project_modules()


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_only_go_downward(module):
    layer = LAYERS[module.split(".")[0]]
    for name in imports_of(MODULES[module], module_level_only=False):
        top = name.split(".")[0]
        assert LAYERS.get(top, -1) <= layer, f"{module} imports {name}: a higher layer"
        if top in ("engine", "kernels") or module.split(".")[0] in ("engine", "kernels"):
            assert not name.startswith(TRITON_SERVER_MODULES), f"{module} imports {name}"


def test_no_import_cycles():
    graph = {m: {n for n in imports_of(p, module_level_only=True) if n in MODULES and n != m}
             for m, p in MODULES.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                cycle = path[path.index(target):] + [target]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def test_nothing_imports_the_openai_frontend():
    """The frontend is the top of the stack: the Triton models, benchmarks, scripts and tools run
    it as a process (``python -m openai_frontend``) at most, never import it."""
    for top in ("all_models", "benchmarks", "scripts", "tools"):
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            for name in (f for f in files if f.endswith(".py")):
                path = os.path.join(folder, name)
                imported = {n for n in imports_of(path, module_level_only=False) if n.split(".")[0] == "openai_frontend"}
                assert not imported, f"{os.path.relpath(path, ROOT)} imports {sorted(imported)}"
