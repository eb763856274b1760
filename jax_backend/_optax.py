"""How the FSDP step runs an optax transformation on the units' shards with optax's semantics.

The step holds each unit as a flat local shard ``(S,)``, but a transformation must give the result optax
gives on the full params pytree. ``shard_optimizer`` traces ``init`` and ``update`` once on the full-shape
abstract params (``jax.ShapeDtypeStruct`` leaves: the user's pytree from ``shard_model``, else
``{fqn: struct}``), so masks, labels and any other rule over the pytree resolve per parameter at trace
time, and picks one of two ways to run it:

- *one element-wise program on every parameter* (adam, adamw, sgd, lion, ...): each element's update
  depends on that element alone, wherever the layout put it, so ``tx`` runs as is on the flat shards
  (the fast path; its state is ``tx.init({unit: shard})``);
- anything else (``adamw(mask=...)``, ``optax.masked``, ``optax.multi_transform``, ``clip_by_global_norm``,
  LAMB, ``scale_by_trust_ratio``, a global norm kept in the state): the traced jaxprs run on every
  device's pieces of every parameter (``_pieces.Evaluator``): element-wise primitives on the pieces, full
  reductions of a parameter as the local reduction plus a collective over the shard axis. The state is a
  ``ShardedState``: each state subtree that mirrors the params (Adam's ``mu``, ``nu``) as unit shards laid
  out like the buffers, every other leaf (step counts, norms) replicated.

A transformation neither way can honor (a transpose of a parameter, adafactor's reductions over some axes,
two parameters mixed element by element) raises ``UnsupportedOptimizerError`` naming the primitive and
the parameter, from ``FSDP.init`` and ``FSDP.train_step``, before anything runs. Optimizers written for the
step's ``{unit: shard}`` dict (``jax_backend.optim``'s ``adamw8bit(tiles=...)``, ``muon(plan=...)``) are
passed through ``on_shards`` and run as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.extend import core as jex_core
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_backend._buffers import Axis, LayoutMismatchError, full_params, shard_params
from jax_backend._names import fqn
from jax_backend._pieces import (
    CALLS,
    ELEMENTWISE,
    Evaluator,
    Fill,
    UnsupportedOptimizerError,
    Windowed,
    windows,
)
from ragged import Layout


class OnShards(optax.GradientTransformation):
    """A transformation written for the step's ``{unit: (S,)}`` shards: ``shard_optimizer`` runs it as is."""


def on_shards(tx: optax.GradientTransformation) -> OnShards:
    """Mark ``tx`` as layout-aware: it takes the step's ``{unit: shard}`` dict and knows the Layouts itself.

    For ``jax_backend.optim.adamw8bit(..., tiles=shard_tiles(...))`` and ``muon(..., plan=muon_plan(...))``,
    whose tile ids and NS devices come from the core's tables, not from the params pytree.
    """
    return OnShards(tx.init, tx.update)


def global_norm(shards: Any, axis: str) -> jax.Array:
    """``optax.global_norm`` of the full params from the step's ``{unit: shard}`` dict (inside ``shard_map``).

    Padding is zero, so the local shards' squares summed over the shard axis are the full params'; not
    over the replica axis, since HSDP replicas hold equal shards.
    """
    return jnp.sqrt(lax.psum(sum(jnp.sum(jnp.square(u)) for u in jax.tree.leaves(shards)), axis))


def clip_by_global_norm(max_norm: float, axis: str) -> OnShards:
    """``optax.clip_by_global_norm`` for the step's ``{unit: shard}`` dict (inside ``shard_map``).

    The norm is ``global_norm`` of the shards. Chain it with element-wise transformations and pass the
    chain through ``on_shards``: ``on_shards(optax.chain(clip_by_global_norm(1.0, fsdp.axis), adamw))``.
    """

    def update(updates: Any, state: optax.EmptyState, params: Any = None) -> tuple:
        del params
        norm = global_norm(updates, axis)
        trigger = norm < max_norm
        return jax.tree.map(lambda t: lax.select(trigger, t, (t / norm.astype(t.dtype)) * max_norm),
                            updates), state

    return OnShards(lambda params: optax.EmptyState(), update)


