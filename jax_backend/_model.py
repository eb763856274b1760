"""``shard_model``: FSDP for any flax NNX module or pure function, running the model's own forward.

The user names the units; every parameter outside them goes to a root unit. Inside the step's
``shard_map`` the root unit is gathered first, then the model runs as written:

- NNX: each unit submodule's ``__call__`` is intercepted on the step's copy of the model. The call
  gathers the unit, binds the gathered arrays into the submodule's variables and runs the original
  ``__call__`` (with ``reshard_after_forward`` or ``remat`` as a custom VJP that re-gathers in the
  backward, so one unit is unsharded at a time). Parameters of other units are placeholders there that
  raise ``UnitError`` when read.
- Pure functions: ``apply(params, x)`` gets a params pytree whose unit subtrees are gathered on first
  access (dicts, lists and tuples are read-only views until then).

Shared parameters follow torch's rule: an ``nnx.Variable`` reachable from several places belongs to the
lowest unit containing every use (the root if a use lies outside the units); uses in two different units
are an error naming both.
"""

from __future__ import annotations

import fnmatch
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

import ragged
from jax_backend._buffers import (
    LayoutMismatchError,
    check_mesh,
)
from jax_backend._names import flatten_params, fqn
from jax_backend._step import FSDP, MixedPrecisionPolicy, Units
from ragged import Granularity, GranularityRule, Layout


class UnitError(LayoutMismatchError):
    """A unit that matches nothing, nests in another, or reads a parameter of another unit."""


def _dotted(path: Sequence[Any]) -> str:
    return ".".join(str(p) for p in path)


# ----- NNX ----------------------------------------------------------------------------------------------
def _variable_uses(model: nnx.Module) -> tuple[dict[int, list[str]], dict[str, nnx.Module]]:
    """Every path at which each ``nnx.Param`` is reachable (``{id: [path, ...]}``) and every submodule."""
    uses: dict[int, list[str]] = {}
    modules: dict[str, nnx.Module] = {}

    def walk(node: Any, path: tuple, stack: tuple[int, ...]) -> None:
        if isinstance(node, nnx.Variable):
            if isinstance(node, nnx.Param):
                uses.setdefault(id(node), []).append(_dotted(path))
            return
        if id(node) in stack or not nnx.graph.is_graph_node(node):
            return
        if isinstance(node, nnx.Module):
            modules.setdefault(_dotted(path), node)
        for key, child in nnx.graph.iter_children(node):
            walk(child, (*path, key), (*stack, id(node)))

    walk(model, (), ())
    return uses, modules


def _matches(path: str, pattern: str) -> bool:
    """``fnmatch`` per dotted segment: ``layers.*`` matches ``layers.3`` but not ``layers.3.norm``."""
    parts, pats = path.split("."), pattern.split(".")
    return len(parts) == len(pats) and all(fnmatch.fnmatchcase(a, b) for a, b in zip(parts, pats))


_MARKED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # by id: modules are not hashable


def fully_shard(module: nnx.Module) -> nnx.Module:
    """Mark ``module`` as an FSDP unit, as torch's ``fully_shard(layer)`` does; ``shard_model(model, mesh)``
    without ``units`` makes every marked submodule a unit. Returns ``module``.

    The mark is on the module object: mark the modules of the model you pass to ``shard_model``.
    """
    _MARKED[id(module)] = module
    return module


def _select_units(modules: Mapping[str, nnx.Module], units: Any) -> list[str]:
    """Unit paths from patterns (``"layers.*"``, one segment per ``*``), a predicate
    ``(path, module) -> bool``, or (``None``) the submodules marked by ``fully_shard``, in model order."""
    if units is None:
        chosen = [p for p, m in modules.items() if p and _MARKED.get(id(m)) is m]
        if not chosen:
            raise UnitError("no units: pass units= (paths or a predicate) or mark submodules with "
                            "fully_shard")
    elif callable(units):
        chosen = [p for p, m in modules.items() if p and units(p, m)]
        if not chosen:
            raise UnitError("the unit predicate matched no submodule")
    else:
        chosen = []
        for pattern in [units] if isinstance(units, str) else units:
            hits = [p for p in modules if p and _matches(p, pattern)]
            if not hits:
                sample = [p for p in modules if p][:8]
                raise UnitError(f"unit path {pattern!r} matches no submodule (submodules: {sample} ...)")
            chosen += [p for p in hits if p not in chosen]
    for a in chosen:
        for b in chosen:
            if a != b and b.startswith(a + "."):
                raise UnitError(f"unit {b!r} is nested in unit {a!r}; units must not nest")
    return chosen


