"""``shard_model``, the way in: FSDP for any flax NNX module or pure function, running its own forward.

The user names the units; every parameter outside them goes to a root unit (FSDP2's root module). The
model becomes a ``ShardedModel`` (``_nnx_model.NnxModel`` or ``_function_model.FunctionModel``), its units
are planned by the core (``ragged.plan_model``), and ``FSDP`` runs it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

import ragged
from jax_backend._buffers import LayoutMismatchError, check_mesh
from jax_backend._function_model import FunctionModel
from jax_backend._nnx_model import NnxModel, UnitSelector
from jax_backend._step import FSDP
from jax_backend._tensor_parallel import (
    TensorParallel,
    TensorParallelError,
    TensorRules,
    build_tensor_parallel,
    nnx_annotations,
)
from jax_backend._units import MixedPrecisionPolicy, UnitError
from ragged import Granularity, GranularityRule, Layout


def _unit_tensors(wrapped: NnxModel | FunctionModel,
                  tp: TensorParallel | None) -> list[tuple[str, list[tuple[str, tuple[int, ...]]]]]:
    """``[(unit, [(fqn, shape), ...]), ...]`` in the model's order, the root unit first (if it owns any);
    with tensor parallelism, each tensor rank's local shape (what the planner packs)."""
    def shape(n: str) -> tuple[int, ...]:
        return wrapped.shapes[n][0] if tp is None else tp.local_shape(n, wrapped.shapes[n][0])

    order = ([wrapped.root] if wrapped.root in wrapped.owner.values() else []) + wrapped.units
    return [(u, [(n, shape(n)) for n in wrapped.fqns if wrapped.owner[n] == u]) for u in order]


def _tensor_parallel(model: Any, wrapped: NnxModel | FunctionModel, mesh: Mesh, tensor_axis: str | None,
                     tensor_rules: TensorRules | None, data_axes: tuple[str, ...]) -> TensorParallel | None:
    if tensor_axis is None:
        if tensor_rules:
            raise TensorParallelError("tensor_rules= needs tensor_axis=, the mesh axis they split over")
        return None
    annotations = nnx_annotations(nnx.state(model, nnx.Param)) if isinstance(model, nnx.Module) else {}
    return build_tensor_parallel({n: s for n, (s, _) in wrapped.shapes.items()}, annotations,
                                 axis=tensor_axis, mesh_shape=dict(mesh.shape), data_axes=data_axes,
                                 rules=tensor_rules)