def abstract_params(layouts: Sequence[Layout], dtype: Any = "float32") -> dict[str, jax.ShapeDtypeStruct]:
    """``{fqn: ShapeDtypeStruct}`` of every tensor of ``layouts``: the pytree unsharded optax would see."""
    return {t.name: jax.ShapeDtypeStruct(t.shape, dtype) for lay in layouts for t in lay.tensors}


class ShardedState(NamedTuple):
    """The state of a transformation run on the parameters' pieces (``shard_optimizer``'s second way).

    ``tx.init(full params)``'s leaves, stored as the FSDP step keeps them: each state subtree that
    mirrors the params (one *slot*: Adam's ``mu``, a masked ``nu``) as ``{unit: (S,)}`` shards laid out like
    the unit buffers (zeros where a parameter has no leaf in the slot), so ``full_params`` gives its
    tensors by FQN; every other leaf as it is, replicated.
    """

    slots: tuple[dict[str, jax.Array], ...]  # one {unit: (S,)} per slot, sharded like the buffers
    rest: tuple[Any, ...]  # step counts, norms, ...: the same on every device


class _Leaf(NamedTuple):
    """Where one leaf of ``tx.init(full params)`` lives in ``ShardedState``."""

    slot: int | None  # None: in ``rest``
    index: int  # the parameter (in a slot), or the position in ``rest``


class _Traced:
    """``tx.init`` and ``tx.update`` traced on the full-shape abstract params, and where their state goes."""

    def __init__(self, tx: optax.GradientTransformation, params: Any):
        leaves = jax.tree_util.tree_flatten_with_path(params)[0]
        self.names = [fqn(path) for path, _ in leaves]
        try:
            self.init = jax.make_jaxpr(tx.init)(params)
            state = jax.eval_shape(tx.init, params)
            self.update = jax.make_jaxpr(tx.update)(params, state, params)
        except UnsupportedOptimizerError:
            raise
        except Exception as err:  # noqa: BLE001 - any failure on the full params is reported the same way
            raise UnsupportedOptimizerError(
                f"the optimizer fails on the full params pytree ({type(err).__name__}: {err}); if it is "
                "written for the step's {unit: shard} dict (jax_backend.optim's adamw8bit(tiles=...), "
                "muon(plan=...)), pass it as jax_backend.on_shards(tx)"
            ) from err
        state_leaves = jax.tree_util.tree_flatten_with_path(state)[0]
        self.owners = [_owner(path, leaf, leaves) for path, leaf in state_leaves]
        prefixes: dict[str, int] = {}
        self.prefixes: list[tuple] = []  # each slot's path in the state
        self.leaves: list[_Leaf] = []
        rest = 0
        for (path, _), owner in zip(state_leaves, self.owners):
            if owner is None:
                self.leaves.append(_Leaf(None, rest))
                rest += 1
                continue
            prefix_path = tuple(path[:len(path) - len(leaves[owner][0])])
            prefix = jax.tree_util.keystr(prefix_path)
            if prefix not in prefixes:
                prefixes[prefix] = len(self.prefixes)
                self.prefixes.append(prefix_path)
            slot = prefixes[prefix]
            if _Leaf(slot, owner) in self.leaves:
                raise UnsupportedOptimizerError(
                    f"two state leaves at {prefix} belong to parameter {self.names[owner]}: the optimizer "
                    "state must mirror the params pytree")
            self.leaves.append(_Leaf(slot, owner))
        self.slots = len(self.prefixes)
        self.state_paths = [path for path, _ in state_leaves]
        self.state_avals = [leaf for _, leaf in state_leaves]
        self.state_def = jax.tree_util.tree_structure(state)

    def uniform(self) -> bool:
        """True when ``update`` runs one element-wise program on every parameter (flat shards honor it)."""
        n = len(self.names)
        owners = list(range(n)) + self.owners + list(range(n))
        programs: dict[int, list] = {i: [] for i in range(n)}
        try:
            _walk(self.update.jaxpr, [frozenset() if o is None else frozenset({o}) for o in owners], programs)
        except _NotUniform:
            return False
        return all(programs[i] == programs[0] for i in range(1, n))

    def pack(self, outs: Sequence[Any], ev: Evaluator, shard_sizes: Mapping[str, int]) -> ShardedState:
        """The state leaves ``outs`` (full-shape values on this device's pieces) as a ``ShardedState``."""
        slots: list[dict[str, jax.Array]] = [{} for _ in range(self.slots)]
        rest = []
        for leaf, aval, out in zip(self.leaves, self.state_avals, outs):
            if leaf.slot is None:
                if isinstance(out, Windowed):
                    raise UnsupportedOptimizerError(
                        f"a state leaf of shape {aval.shape} holds values of parameter "
                        f"{self.names[out.param]} but does not mirror it in the params pytree; keep such "
                        "state in a subtree shaped like the params")
                rest.append(jnp.broadcast_to(out.value, out.shape) if isinstance(out, Fill) else out)
                continue
            unit = ev.windows[leaf.index].unit
            shard = slots[leaf.slot].get(unit)
            if shard is None:
                shard = jnp.zeros((shard_sizes[unit],), aval.dtype)
            slots[leaf.slot][unit] = ev.write(shard, leaf.index, out)
        return ShardedState(tuple(slots), tuple(rest))


