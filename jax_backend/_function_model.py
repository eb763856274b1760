"""A pure function ``apply(params, inputs)`` as ``FSDP``'s model (``ShardedModel``), on gathered units.

Units are pytree path prefixes (``"layers.0"``); every parameter outside them is the root unit's. Inside
the step's ``shard_map`` the function gets a params pytree whose unit subtrees are gathered on first access:
dicts, lists and tuples on the way to a unit are read-only views until then. A unit stays gathered for the
backward (there is no unit call to re-gather in).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax

from jax_backend._names import flatten_params, fqn
from jax_backend._units import UnitError, Units, refuse_non_float


class _LazyMapping(Mapping):
    """A read-only dict of the params pytree whose unit entries are gathered on first access."""

    def __init__(self, items: dict, resolve: Callable):
        self._items, self._resolve = items, resolve

    def __getitem__(self, key: Any) -> Any:
        return self._resolve(self._items[key])

    def __iter__(self) -> Iterator:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


class _LazySequence(Sequence):
    """A read-only list / tuple of the params pytree whose unit entries are gathered on first access."""

    def __init__(self, items: list, resolve: Callable):
        self._items, self._resolve = items, resolve

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self._resolve(x) for x in self._items[index]]
        return self._resolve(self._items[index])

    def __len__(self) -> int:
        return len(self._items)


class _UnitRef:
    def __init__(self, unit: str, subtree: Any):
        self.unit, self.subtree = unit, subtree


class FunctionModel:
    """A pure function ``apply(params, x)`` on gathered units (a ``ShardedModel``).

    Args:
        apply: the function; params: its params pytree (arrays or ``jax.ShapeDtypeStruct``).
        units: pytree path prefixes, one per unit; root: the unit of every other parameter.

    Raises:
        UnitError: a prefix that matches no parameter, overlapping units, a unit inside a pytree node
            other than a dict, list or tuple, a parameter that is not floating point.
    """

    def __init__(self, apply: Callable, params: Any, units: str | Sequence[str], root: str):
        self.apply, self.root = apply, root
        leaves = jax.tree_util.tree_flatten_with_path(params)[0]
        self.fqns = [fqn(path) for path, _ in leaves]
        self.tree = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
        self.shapes = {n: (tuple(a.shape), a.dtype) for n, (_, a) in zip(self.fqns, leaves)}
        refuse_non_float(self.shapes, "pass it with the inputs instead")
        self.state: dict = {}  # a pure function keeps no state besides its params
        prefixes = [units] if isinstance(units, str) else list(units)
        self.units, self.owner = [], {n: root for n in self.fqns}
        for prefix in prefixes:
            hits = [n for n in self.fqns if n == prefix or n.startswith(prefix + ".")]
            if not hits:
                raise UnitError(f"unit path {prefix!r} matches no parameter (params: {self.fqns[:8]} ...)")
            taken = [n for n in hits if self.owner[n] != root]
            if taken:
                raise UnitError(f"unit {prefix!r} overlaps unit {self.owner[taken[0]]!r} at {taken[0]!r}")
            self.units.append(prefix)
            self.owner.update({n: prefix for n in hits})
        self.skeleton = self._skeleton(params, "")

    def _skeleton(self, node: Any, prefix: str) -> Any:
        """The params pytree with each unit's subtree replaced by a ``_UnitRef`` (a unit root is a path
        prefix, so it is the node at that path)."""
        if prefix in self.units:
            return _UnitRef(prefix, node)
        join = (lambda k: f"{prefix}.{k}" if prefix else str(k))
        if isinstance(node, dict):
            return {k: self._skeleton(v, join(k)) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return type(node)(self._skeleton(v, join(i)) for i, v in enumerate(node))
        inner = [n for n in self.fqns if n.startswith(prefix + ".") and self.owner[n] != self.root]
        if inner:
            raise UnitError(f"unit {self.owner[inner[0]]!r} lies inside a {type(node).__name__} at "
                            f"{prefix!r}; unit paths may only pass through dicts, lists and tuples")
        return node

    def flatten(self, params: Any) -> dict[str, jax.Array]:
        return flatten_params(params)

    def split_state(self, params: Any) -> dict:
        return {}

    def forward(self, units: Units, state: dict, inputs: Any) -> tuple[Any, dict]:
        root = units.gather(self.root) if self.root in units.layouts else {}
        gathered: dict[str, Any] = {}

        def values(node: Any, prefix: str, table: Mapping[str, jax.Array]) -> Any:
            paths = jax.tree_util.tree_flatten_with_path(node)[0]
            full = [table[f"{prefix}.{fqn(p)}" if fqn(p) else prefix] for p, _ in paths]
            return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(node), full)

        def view(node: Any, prefix: str) -> Any:
            join = (lambda k: f"{prefix}.{k}" if prefix else str(k))
            if isinstance(node, _UnitRef):
                if node.unit not in gathered:
                    gathered[node.unit] = values(node.subtree, node.unit, units.gather(node.unit))
                return gathered[node.unit]
            if isinstance(node, dict):
                return _LazyMapping({k: (v, join(k)) for k, v in node.items()}, lambda kv: view(*kv))
            if isinstance(node, (list, tuple)):
                return _LazySequence([(v, join(i)) for i, v in enumerate(node)], lambda kv: view(*kv))
            return values(node, prefix, root)

        return self.apply(view(self.skeleton, ""), inputs), state
