"""The import graph of ``ragged``: no circle, and sub-packages depend on the core, never the reverse.

The graph is read from the source (ast), not from ``sys.modules``, so a circle that happens to import
fine in today's order still fails. What counts as an edge ``a -> b``:

- every ``import`` / ``from ... import`` outside function bodies (module level, including those under
  ``if TYPE_CHECKING:`` or ``try:``): they run, or are read, when ``a`` is imported;
- importing ``ragged.x.y`` also runs the package ``ragged.x``'s ``__init__`` first, so it is an edge to
  every enclosing package too, except those that enclose ``a`` itself (they are already running);
- ``from pkg import name`` is an edge to ``pkg.name`` when that is a module, else to ``pkg``.

Imports inside a function run on its first call, after every module is loaded, so they cannot fail
an import; they still make the code read in a circle, so with them added the graph must stay acyclic
too, but for the one deferred import from the core up into a sub-package listed below.
"""

from __future__ import annotations

import ast
from pathlib import Path

import ragged

ROOT = Path(ragged.__file__).parent
# The one deferred import from the core up into a sub-package: Jupyter's picture of a Layout.
DEFERRED_UP = {("ragged._layout", "ragged.viz")}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _package(module: str) -> str:
    """The package a module's relative imports resolve against."""
    return module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]


def _targets(module: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    """The ``ragged`` modules an import statement in ``module`` names."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            pkg = _package(module).split(".")
            base = ".".join(pkg[: len(pkg) - node.level + 1] + ([base] if base else []))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
    return {n for n in names if n in MODULES}


def _with_packages(module: str, target: str) -> set[str]:
    """``target`` and the packages that enclose it (they run first), less those enclosing ``module``."""
    parts = target.split(".")
    chain = {".".join(parts[:k]) for k in range(1, len(parts) + 1)}
    mine = {".".join(module.split(".")[:k]) for k in range(1, len(module.split(".")) + 1)}
    if MODULES[module].name == "__init__.py":
        mine.add(module)
    return {m for m in chain - mine if m in MODULES and m != module}


def _imports(module: str) -> tuple[set[str], set[str]]:
    """(module-level edges, edges from imports inside functions) of ``module``."""
    tree = ast.parse(MODULES[module].read_text(), str(MODULES[module]))
    top: set[str] = set()
    deferred: set[str] = set()

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for target in _targets(module, child):
                    (deferred if in_function else top).update(_with_packages(module, target))
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            visit(child, inner)

    visit(tree, False)
    return top, deferred


def _core(module: str) -> bool:
    """The core: ``ragged`` itself and its top-level private modules (``ragged/_*.py``)."""
    return module == "ragged" or (module.count(".") == 1 and module.split(".")[1].startswith("_"))


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path ``[a, b, ..., a]``, or None (depth-first search, three colors)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := dfs(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := dfs(node)):
            return found
    return None


def test_the_graph_is_read_from_every_module() -> None:
    graph = {m: _imports(m)[0] for m in MODULES}
    # a sanity check of the reader itself: edges it must see, through each kind of import
    assert "ragged._layout" in graph["ragged._planner"]  # from ragged._layout import ...
    assert "ragged.viz" in graph["ragged.cli"]  # from ragged.viz import ... (a package)
    assert "ragged.viz._drawing" in graph["ragged.viz._picture"]  # a module inside the importer's package
    assert "ragged.models" in graph["ragged.bench._sweep"]  # the package __init__ runs first
    assert "ragged" not in graph["ragged._planner"]  # an enclosing package is already running
    assert ("ragged.viz" in _imports("ragged._layout")[1]) and "ragged.viz" not in graph["ragged._layout"]
    assert len(MODULES) > 30


def test_no_import_circle() -> None:
    graph = {m: _imports(m)[0] for m in MODULES}
    assert _cycle(graph) is None, f"import circle: {' -> '.join(_cycle(graph))}"


def test_no_circle_through_deferred_imports() -> None:
    graph = {m: top | {t for t in deferred if (m, t) not in DEFERRED_UP} for m in MODULES
             for top, deferred in [_imports(m)]}
    assert _cycle(graph) is None, f"import circle: {' -> '.join(_cycle(graph))}"


def test_the_cycle_finder_finds_one() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_core_never_imports_a_sub_package() -> None:
    """Sub-packages (``ragged.viz``, ``ragged.muon``, ...) build on the core; the core runs without them."""
    up = {(m, t) for m in MODULES if _core(m) for t in _imports(m)[0] if not _core(t)}
    assert up == set(), f"core modules importing sub-packages at module level: {sorted(up)}"
    deferred = {(m, t) for m in MODULES if _core(m) for t in _imports(m)[1] if not _core(t)}
    assert deferred == DEFERRED_UP