def shard_optimizer(tx: optax.GradientTransformation, layouts: Sequence[Layout], axis: str | None,
                    params: Any = None) -> optax.GradientTransformation:
    """``tx`` as the FSDP step runs it on the local shards ``{unit: (S,)}``, with optax's result on params.

    Returns ``tx`` itself when it runs one element-wise program on every parameter (or is ``on_shards``);
    otherwise a transformation that runs ``tx``'s traced jaxprs on this device's pieces of every parameter,
    with a ``ShardedState``. Its ``init`` and ``update`` run inside ``shard_map`` over ``axis``; ``update``
    needs ``params``. Both are evaluated once here, without collectives, so a transformation that cannot be
    honored raises now.

    Args:
        tx: the user's transformation, written for ``params``.
        layouts: the units' Layouts (every parameter's pieces on every device).
        axis: the shard axis (None: check only).
        params: the full params pytree optax sees, abstract leaves (default: ``{fqn: struct}`` of the
            Layouts, fp32); its leaves' FQNs must be the Layouts' tensors.

    Raises:
        UnsupportedOptimizerError: naming the parameter, the primitive and why.
    """
    if isinstance(tx, OnShards):
        return tx
    params = abstract_params(layouts) if params is None else params
    traced = _Traced(tx, params)
    if traced.uniform():
        return tx
    table = windows(layouts)
    missing = [n for n in traced.names if n not in table]
    if missing:
        raise LayoutMismatchError(f"params leaves {missing[:5]} are not tensors of the layouts")
    wins = [table[n] for n in traced.names]
    sizes = {lay.name: lay.shard_size for lay in layouts}
    dtypes = {}
    for w, leaf in zip(wins, jax.tree.leaves(params)):
        dtypes[w.unit] = jnp.result_type(dtypes.get(w.unit, leaf.dtype), leaf.dtype)
    local = {u: jax.ShapeDtypeStruct((s,), dtypes[u]) for u, s in sizes.items() if u in dtypes}
    dry = _on_pieces(tx, traced, params, wins, sizes, None)
    jax.eval_shape(dry.update, local, jax.eval_shape(dry.init, local), local)
    return _on_pieces(tx, traced, params, wins, sizes, axis) if axis is not None else dry


