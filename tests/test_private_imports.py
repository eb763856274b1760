"""No package of this repository imports another one's private module (a ``_name`` below its top level).

``ragged``, ``torch_backend``, ``jax_backend`` and ``experiments`` meet only through public names, so a
backend's internals can move without breaking a benchmark. Read from the source (ast), every import
statement, in functions too. The one exception is ``experiments/bug_injection.py``: it monkeypatches
backend internals on purpose (a bug is a patch of one private function). Tests are not checked: they
test internals.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("ragged", "torch_backend", "jax_backend", "experiments")
PATCHES_INTERNALS = {"experiments/bug_injection.py", "experiments/_bug_in_workers.py"}


def _imported(tree: ast.AST) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.append((node.lineno, node.module))
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return out


def _private(name: str) -> bool:
    return any(p.startswith("_") and not p.startswith("__") for p in name.split(".")[1:])


def test_no_package_imports_another_ones_private_module():
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            where = str(path.relative_to(ROOT))
            if where in PATCHES_INTERNALS:
                continue
            for line, name in _imported(ast.parse(path.read_text(), where)):
                top = name.split(".")[0]
                if top in PACKAGES and top != package and _private(name):
                    found.append(f"{where}:{line} imports {name}")
    assert not found, "\n".join(found)


def test_the_check_sees_a_private_import():
    tree = ast.parse("def f():\n    from torch_backend._collectives import Pending\n")
    assert [n for _, n in _imported(tree) if _private(n)] == [
        "torch_backend._collectives", "torch_backend._collectives.Pending"]