def _owner(uses: list[str], units: Sequence[str], root: str, name: str) -> str:
    """torch's rule: the lowest unit containing every use of the parameter, the root if one lies outside."""
    owners = {next((u for u in units if p == u or p.startswith(u + ".")), root) for p in uses}
    inside = sorted(owners - {root})
    if len(inside) > 1:
        raise UnitError(
            f"parameter {name!r} is used by units {inside[0]!r} and {inside[1]!r} (at {uses}); a parameter "
            "shared by two units must belong to a unit containing both uses, or to the root"
        )
    return root if root in owners else inside[0]


class _Sharded:
    """Stands in for a parameter outside its unit's call: any use raises ``UnitError`` naming both."""

    def __init__(self, name: str, unit: str, shape: tuple[int, ...], dtype: Any):
        self.name, self.unit, self.shape, self.dtype = name, unit, shape, dtype

    def _fail(self, *_: Any, **__: Any) -> Any:
        raise UnitError(
            f"parameter {self.name!r} of unit {self.unit!r} was read outside unit {self.unit!r}'s own call "
            "(by the root or another unit); only the unit's __call__ sees it unsharded: make the reading "
            "module part of that unit, or leave the parameter out of the units (root)"
        )

    __jax_array__ = __array__ = __getitem__ = __iter__ = __len__ = _fail
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __matmul__ = __rmatmul__ = _fail
    __truediv__ = __neg__ = __pow__ = _fail

    @property
    def T(self) -> Any:  # noqa: N802
        return self._fail()

    def astype(self, *_: Any) -> Any:
        return self._fail()


_HOOKS: dict[int, Callable] = {}
_HOOKED: dict[type, type] = {}


def _hooked_class(cls: type) -> type:
    """A subclass of ``cls`` whose ``__call__`` goes to the active hook of the instance, if any."""
    if cls not in _HOOKED:
        def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
            hook = _HOOKS.get(id(self))
            return hook(self, args, kwargs) if hook else cls.__call__(self, *args, **kwargs)

        _HOOKED[cls] = type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__})
    return _HOOKED[cls]


def _submodule(model: Any, path: str) -> Any:
    """The node at a dotted path: attributes, or items of lists (``nnx.List``) and dicts."""
    node = model
    for part in path.split("."):
        if hasattr(node, part):
            node = getattr(node, part)
        else:
            node = node[int(part)] if part.isdigit() and isinstance(node, Sequence) else node[part]
    return node


class _NnxModel:
    """An NNX module's forward on gathered units (``FSDP.model``)."""

    def __init__(self, model: nnx.Module, units: Any, root: str):
        uses, modules = _variable_uses(model)
        self.units = _select_units(modules, units)
        self.root = root
        self.graphdef, params, self.rest = nnx.split(model, nnx.Param, ...)
        leaves = jax.tree_util.tree_flatten_with_path(params)[0]
        self.fqns = [fqn(path) for path, _ in leaves]
        self.tree = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
        self.treedef = jax.tree_util.tree_structure(params)
        var_at = {path: var_id for var_id, paths in uses.items() for path in paths}
        self.owner = {n: _owner(uses[var_at[n]], self.units, root, n) for n in self.fqns}
        for u in self.units:
            if u not in self.owner.values():
                raise UnitError(f"unit {u!r} has no parameters of its own")
        self.shapes = {n: (tuple(a.shape), a.dtype) for n, (_, a) in zip(self.fqns, leaves)}

    def plan(self) -> list[tuple[str, list[tuple[str, tuple[int, ...]]]]]:
        order = ([self.root] if self.root in self.owner.values() else []) + self.units
        return [(u, [(n, self.shapes[n][0]) for n in self.fqns if self.owner[n] == u]) for u in order]

    def flatten(self, model: Any) -> dict[str, jax.Array]:
        return flatten_params(nnx.state(model, nnx.Param) if isinstance(model, nnx.Module) else model)

    def forward(self, units: Units, inputs: Any) -> Any:
        root = units.gather(self.root) if self.root in units.layouts else {}
        values = [root[n] if self.owner[n] == self.root else _Sharded(n, self.owner[n], *self.shapes[n])
                  for n in self.fqns]
        model = nnx.merge(self.graphdef, jax.tree_util.tree_unflatten(self.treedef, values), self.rest)
        hooked = []
        for unit in self.units:
            module = _submodule(model, unit)
            module.__class__ = _hooked_class(type(module))
            _HOOKS[id(module)] = lambda m, args, kwargs, unit=unit: _call_unit(units, unit, m, args, kwargs)
            hooked.append(id(module))
        try:
            return model(inputs)
        finally:
            for key in hooked:
                _HOOKS.pop(key, None)


