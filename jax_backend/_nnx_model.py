"""A flax NNX module as ``FSDP``'s model (``ShardedModel``): its own ``__call__``, on gathered units.

Inside the step's ``shard_map`` the root unit is gathered first and merged, with this device's model state
(every ``nnx.Variable`` but the Params: batch statistics, RNG streams, counters), into a copy of the model
(``nnx.merge``); ``nnx.recursive_map`` then puts a ``_UnitCall`` in place of each unit submodule in that
copy (never in the user's model), and the model runs as written. A unit's call gathers the unit, merges the
gathered arrays into the submodule's graph and runs its ``__call__`` (with ``reshard_after_forward`` or
``remat`` as a custom VJP that re-gathers in the backward, so one unit is unsharded at a time). Parameters
of other units are placeholders there that raise ``UnitError`` when read. The model state the unit's
submodule holds goes into its call and comes back as the call leaves it, written into the copy; the
forward returns the copy's model state.

Shared parameters follow torch's rule: an ``nnx.Variable`` reachable from several places belongs to the
lowest unit containing every use (the root if a use lies outside the units); uses in two different units
are an error naming both.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jax_backend._names import flatten_params, fqn
from jax_backend._units import UnitError, Units, refuse_non_float

# Names the units: ``fnmatch`` patterns of submodule paths, or a predicate ``(path, module) -> bool``.
UnitSelector = str | Sequence[str] | Callable[[str, nnx.Module], bool]


def _dotted(path: Sequence[Any]) -> str:
    return ".".join(str(p) for p in path)


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


def _select_units(modules: Mapping[str, nnx.Module], units: UnitSelector | None) -> list[str]:
    """Unit paths from patterns (``"layers.*"``, one segment per ``*``) or a predicate
    ``(path, module) -> bool``, in model order."""
    if units is None:
        raise UnitError("no units: pass units= (submodule paths such as 'layers.*', or a predicate "
                        "(path, module) -> bool)")
    if callable(units):
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


class _UnitCall:
    """A unit's submodule in the step's copy of the model: calling it runs the submodule on the gathered
    unit (``_call_unit``); any other attribute is the submodule's own (its parameters are ``_Sharded``)."""

    def __init__(self, units: Units, unit: str, module: nnx.Module):
        self._units, self._unit, self._module = units, unit, module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _call_unit(self._units, self._unit, self._module, args, kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def _at_paths_of(new: Any, like: Any) -> list:
    """The leaves of state ``new`` at the leaf paths of ``like``, in ``like``'s order: Variables the forward
    created (``sow``'s intermediates) are dropped, so the model state keeps the structure it came in."""
    by_path = {jax.tree_util.keystr(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(new)[0]}
    return [by_path[jax.tree_util.keystr(p)] for p, _ in jax.tree_util.tree_flatten_with_path(like)[0]]


def _is_node(x: Any) -> bool:
    return isinstance(x, nnx.Variable) or nnx.graph.is_graph_node(x)


def _call_unit(units: Units, unit: str, module: nnx.Module, args: tuple, kwargs: dict) -> Any:
    """Run ``module(*args, **kwargs)`` with unit ``unit`` gathered: the unit's params, the other values
    the submodule holds (root-owned shared params, its model state), the array arguments and the state of
    graph-node arguments (an ``nnx.Rngs`` the root passes in) go in as explicit inputs, so the call can be
    a custom VJP (re-gathering in the backward). The call returns the model state of the submodule and of
    those arguments as it leaves it (a BatchNorm's new statistics, a Dropout stream's count), which is
    written back into the step's copy of the model: the root and later units see it, and the step returns
    it."""
    arg_leaves, arg_tree = jax.tree_util.tree_flatten((args, kwargs), is_leaf=_is_node)
    node_at = [i for i, a in enumerate(arg_leaves) if _is_node(a)]
    nodes = (module, [arg_leaves[i] for i in node_at])  # one graph: Variables shared with the args stay one
    graphdef, params, state = nnx.split(nodes, nnx.Param, ...)
    leaves, treedef = jax.tree_util.tree_flatten(params)
    own = {i: leaf.name for i, leaf in enumerate(leaves) if isinstance(leaf, _Sharded) and leaf.unit == unit}
    others = [leaf for i, leaf in enumerate(leaves) if i not in own]
    foreign = [leaf for leaf in others if isinstance(leaf, _Sharded)]
    if foreign:
        raise UnitError(f"unit {unit!r} reads parameter {foreign[0].name!r} of unit {foreign[0].unit!r}")
    state_leaves, state_def = jax.tree_util.tree_flatten(state)
    dynamic = [i for i, a in enumerate(arg_leaves) if isinstance(a, (jax.Array, jnp.ndarray))]

    def apply(unit_params: Mapping[str, jax.Array], h: tuple) -> tuple[Any, list]:
        other_values, state_values, dynamic_args = h
        it = iter(other_values)
        param_leaves = [unit_params[own[i]] if i in own else next(it) for i in range(len(leaves))]
        gathered, arg_nodes = nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, param_leaves),
                                        jax.tree_util.tree_unflatten(state_def, state_values))
        a = list(arg_leaves)
        for i, v in [*zip(dynamic, dynamic_args), *zip(node_at, arg_nodes)]:
            a[i] = v
        call_args, call_kwargs = jax.tree_util.tree_unflatten(arg_tree, a)
        out = gathered(*call_args, **call_kwargs)
        return out, _at_paths_of(nnx.state((gathered, arg_nodes), nnx.Not(nnx.Param)), state)

    out, new_state = units.call(unit, apply, (others, state_leaves, [arg_leaves[i] for i in dynamic]))
    nnx.update(nodes, jax.tree_util.tree_unflatten(state_def, new_state))
    return out