def _on_pieces(tx: optax.GradientTransformation, traced: _Traced, params: Any, wins: list,
               sizes: Mapping[str, int], axis: str | None) -> OnShards:
    """``tx`` on this device's pieces of every parameter (``shard_optimizer``'s second way)."""
    leaves, treedef = jax.tree_util.tree_flatten(params)

    traced_for = {tuple(leaf.dtype for leaf in leaves): traced}  # traced outside any mesh

    def trace(shards: Mapping[str, jax.Array]) -> tuple[_Traced, Evaluator]:
        # the jaxprs for the shards' dtypes (a bf16 master, say), traced once per dtype
        key = tuple(shards[w.unit].dtype for w in wins)
        if key not in traced_for:
            typed = [jax.ShapeDtypeStruct(leaf.shape, dt) for leaf, dt in zip(leaves, key)]
            traced_for[key] = _Traced(tx, jax.tree_util.tree_unflatten(treedef, typed))
        return traced_for[key], Evaluator(wins, traced_for[key].names, axis)

    def read(ev: Evaluator, shards: Mapping[str, jax.Array]) -> list[Windowed]:
        return [ev.read(shards[w.unit], i) for i, w in enumerate(wins)]

    def init(local: Mapping[str, jax.Array]) -> ShardedState:
        traced, ev = trace(local)
        return traced.pack(ev.run(traced.init.jaxpr, traced.init.consts, read(ev, local)), ev, sizes)

    def update(updates: Mapping[str, jax.Array], state: ShardedState,
               params: Mapping[str, jax.Array] | None = None) -> tuple[dict[str, jax.Array], ShardedState]:
        if params is None:
            raise UnsupportedOptimizerError("the optimizer runs on the parameters' pieces and needs params: "
                                            "call update(updates, state, params)")
        traced, ev = trace(params)
        state_in = [state.rest[leaf.index] if leaf.slot is None
                    else ev.read(state.slots[leaf.slot][wins[leaf.index].unit], leaf.index)
                    for leaf in traced.leaves]
        outs = ev.run(traced.update.jaxpr, traced.update.consts,
                      read(ev, updates) + state_in + read(ev, params))
        new = {u: jnp.zeros_like(g) for u, g in updates.items()}
        for i, w in enumerate(wins):
            new[w.unit] = ev.write(new[w.unit], i, outs[i])
        return new, traced.pack(outs[len(wins):], ev, sizes)

    return OnShards(init, update)


def check_optimizer(tx: optax.GradientTransformation, layouts: Sequence[Layout], params: Any = None) -> None:
    """Raise ``UnsupportedOptimizerError`` unless the FSDP step can give ``tx``'s result on ``params``.

    ``shard_optimizer`` without a shard axis: it traces ``tx`` and evaluates it once, without collectives.
    """
    shard_optimizer(tx, layouts, None, params)


def full_optimizer_state(tx: optax.GradientTransformation, state: Any, layouts: Sequence[Layout],
                  params: Any = None, unpack: Callable = full_params) -> Any:
    """The FSDP step's optimizer state as optax keeps it on the full params: ``tx.init(params)``'s pytree.

    Per-parameter leaves come back whole (``full_params`` of their slot: static slices, exact); step
    counts and norms as they are. For checkpoints of the optimizer state and for reading what a
    transformation logged in its state (a global norm, say).

    Args:
        tx: the user's transformation, as given to ``FSDP.init`` (not an ``on_shards`` one).
        state: the step's state of ``tx``.
        layouts, params: as for ``shard_optimizer``.
        unpack: ``full_params`` or a function like it (the checkpoint tree's, one unit per program).
    """
    if isinstance(tx, OnShards):
        raise UnsupportedOptimizerError("an on_shards transformation keeps its own state layout: read it "
                                        "as it is")
    params = abstract_params(layouts) if params is None else params
    traced = _Traced(tx, params)
    if isinstance(state, ShardedState):
        shards = list(state.slots)
    else:  # tx ran on flat shards: a slot is the subtree {unit: buffer} at the slot's path
        key = jax.tree_util.keystr
        flat = {key(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]}
        shards = [{lay.name: flat[key((*prefix, jax.tree_util.DictKey(lay.name)))] for lay in layouts}
                  for prefix in traced.prefixes]
    # every slot's units in one unpack (one program for full_params): each slot's Layouts renamed "slot/name"
    units = {lay.name: lay for lay in layouts}
    renamed = [units[u].renamed(tuple(f"{k}/{t.name}" for t in units[u].tensors), f"{k}/{u}")
               for k, slot in enumerate(shards) for u in slot]
    full = unpack({f"{k}/{u}": b for k, slot in enumerate(shards) for u, b in slot.items()}, renamed)
    slots = [{name: full[f"{k}/{name}"] for name in traced.names if f"{k}/{name}" in full}
             for k in range(len(shards))]
    leaves = []
    for leaf, path in zip(traced.leaves, traced.state_paths):
        if leaf.slot is not None:
            leaves.append(slots[leaf.slot][traced.names[leaf.index]])
        elif isinstance(state, ShardedState):
            leaves.append(state.rest[leaf.index])
        else:
            leaves.append(flat[jax.tree_util.keystr(path)])
    return jax.tree_util.tree_unflatten(traced.state_def, leaves)