def _call_unit(units: Units, unit: str, module: nnx.Module, args: tuple, kwargs: dict) -> Any:
    """Run ``module(*args, **kwargs)`` with unit ``unit`` gathered: the unit's params, the other values
    the submodule holds (root-owned shared params, non-param state) and the array arguments go in as
    explicit inputs, so the call can be a custom VJP (re-gathering in the backward)."""
    graphdef, state = nnx.split(module)
    leaves, treedef = jax.tree_util.tree_flatten(state)
    own = {i: leaf.name for i, leaf in enumerate(leaves) if isinstance(leaf, _Sharded) and leaf.unit == unit}
    others = [leaf for i, leaf in enumerate(leaves) if i not in own]
    foreign = [leaf for leaf in others if isinstance(leaf, _Sharded)]
    if foreign:
        raise UnitError(f"unit {unit!r} reads parameter {foreign[0].name!r} of unit {foreign[0].unit!r}")
    arg_leaves, arg_tree = jax.tree_util.tree_flatten((args, kwargs))
    dynamic = [i for i, a in enumerate(arg_leaves) if isinstance(a, (jax.Array, jnp.ndarray))]
    call = type(module).__mro__[1].__call__

    def apply(params: Mapping[str, jax.Array], h: tuple) -> Any:
        other_values, dynamic_args = h
        it = iter(other_values)
        state_leaves = [params[own[i]] if i in own else next(it) for i in range(len(leaves))]
        m = nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, state_leaves))
        a = list(arg_leaves)
        for i, v in zip(dynamic, dynamic_args):
            a[i] = v
        call_args, call_kwargs = jax.tree_util.tree_unflatten(arg_tree, a)
        return call(m, *call_args, **call_kwargs)

    return units.call(unit, apply, (others, [arg_leaves[i] for i in dynamic]))


# ----- pure functions -----------------------------------------------------------------------------------
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


class _FunctionModel:
    """A pure function ``apply(params, x)`` on gathered units (``FSDP.model``)."""

    def __init__(self, apply: Callable, params: Any, units: Any, root: str):
        self.apply, self.root = apply, root
        leaves = jax.tree_util.tree_flatten_with_path(params)[0]
        self.fqns = [fqn(path) for path, _ in leaves]
        self.tree = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
        self.shapes = {n: (tuple(a.shape), a.dtype) for n, (_, a) in zip(self.fqns, leaves)}
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

    def plan(self) -> list[tuple[str, list[tuple[str, tuple[int, ...]]]]]:
        order = ([self.root] if self.root in self.owner.values() else []) + self.units
        return [(u, [(n, self.shapes[n][0]) for n in self.fqns if self.owner[n] == u]) for u in order]

    def flatten(self, params: Any) -> dict[str, jax.Array]:
        return flatten_params(params)

    def forward(self, units: Units, inputs: Any) -> Any:
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

        return self.apply(view(self.skeleton, ""), inputs)