class NnxModel:
    """An NNX module's forward on gathered units (a ``ShardedModel``).

    Its ``nnx.Param``s are the units' buffers; every other ``nnx.Variable`` (``BatchStat``, the ``RngKey``
    and ``RngCount`` of each ``nnx.Rngs`` stream, a user's own ``Variable`` subclass) is its *model state*:
    an input of the forward, returned as the forward leaves it.

    Args:
        model: the module (concrete or abstract, from ``nnx.eval_shape``); only its structure is kept.
        units: which submodules are units (``UnitSelector``).
        root: the name of the unit of every parameter outside the units.
        sync_batch_stats: ``nnx.BatchNorm`` layers without an ``axis_name`` average their batch
            statistics over the data-parallel axes (sync BN); by default each device normalizes by its
            own batch's, as plain data parallelism does.

    Raises:
        UnitError: a unit path that matches nothing, nested units, a parameter shared by two units, a
            unit without parameters of its own, a parameter that is not floating point.
    """

    def __init__(self, model: nnx.Module, units: UnitSelector | None, root: str,
                 sync_batch_stats: bool = False):
        uses, modules = _variable_uses(model)
        self.units = _select_units(modules, units)
        self.root, self.sync_batch_stats = root, sync_batch_stats
        self.graphdef, params, state = nnx.split(model, nnx.Param, ...)
        leaves = jax.tree_util.tree_flatten_with_path(params)[0]
        self.fqns = [fqn(path) for path, _ in leaves]
        self.tree = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
        self.state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)
        self.treedef = jax.tree_util.tree_structure(params)
        self.shapes = {n: (tuple(a.shape), a.dtype) for n, (_, a) in zip(self.fqns, leaves)}
        refuse_non_float(self.shapes, "make it an nnx.Variable of another kind: the step carries those as "
                                      "model state")
        var_at = {path: var_id for var_id, paths in uses.items() for path in paths}
        self.owner = {n: _owner(uses[var_at[n]], self.units, root, n) for n in self.fqns}
        for u in self.units:
            if u not in self.owner.values():
                raise UnitError(f"unit {u!r} has no parameters of its own")

    def flatten(self, model: Any) -> dict[str, jax.Array]:
        return flatten_params(nnx.state(model, nnx.Param) if isinstance(model, nnx.Module) else model)

    def split_state(self, model: nnx.Module) -> nnx.State:
        """The model state of ``model`` (every ``nnx.Variable`` but its ``nnx.Param``s)."""
        state = nnx.state(model, nnx.Not(nnx.Param))
        if jax.tree_util.tree_structure(state) != jax.tree_util.tree_structure(self.state):
            raise UnitError("the model's non-Param variables differ from those of the model given to "
                            "shard_model (another architecture?)")
        return state

    def forward(self, units: Units, state: Any, inputs: Any) -> tuple[Any, nnx.State]:
        root = units.gather(self.root) if self.root in units.layouts else {}
        values = [root[n] if self.owner[n] == self.root else _Sharded(n, self.owner[n], *self.shapes[n])
                  for n in self.fqns]
        # Fresh Variables of this trace (the state may hold Variables made by an outer one), so the forward
        # may write them: flax refuses writes to a Variable from another trace level.
        state = jax.tree.map(lambda a: a, state)
        model = nnx.merge(self.graphdef, jax.tree_util.tree_unflatten(self.treedef, values), state)
        if self.sync_batch_stats:
            for _, node in nnx.iter_graph(model):
                if isinstance(node, nnx.BatchNorm) and node.axis_name is None:
                    node.axis_name = units.data_axes

        def unit_call(path: tuple, node: Any) -> Any:
            unit = _dotted(path)
            return _UnitCall(units, unit, node) if unit in self.units else node

        # recursive_map clones the modules but keeps their Variables: what the unit calls and the root write
        # lands in ``model``'s Variables.
        out = nnx.recursive_map(unit_call, model)(inputs)
        new = _at_paths_of(nnx.state(model, nnx.Not(nnx.Param)), state)
        return out, jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(state), new)
