"""The imports between lightning_trn's own modules: no cycle, and the packages layered one way.

The graph is read with `ast` from every `.py` file of the package, without importing it, so it holds on any backend.
An edge is any `import` / `from ... import` statement naming a lightning_trn module, at module level or inside a
function or method (a lazy import still ties the two modules together), with relative imports resolved.
`from package import name` points at the submodule `package.name` when there is one, else at the package's
`__init__`. Imports under `if TYPE_CHECKING:` are left out: they never run, so they cannot form a cycle at run time.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.both

PACKAGE = "lightning_trn"
#: found without importing the package: the graph is about the source, and must be readable even where an import fails
ROOT = Path(importlib.util.find_spec(PACKAGE).origin).parent


def _module_name(path: Path) -> str:
    parts = (PACKAGE, *path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in sorted(ROOT.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(node: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement under `node`, at any depth, except the bodies of `if TYPE_CHECKING:`."""
    found: list[ast.Import | ast.ImportFrom] = []
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            found.append(child)
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for branch in child.orelse:
                found.extend(_import_nodes(ast.Module(body=[branch], type_ignores=[])))
        else:
            found.extend(_import_nodes(child))
    return found


def _ours(name: str) -> str | None:
    """The most specific lightning_trn module that importing `name` runs (None for other packages)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _targets(module: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    if isinstance(node, ast.Import):
        return {target for alias in node.names if (target := _ours(alias.name))}
    base = node.module or ""
    if node.level:
        package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{base}" if base else package
    if not (base == PACKAGE or base.startswith(PACKAGE + ".")):
        return set()
    # `from package import submodule` imports the submodule; `from module import name` only the module
    return {_ours(f"{base}.{alias.name}") for alias in node.names} - {None}


def import_graph() -> dict[str, set[str]]:
    """lightning_trn module -> the lightning_trn modules it imports."""
    graph = {}
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        graph[module] = set().union(*(_targets(module, node) for node in _import_nodes(tree))) - {module}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as `[a, b, ..., a]`, or None (depth-first search, colouring the nodes on the path)."""
    on_path: list[str] = []
    state: dict[str, str] = {}  # "open" while on the path, "done" once every path from it is known to be acyclic

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        on_path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return on_path[on_path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        on_path.pop()
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def all_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per group of modules that import each other (strongly connected component), so a failure names
    every tangle at once, not only the first."""

    def reachable(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    reach = {node: reachable(node) for node in graph}
    cycles, placed = [], set()
    for node in sorted(graph):
        if node in reach[node] and node not in placed:
            component = {other for other in reach[node] if node in reach.get(other, ())}
            placed |= component
            cycles.append(find_cycle({m: graph[m] & component for m in component}))
    return cycles


def _violations(graph: dict[str, set[str]], layer: str, forbidden: tuple[str, ...]) -> list[str]:
    """`module -> target` for each import from `layer` into a `forbidden` one or into the package's own `__init__`
    (which imports every layer)."""

    def inside(module: str, package: str) -> bool:
        return module == package or module.startswith(package + ".")

    return sorted(
        f"{module} -> {target}"
        for module, targets in graph.items()
        if inside(module, f"{PACKAGE}.{layer}")
        for target in targets
        if target == PACKAGE or any(inside(target, f"{PACKAGE}.{above}") for above in forbidden)
    )


def test_graph_reader_sees_every_kind_of_import():
    """The reader itself: lazy and relative imports count, `TYPE_CHECKING` ones do not, every cycle is found."""
    tree = ast.parse(
        "import os\n"
        "from typing import TYPE_CHECKING\n"
        "from lightning_trn.core.checkpoint import checkpoint_io\n"
        "from . import xla\n"
        "from .collectives import Collectives\n"
        "if TYPE_CHECKING:\n"
        "    from lightning_trn.pytorch import precision\n"
        "else:\n"
        "    import lightning_trn.fabric.precision\n"
        "def f():\n"
        "    from lightning_trn.runtime import get_runtime\n"
    )
    targets = set().union(*(_targets("lightning_trn.runtime.xla_import", node) for node in _import_nodes(tree)))
    assert targets == {
        "lightning_trn.core.checkpoint.checkpoint_io",
        "lightning_trn.runtime.xla",
        "lightning_trn.runtime.collectives",
        "lightning_trn.fabric.precision",
        "lightning_trn.runtime",
    }
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": {"d"}, "f": {"a"}}
    assert all_cycles(graph) == [["a", "b", "c", "a"], ["d", "e", "d"]]
    assert all_cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_no_import_cycle():
    graph = import_graph()
    assert graph["lightning_trn.core.checkpoint.checkpoint_io"] >= {
        "lightning_trn.core.checkpoint.distributed_checkpoint"
    }
    cycles = all_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)


#: every top-level module and package of lightning_trn except the runtime: all of them sit above it
_ABOVE_RUNTIME = tuple(sorted({name.split(".")[1] for name in MODULES if name != PACKAGE} - {"runtime"}))


@pytest.mark.parametrize(
    ("layer", "forbidden"),
    [
        ("hooks", ("pytorch", "fabric")),
        ("core", ("hooks", "pytorch", "fabric", "recipes")),
        ("runtime", _ABOVE_RUNTIME),
    ],
)
def test_layers_import_downwards_only(layer, forbidden):
    violations = _violations(import_graph(), layer, forbidden)
    assert not violations, f"{layer}/ imports a layer above it:\n" + "\n".join(violations)