# ----- the entry point ----------------------------------------------------------------------------------
def shard_model(model: nnx.Module | Callable, mesh: Mesh, *, units: Any = None, params: Any = None,
                axis: str = "fsdp", replica_axis: str | None = None,
                granularity: GranularityRule | Granularity | int | str = "rows:1",
                mp_policy: MixedPrecisionPolicy | None = None, remat: bool = False, root: str = "root",
                layouts: Sequence[Layout] | None = None, reshard_after_forward: bool | None = None) -> FSDP:
    """FSDP for your own model: plan its units and return the ``FSDP`` runtime that runs its forward.

    Example (NNX; the model may be abstract, from ``nnx.eval_shape``)::

        fsdp = shard_model(model, mesh, units="layers.*", remat=True)
        buffers = fsdp.init_params(lambda: MyModel(rngs=nnx.Rngs(0)))  # or fsdp.shard_params(model)
        step = fsdp.train_step(optax.adamw(1e-3), loss_fn)

    Pure function: ``shard_model(apply, mesh, params=params, units=["layers.0", "layers.1"])``.

    Args:
        model: a flax NNX module, run by its own ``__call__(inputs)``; or ``apply(params, inputs)``.
        mesh: the device mesh; ``axis`` shards, ``replica_axis`` (HSDP) replicates.
        units: NNX: submodule paths with ``fnmatch`` wildcards (``"layers.*"``), a predicate
            ``(path, module) -> bool``, or ``None`` for the submodules marked with ``fully_shard``; pure
            functions: pytree path prefixes (``"layers.0"``). Every parameter outside them forms the root
            unit, named ``root``.
        params: the pure function's params pytree (arrays or ``jax.ShapeDtypeStruct``).
        granularity: ``(fqn, shape) -> granularity`` or one granularity for every matrix.
        mp_policy: mixed precision; ``None`` computes and reduces in the master dtype.
        remat: NNX only: re-gather each unit in its backward and recompute its activations there, so one
            unit is unsharded at a time (the unit's call may then read only its own module and arguments).
        reshard_after_forward: NNX only: free each unit's gathered parameters after its call and re-gather
            them in its backward, keeping its activations (FSDP2's option; recomputes no arithmetic).
            ``None``: as ``remat``, which implies it.
        layouts: pre-planned Layouts (e.g. a core preset's order); their units must own the same
            parameters.

    Raises:
        UnitError: a unit path that matches nothing, nested units, a parameter shared by two units.
        LayoutMismatchError: mesh axes that do not exist; ``layouts`` that do not match the units.
    """
    if isinstance(model, nnx.Module):
        wrapped: Any = _NnxModel(model, units, root)
    else:
        if params is None:
            raise UnitError("a pure-function model needs its params pytree: "
                            "shard_model(apply, mesh, params=..., units=...)")
        if remat or reshard_after_forward:
            option = "remat" if remat else "reshard_after_forward"
            raise UnitError(f"{option}=True needs unit calls to re-gather in: use an NNX module (pure "
                            "functions gather each unit on first use and keep it for the backward)")
        if units is None:
            raise UnitError("a pure-function model needs units=: pytree path prefixes such as 'layers.0'")
        wrapped = _FunctionModel(model, params, units, root)
    check_mesh(mesh, (), axis, replica_axis)  # the axes must exist before the planner reads their size
    planned = wrapped.plan()
    if layouts is None:
        layouts = ragged.plan_model(planned, mesh.shape[axis], granularity,
                                   itemsize=max(jnp.dtype(d).itemsize for _, d in wrapped.shapes.values()))
    want = {u: sorted(n for n, _ in tensors) for u, tensors in planned}
    got = {lay.name: sorted(t.name for t in lay.tensors) for lay in layouts}
    if want != got:
        bad = sorted(u for u in set(want) | set(got) if want.get(u) != got.get(u))
        raise LayoutMismatchError(f"layouts do not match the units at {bad[:3]}: unit {bad[0]!r} owns "
                                  f"{want.get(bad[0])} in the model, {got.get(bad[0])} in the layouts")
    return FSDP(mesh, tuple(layouts), axis=axis, replica_axis=replica_axis,
                mp_policy=mp_policy or MixedPrecisionPolicy(),
                remat=remat, model=wrapped, reshard_after_forward=reshard_after_forward)
