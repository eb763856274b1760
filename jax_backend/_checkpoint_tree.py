"""The training state as a mesh-independent pytree of per-parameter arrays: what Orbax saves and restores.

A unit buffer's layout depends on the mesh size (each size is planned anew), so a checkpoint of the
buffers themselves could only be restored onto the same size. The checkpoint tree holds what does not
depend on the mesh: ``{"params": {fqn: array}, "opt_state": {path: array}, "model_state": {path:
array}}``, the optimizer state as optax keeps it on the full params (``full_optimizer_state``) and the
model state as one copy (device 0's, as a DDP checkpoint keeps rank 0's buffers; PRNG keys as their key
data). Every array is sharded over the mesh's devices on its first dim that their count divides
(``spread``), else replicated: Orbax writes each device's shard and reads back only the shards of the
mesh it restores onto, so no device holds a whole parameter that the mesh can split. No
module here imports Orbax: ``ocp.args.StandardSave(tree)`` and ``StandardRestore(abstract_tree)`` are
all it takes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_backend._buffers import Axis, LayoutMismatchError, anonymous, full_params, shard_params
from jax_backend._names import fqn
from jax_backend._optax import full_optimizer_state, shard_optimizer_state
from ragged import Layout

if TYPE_CHECKING:
    from jax_backend._step import FSDP


def spread(shape: tuple[int, ...], mesh: Mesh) -> NamedSharding:
    """An array's sharding in the checkpoint tree: its first dim that the mesh's device count divides,
    split over every mesh axis; failing that, over the largest single axis that divides a dim (HSDP's
    replicas, say); replicated when none does (odd biases, scalars, and every tensor on a 1-D mesh whose
    size divides none of its dims: a jax.Array's shards are equal)."""
    names = tuple(mesh.axis_names)
    for axes in (names, *sorted(((a,) for a in names), key=lambda a: -mesh.shape[a[0]])):
        size = math.prod(mesh.shape[a] for a in axes)
        dim = next((i for i, n in enumerate(shape) if n % size == 0), None) if size > 1 else None
        if dim is not None:
            return NamedSharding(mesh, P(*([None] * dim), axes))
    return NamedSharding(mesh, P())


def _by_path(tree: Any) -> dict[str, Any]:
    return {fqn(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _from_paths(like: Any, values: Mapping[str, Any], part: str) -> Any:
    """``values`` (``{path: array}``) in the structure of ``like``, naming the first missing path."""
    paths, treedef = jax.tree_util.tree_flatten_with_path(like)
    names = [fqn(path) for path, _ in paths]
    missing = [n for n in names if n not in values]
    if missing or len(values) != len(names):
        raise LayoutMismatchError(f"checkpoint {part!r} does not match this model and optimizer: missing "
                                  f"{missing[:4]}, unexpected {sorted(set(values) - set(names))[:4]}")
    return jax.tree_util.tree_unflatten(treedef, [values[n] for n in names])


def _is_key(x: Any) -> bool:
    return jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _as_data(x: jax.Array) -> jax.Array:
    """A typed PRNG key as its key data (uint32, which any checkpoint format stores); others as they are."""
    return jax.random.key_data(x) if _is_key(x) else x


def _as_key(like: jax.ShapeDtypeStruct, x: Any) -> Any:
    """``x`` as ``like``'s typed PRNG key when ``like`` is one (key data saved by ``_as_data``)."""
    if not _is_key(like):
        return x
    key = jax.random.wrap_key_data(x)  # JAX's default implementation, which nnx.Rngs draws with
    if key.dtype != like.dtype:
        raise LayoutMismatchError(f"the model's PRNG keys are {like.dtype}, restored as {key.dtype}: "
                                  "restore with the default PRNG implementation the model was built with")
    return key


def _check_fsdp(fsdp: FSDP) -> None:
    if fsdp.tensor_parallel is not None or fsdp.expert_layouts:
        raise LayoutMismatchError("the checkpoint tree supports FSDP and HSDP meshes; with a tensor axis or "
                                  "expert parallelism use the neutral checkpoint (save_neutral_checkpoint)")


@functools.partial(jax.jit, static_argnames=("layout", "mesh"))
def unpack_unit(buffer: jax.Array, layout: Layout, mesh: Mesh) -> tuple[jax.Array, ...]:
    """One unit's buffer -> its tensors in Layout order (``full_params``), each spread on ``mesh``: one
    program per unit structure and mesh (``unpack_per_unit`` passes the ``anonymous`` layout), compiled
    once (a run saving every N steps reuses it)."""
    tensors = full_params({layout.name: buffer}, [layout])
    return tuple(lax.with_sharding_constraint(tensors[t.name], spread(t.shape, mesh)) for t in layout.tensors)


def unpack_per_unit(buffers: Mapping[str, jax.Array], layouts: Sequence[Layout]) -> dict[str, jax.Array]:
    """``full_params`` one unit per program (``unpack_unit``): no program holds more than one unit in
    full."""
    out = {}
    for lay in layouts:
        tensors = unpack_unit(buffers[lay.name], anonymous(lay), buffers[lay.name].sharding.mesh)
        out.update(zip((t.name for t in lay.tensors), tensors))
    return out


def pack_per_unit(params: Mapping[str, Any], layouts: Sequence[Layout], mesh: Mesh,
                  axis: Axis) -> dict[str, jax.Array]:
    """``shard_params`` one unit per program."""
    out = {}
    for lay in layouts:
        out.update(shard_params({t.name: params[t.name] for t in lay.tensors}, [lay], mesh, axis))
    return out


def checkpoint_tree(fsdp: FSDP, buffers: Mapping[str, jax.Array],
                    optimizer: optax.GradientTransformation | None = None, opt_state: Any = None,
                    model_state: Any = None) -> dict[str, Any]:
    """The step's buffers (and optimizer state, model state) as the checkpoint tree (module docstring).

    Parameters and the optimizer state's slots are unpacked one unit per program (static slices,
    exact), so no program holds more than one unit in full.
    """
    _check_fsdp(fsdp)
    tree = {"params": unpack_per_unit(buffers, fsdp.layouts)}
    if optimizer is not None:
        tree["opt_state"] = _by_path(full_optimizer_state(optimizer, opt_state, fsdp.layouts, fsdp.model.tree,
                                                          unpack=unpack_per_unit))
    if model_state is not None:
        def first(state: Any) -> dict[str, jax.Array]:
            return {k: _as_data(v) for k, v in _by_path(fsdp.full_model_state(state)).items()}

        tree["model_state"] = jax.jit(first, out_shardings=NamedSharding(fsdp.mesh, P()))(model_state)
    return tree


def abstract_checkpoint_tree(fsdp: FSDP, optimizer: optax.GradientTransformation | None = None,
                             model_state: bool | None = None) -> dict[str, Any]:
    """The checkpoint tree's ``jax.ShapeDtypeStruct``s with this mesh's shardings: the target that
    ``ocp.args.StandardRestore`` restores onto (the checkpoint may come from any mesh). ``model_state``:
    include it (default: when the model has state)."""
    _check_fsdp(fsdp)
    mesh = fsdp.mesh

    def struct(x: Any, sharding: NamedSharding | None = None) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding or spread(x.shape, mesh))

    tree = {"params": {k: struct(v) for k, v in _by_path(fsdp.model.tree).items()}}
    if optimizer is not None:
        opt = jax.eval_shape(optimizer.init, fsdp.model.tree)
        tree["opt_state"] = {k: struct(v) for k, v in _by_path(opt).items()}
    if model_state if model_state is not None else bool(jax.tree.leaves(fsdp.model.state)):
        data = jax.eval_shape(lambda s: jax.tree.map(_as_data, s), fsdp.model.state)
        tree["model_state"] = {k: struct(v, NamedSharding(mesh, P())) for k, v in _by_path(data).items()}
    return tree


def from_checkpoint_tree(fsdp: FSDP, tree: Mapping[str, Any],
                         optimizer: optax.GradientTransformation | None = None) -> tuple[dict, Any, Any]:
    """A checkpoint tree (restored onto this mesh, or on any devices or the host) -> ``(buffers,
    opt_state, model_state)`` of this FSDP's step; ``None`` for a part the tree does not hold.

    Each unit of the parameters and of the optimizer state's slots is packed by a program of its own
    (``shard_params`` of its tensors, ``shard_optimizer_state``); the model state is re-stacked once per
    data-parallel device, its RNG keys folded with the device's index (as ``shard_model_state``).

    Raises:
        LayoutMismatchError: a tree of another model or optimizer (naming the paths), or a missing part.
    """
    _check_fsdp(fsdp)
    params = _by_path(_from_paths(fsdp.model.tree, tree["params"], "params"))
    buffers = pack_per_unit(params, fsdp.layouts, fsdp.mesh, fsdp.axis)
    opt_state = model_state = None
    if optimizer is not None:
        if "opt_state" not in tree:
            raise LayoutMismatchError("the checkpoint holds no 'opt_state': restore without the optimizer")
        full = _from_paths(jax.eval_shape(optimizer.init, fsdp.model.tree), tree["opt_state"], "opt_state")
        opt_state = shard_optimizer_state(optimizer, full, fsdp.layouts, fsdp.mesh, fsdp.axis,
                                          fsdp.model.tree, pack=pack_per_unit)
    if "model_state" in tree:
        state = _from_paths(fsdp.model.state, tree["model_state"], "model_state")
        state = jax.tree.map(_as_key, fsdp.model.state, state)
        model_state = fsdp.stack_model_state(state)  # keys refolded, as shard_model_state
    return buffers, opt_state, model_state