def shard_model(model: nnx.Module | Callable, mesh: Mesh, *, units: UnitSelector | None = None,
                params: Any = None, axis: str = "fsdp", replica_axis: str | None = None,
                granularity: GranularityRule | Granularity | int | str = "rows:1",
                mp_policy: MixedPrecisionPolicy | None = None, remat: bool = False, root: str = "root",
                layouts: Sequence[Layout] | None = None, reshard_after_forward: bool | None = None,
                sync_batch_stats: bool = False, tensor_axis: str | None = None,
                tensor_rules: TensorRules | None = None) -> FSDP:
    """FSDP for your own model: plan its units and return the ``FSDP`` runtime that runs its forward.

    Example (NNX; the model may be abstract, from ``nnx.eval_shape``)::

        fsdp = shard_model(model, mesh, units="layers.*", remat=True)
        buffers = fsdp.init_params(lambda: MyModel(rngs=nnx.Rngs(0)))  # or fsdp.shard_params(model)
        model_state = fsdp.init_model_state(lambda: MyModel(rngs=nnx.Rngs(0)))  # BatchNorm, Rngs, ...
        step = fsdp.train_step(optax.adamw(1e-3), loss_fn)  # step(..., model_state) if it has any

    Pure function: ``shard_model(apply, mesh, params=params, units=["layers.0", "layers.1"])``.

    Tensor parallelism: a mesh ``(fsdp, tensor)`` or ``(replica, fsdp, tensor)`` and
    ``tensor_axis="tensor"``; each parameter's dim on that axis comes from ``tensor_rules`` or from its
    ``nnx.with_partitioning`` annotation (docs/jax_backend.md, "Tensor parallelism").

    Inside the step, each unit submodule of the step's copy of the model (never yours) is called on its
    gathered parameters; the root unit is gathered for the whole forward.

    Args:
        model: a flax NNX module, run by its own ``__call__(inputs)``; or ``apply(params, inputs)``.
        mesh: the device mesh; ``axis`` shards, ``replica_axis`` (HSDP) replicates.
        units: NNX: submodule paths with ``fnmatch`` wildcards (``"layers.*"``, one segment per ``*``), or
            a predicate ``(path, module) -> bool``; pure functions: pytree path prefixes (``"layers.0"``).
            Every parameter outside them forms the root unit, named ``root``.
        params: the pure function's params pytree (arrays or ``jax.ShapeDtypeStruct``).
        granularity: ``(fqn, shape) -> granularity`` or one granularity for every matrix.
        mp_policy: mixed precision; ``None`` computes and reduces in the master dtype.
        remat: NNX only: re-gather each unit in its backward and recompute its activations there, so one
            unit is unsharded at a time (the unit's call may then read only its own module and arguments).
        reshard_after_forward: free each unit's gathered parameters after its call and re-gather them in
            its backward, keeping its activations (FSDP2's option; recomputes elementwise ops only).
            ``None``: True for an NNX module, FSDP2's default (the root stays gathered through the step),
            False for a pure function, which has no unit call to re-gather in (True is an error there). Why
            resharding is the default: docs/jax_backend.md, "Measured against GSPMD".
        layouts: pre-planned Layouts (e.g. a core preset's order); their units must own the same
            parameters, with the same shapes.
        sync_batch_stats: NNX only: ``nnx.BatchNorm`` layers average their batch statistics over the
            data-parallel axes (sync BN, equal to single-device training on the global batch); by
            default each device normalizes by its own batch's (plain data parallelism).
        tensor_axis: a mesh axis of tensor parallelism (None: none). XLA partitions the model's
            arithmetic over it; the units are planned from the tensor ranks' local shapes.
        tensor_rules: ``{fnmatch pattern of an FQN: dim or None}``: the dim each matching parameter splits
            over ``tensor_axis`` (the first matching pattern wins over the parameter's annotation).

    Raises:
        UnitError: no units, a unit path that matches nothing, nested units, a parameter shared by two
            units, a parameter that is not floating point.
        LayoutMismatchError: mesh axes that do not exist; ``layouts`` that do not match the units.
        TensorParallelError: an annotation naming an axis not in the mesh, or a split dim that the tensor
            axis's size does not divide (names the parameter).
    """
    if isinstance(model, nnx.Module):
        wrapped: NnxModel | FunctionModel = NnxModel(model, units, root, sync_batch_stats)
        reshard_after_forward = True if reshard_after_forward is None else reshard_after_forward
    else:
        if params is None:
            raise UnitError("a pure-function model needs its params pytree: "
                            "shard_model(apply, mesh, params=..., units=...)")
        if remat or reshard_after_forward:
            option = "remat" if remat else "reshard_after_forward"
            raise UnitError(f"{option}=True needs unit calls to re-gather in: use an NNX module (pure "
                            "functions gather each unit on first use and keep it for the backward)")
        if sync_batch_stats:
            raise UnitError("sync_batch_stats=True is for NNX modules' nnx.BatchNorm layers; a pure function "
                            "keeps no batch statistics")
        if units is None or callable(units):
            raise UnitError("a pure-function model needs units=: pytree path prefixes such as 'layers.0'")
        wrapped = FunctionModel(model, params, units, root)
    check_mesh(mesh, (), axis, replica_axis)  # the axes must exist before the planner reads their size
    data_axes = (axis,) if replica_axis is None else (replica_axis, axis)
    tp = _tensor_parallel(model, wrapped, mesh, tensor_axis, tensor_rules, data_axes)
    planned = _unit_tensors(wrapped, tp)
    if layouts is None:
        layouts = ragged.plan_model(planned, mesh.shape[axis], granularity,
                                   itemsize=max(jnp.dtype(d).itemsize for _, d in wrapped.shapes.values()))
    want = {u: sorted(tensors) for u, tensors in planned}
    got = {lay.name: sorted((t.name, tuple(t.shape)) for t in lay.tensors) for lay in layouts}
    if want != got:
        bad = sorted(u for u in set(want) | set(got) if want.get(u) != got.get(u))
        mine, theirs = set(want.get(bad[0], [])), set(got.get(bad[0], []))
        raise LayoutMismatchError(
            f"layouts do not match the units at {bad[:3]}: unit {bad[0]!r} has (fqn, shape) "
            f"{sorted(mine - theirs)[:3]} in the model but {sorted(theirs - mine)[:3]} in the layouts")
    return FSDP(mesh, tuple(layouts), wrapped, axis=axis, replica_axis=replica_axis,
                mp_policy=mp_policy or MixedPrecisionPolicy(), remat=remat,
                reshard_after_forward=reshard_after_forward, tensor_parallel=tp)