def shard_optimizer_state(tx: optax.GradientTransformation, full: Any, layouts: Sequence[Layout], mesh: Mesh,
                          axis: Axis, params: Any = None, pack: Callable = shard_params) -> Any:
    """The inverse of ``full_optimizer_state``: optax's state on the full params (``tx.init(params)``'s
    pytree, with whole tensors on any devices or the host) -> the FSDP step's state of ``tx`` on ``mesh``.

    Each slot's tensors are packed into unit shards laid out like the buffers (``shard_params``: copies
    only, exact; zeros where a parameter has no leaf in the slot), every other leaf (step counts, norms)
    is replicated. ``full`` may come from another mesh size, so the optimizer state moves as the
    parameters do: ``full_optimizer_state`` on one mesh, this on the other. ``pack``: ``shard_params`` or a
    function like it (the checkpoint tree's, one unit per program).

    Raises:
        UnsupportedOptimizerError: an ``on_shards`` transformation (its state layout is its own).
        LayoutMismatchError: ``full`` is not ``tx.init(params)``'s pytree, or a leaf has another shape.
    """
    if isinstance(tx, OnShards):
        raise UnsupportedOptimizerError("an on_shards transformation keeps its own state layout: it cannot "
                                        "be rebuilt from the full params' state")
    params = abstract_params(layouts) if params is None else params
    traced = _Traced(tx, params)
    key = jax.tree_util.keystr
    try:
        values = traced.state_def.flatten_up_to(full)
    except (TypeError, ValueError) as err:
        raise LayoutMismatchError(f"the optimizer state is not tx.init(params)'s pytree ({err})") from None
    slots: list[dict[str, Any]] = [{} for _ in range(traced.slots)]
    rest = {}
    replicated = NamedSharding(mesh, P())
    for leaf, path, aval, value in zip(traced.leaves, traced.state_paths, traced.state_avals, values):
        if tuple(np.shape(value)) != tuple(aval.shape):
            raise LayoutMismatchError(f"optimizer state leaf {key(path)} has shape {tuple(np.shape(value))}, "
                                      f"tx.init(params) gives {tuple(aval.shape)}")
        if leaf.slot is None:
            rest[key(path)] = jax.device_put(value, replicated)
        else:
            slots[leaf.slot][traced.names[leaf.index]] = value
    # every slot's units in one pack (one program for shard_params): each slot's Layouts renamed "slot/name"
    units, renamed, tensors = [], [], {}
    for k, slot in enumerate(slots):
        units.append([lay.name for lay in layouts if any(t.name in slot for t in lay.tensors)])
        for lay in (lay for lay in layouts if lay.name in units[k]):
            dtype = jnp.result_type(*(slot[t.name] for t in lay.tensors if t.name in slot))
            renamed.append(lay.renamed(tuple(f"{k}/{t.name}" for t in lay.tensors), f"{k}/{lay.name}"))
            tensors.update({f"{k}/{t.name}": slot[t.name] if t.name in slot else np.zeros(t.shape, dtype)
                            for t in lay.tensors})
    packed = pack(tensors, renamed, mesh, axis) if renamed else {}
    shards = [{u: packed[f"{k}/{u}"] for u in names} for k, names in enumerate(units)]
    if not traced.uniform():
        return ShardedState(tuple(shards), tuple(rest.values()))  # rest in the state's order
    # tx runs on flat shards (shard_optimizer returns it as is): its state is tx.init({unit: buffer}),
    # slot k's subtree {unit: buffer} at the slot's path, every other leaf where tx.init(params) has it
    like = jax.eval_shape(tx.init, {lay.name: jax.ShapeDtypeStruct((lay.total_numel,), jnp.float32)
                                    for lay in layouts})
    at = {key((*prefix, jax.tree_util.DictKey(u))): b for prefix, slot in zip(traced.prefixes, shards)
          for u, b in slot.items()}
    paths, treedef = jax.tree_util.tree_flatten_with_path(like)
    return jax.tree_util.tree_unflatten(treedef, [at.get(key(p), rest.get(key(p))) for p, _ in paths])


def state_specs(state: Any, axis: str, buffer_spec: P | None = None) -> Any:
    """The ``PartitionSpec`` of each leaf of a local optimizer state in the step's ``shard_map``.

    A ``ShardedState``'s slots are sharded like the buffers and its other leaves replicated; otherwise
    (``tx`` on flat shards) per-element state is sharded like the buffers (``buffer_spec``, default
    ``P(axis)``; ``(T, S)`` shards with a tensor axis) and scalars (step counts) are replicated.

    Raises:
        LayoutMismatchError: a state leaf on flat shards that is neither per-element nor a scalar.
    """
    if isinstance(state, ShardedState):
        return ShardedState(jax.tree.map(lambda _: P(axis), state.slots),
                            jax.tree.map(lambda _: P(), state.rest))

    per_element = P(axis) if buffer_spec is None else buffer_spec

    def spec(path: Any, leaf: jax.ShapeDtypeStruct) -> P:
        if leaf.ndim == 0:
            return P()
        if leaf.ndim == len(per_element):
            return per_element
        raise LayoutMismatchError(
            f"optimizer state leaf {jax.tree_util.keystr(path)} has shape {leaf.shape}: only per-element "
            "state (like Adam's moments) and scalars can live on flat shards"
        )

    return jax.tree_util.tree_map_with_path(spec, state)


def _owner(path: Any, leaf: Any, leaves: list) -> int | None:
    """The parameter a state leaf belongs to: the one whose path ends its path, with the same shape.

    By path, not by rank: a 0-d parameter's moments are 0-d like the step count, which is owned by no
    parameter (its path, ``.count``, ends no parameter's)."""
    best = None
    for i, (p, x) in enumerate(leaves):
        if 0 < len(p) <= len(path) and tuple(path[len(path) - len(p):]) == tuple(p) and x.shape == leaf.shape:
            if best is None or len(p) > len(leaves[best][0]):
                best = i
    return best


class _NotUniform(Exception):
    """``update`` is not one element-wise program per parameter (so it runs on the pieces instead)."""


def _walk(jaxpr: Any, owners: list, programs: dict) -> list:
    """Propagate parameter ownership through ``jaxpr``; record each parameter's element-wise program.

    Raises ``_NotUniform`` where a parameter's value goes through a primitive that is not element-wise or
    meets another parameter's.
    """
    env: dict = {v: o for v, o in zip(jaxpr.invars, owners)}
    # What a value not derived from any parameter is (its primitives and constants, hashed): a constant
    # that differs between parameters (``u * jnp.full(u.shape, u.ndim)``) makes their programs differ.
    consts: dict = {v: ("input", k) for k, v in enumerate(jaxpr.invars)}

    def read(v: Any) -> frozenset:
        return frozenset() if isinstance(v, jex_core.Literal) else env.get(v, frozenset())

    def const(v: Any) -> Any:
        return repr(v.val) if isinstance(v, jex_core.Literal) else consts.get(v)

    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        owned = frozenset().union(*ins)
        name = eqn.primitive.name
        if name in CALLS and CALLS[name] in eqn.params:
            sub = eqn.params[CALLS[name]]
            outs = _walk(getattr(sub, "jaxpr", sub), ins, programs)
        elif not owned:
            outs = [frozenset()] * len(eqn.outvars)
            params = () if name == "broadcast_in_dim" else repr(sorted(eqn.params.items()))
            made = hash((name, params, tuple(const(v) for v in eqn.invars)))
            consts.update((v, (made, k)) for k, v in enumerate(eqn.outvars))
        elif len(owned) > 1 or name not in ELEMENTWISE:
            raise _NotUniform
        else:
            (i,) = owned
            operands = tuple(None if o else const(v) for o, v in zip(ins, eqn.invars))
            programs[i].append((name, operands, repr(sorted(eqn.params.items()))))
            outs = [owned] * len(eqn.outvars)
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]
