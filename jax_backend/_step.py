"""The FSDP training step: per-unit all-gather, flax forward/backward, reduce-scatter, optax on local shards.

Inside one ``shard_map`` every device holds, per unit, its contiguous shard of ``S`` elements. The forward
is the user's model (``shard_model``) or a chain of hand-written *stages*, one per unit; where a unit is
used, ``all_gather(shard, tiled=True)`` rebuilds its flat buffer (in the compute dtype), static slices give
its parameters, and its code runs (``Units``). The gather is a
custom VJP whose backward is the unit's explicit ``psum_scatter(tiled=True)`` (in the reduce dtype),
followed by a ``psum`` over the replica axis under HSDP, so each device ends with the gradient of exactly
its own shard. The optax update then runs on the local shards with optax's result on the full params
pytree (``shard_optimizer``: element-wise optimizers as they are, since padding stays zero; masks, labels
and norms on each device's pieces of every parameter).

Only the units in use are unsharded. Three ways to keep a unit for its backward:
``reshard_after_forward=False`` (the default) keeps the gathered buffer from the forward, as FSDP2 does with
that option. ``reshard_after_forward=True`` frees it after the unit's forward: a ``jax.checkpoint`` whose
policy saves every activation but the gathered parameters, so the backward re-gathers the unit and
recomputes no arithmetic (FSDP2's ``reshard_after_forward=True``). ``remat=True`` keeps just the shard and
the stage input: the backward gathers the unit again and recomputes its activations too (FSDP2's option
with activation checkpointing of every unit).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jax_backend._buffers import (
    LayoutMismatchError,
    buffer_sharding,
    check_mesh,
    full_params,
    pack_unit,
    shard_params,
    unpack_unit,
)
from jax_backend._compat import shard_map
from jax_backend._names import flatten_params
from jax_backend._optax import full_optimizer_state, shard_optimizer, state_specs
from ragged import Layout


class Stage(NamedTuple):
    """One FSDP unit's part of the forward: ``apply({fqn: full param}, h) -> h``."""

    unit: str
    apply: Callable[[Mapping[str, jax.Array], Any], Any]


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes of the gathered parameters (compute) and of the gradient reduction; None keeps the master's.

    The master shards and the optimizer state stay in the buffers' dtype (fp32).
    """

    param_dtype: Any = None
    reduce_dtype: Any = None


class _Comm(NamedTuple):
    """Static arguments of the unit gather (hashable, so they can be ``nondiff_argnums``)."""

    axis: str
    replica_axis: str | None
    param_dtype: Any
    reduce_dtype: Any
    master_dtype: Any


def _all_gather(shard: jax.Array, comm: _Comm) -> jax.Array:
    return lax.all_gather(shard.astype(comm.param_dtype), comm.axis, tiled=True)


def _reduce_scatter(grad: jax.Array, comm: _Comm) -> jax.Array:
    """The transpose of the tiled all-gather: each device receives the sum of its own slice."""
    shard_grad = lax.psum_scatter(grad.astype(comm.reduce_dtype), comm.axis, scatter_dimension=0, tiled=True)
    if comm.replica_axis is not None:
        shard_grad = lax.psum(shard_grad, comm.replica_axis)  # HSDP: reduce-scatter, then all-reduce
    return shard_grad.astype(comm.master_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def gather_unit(shard: jax.Array, comm: _Comm) -> jax.Array:
    """All-gather a unit's shard ``(S,)`` into its flat buffer ``(W * S,)`` in the compute dtype.

    Its VJP is the unit's reduce-scatter (then the replica all-reduce under HSDP), in the reduce dtype.
    """
    return _all_gather(shard, comm)


gather_unit.defvjp(lambda shard, comm: (_all_gather(shard, comm), None),
                   lambda comm, _, grad: (_reduce_scatter(grad, comm),))


def _depend_on(shard: jax.Array, grad: Any) -> jax.Array:
    """``shard`` plus a (signed) zero taken from ``grad``, NaN-safe: a re-gather of the shard in the backward
    then depends on the incoming gradient. Otherwise XLA sees the forward's identical all-gather and merges
    the two (XLA:CPU drops optimization barriers first), which would keep every unit unsharded from its
    forward to its backward."""
    first = jax.tree.leaves(grad)[0].ravel()[0]
    return shard + (jnp.where(jnp.isfinite(first), first, 0) * 0).astype(shard.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def run_resharded(apply: Callable, layout: Layout, comm: _Comm, shard: jax.Array, h: Any) -> Any:
    """``apply(unit params, h)`` on the gathered unit, keeping only ``(shard, h)`` for the backward.

    The backward gathers the unit again, runs the stage's VJP (recomputing its activations) and
    reduce-scatters: the unsharded buffer lives during this stage's forward and its backward only
    (``remat``).
    """
    return apply(unpack_unit(_all_gather(shard, comm), layout), h)


def _resharded_fwd(apply: Callable, layout: Layout, comm: _Comm, shard: jax.Array, h: Any) -> tuple:
    return run_resharded(apply, layout, comm, shard, h), (shard, h)


def _resharded_bwd(apply: Callable, layout: Layout, comm: _Comm, res: tuple, grad: Any) -> tuple:
    shard, h = res
    _, vjp = jax.vjp(lambda full, x: apply(unpack_unit(full, layout), x),
                     _all_gather(_depend_on(shard, grad), comm), h)
    full_grad, h_grad = vjp(grad)
    return _reduce_scatter(full_grad, comm), h_grad


run_resharded.defvjp(_resharded_fwd, _resharded_bwd)


_UNIT_SHARD = "ragged_fsdp_unit_shard"
# Saving these would keep a copy of the gathered parameters (a slice, a reshape, ``w.T``, a cast), so the
# backward recomputes them from the re-gathered unit; they move bytes and compute nothing (applied to an
# activation, the backward recomputes them from the saved input: a copy, no arithmetic).
_RECOMPUTED = frozenset({"all_gather", "slice", "reshape", "transpose", "convert_element_type", "squeeze",
                         "expand_dims", "broadcast_in_dim", "copy", "copy_p"})


def _save_activations(prim: Any, *_: Any, **params: Any) -> bool:
    """``jax.checkpoint`` policy: save every value of the unit's forward but its shard's gather and the
    layout ops above, so the backward re-gathers the unit and recomputes no arithmetic."""
    if prim.name == "name":
        return params["name"] != _UNIT_SHARD
    return prim.name not in _RECOMPUTED


def _residual_as_argument(vjp: Any, leaf: jax.Array) -> jax.tree_util.Partial:
    """``vjp`` (a pytree over its residuals) as ``f(new_leaf, grad)``: the residuals that are ``leaf`` (none
    when the backward needs no parameter, e.g. an embedding's) are replaced by ``new_leaf`` when it runs."""
    leaves, treedef = jax.tree_util.tree_flatten(vjp)
    # jax.vjp passes a primal input that the backward needs through as a residual, the same tracer. Were
    # that to change, nothing would be replaced: still correct, but XLA would merge the two gathers (the
    # compiled-program tests count them).
    where = {i for i, x in enumerate(leaves) if x is leaf}

    def call(*args: Any) -> Any:
        *rest, new_leaf, grad = args
        for i in sorted(where):
            rest.insert(i, new_leaf)
        return jax.tree_util.tree_unflatten(treedef, rest)(grad)

    return jax.tree_util.Partial(call, *(x for i, x in enumerate(leaves) if i not in where))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def run_keeping_activations(apply: Callable, layout: Layout, comm: _Comm, shard: jax.Array, h: Any) -> Any:
    """``apply(unit params, h)`` on the gathered unit, keeping its activations but not the gathered unit.

    The forward is ``jax.checkpoint`` of gather and ``apply`` with a policy that saves every value but the
    gather and the layout ops on the parameters (``_save_activations``), so the backward re-gathers the unit
    and runs the stage's VJP on the saved activations (FSDP2's ``reshard_after_forward=True``). This custom
    VJP around it hands that backward the shard as ``_depend_on(shard, grad)``: given the forward's shard,
    the two all-gathers would be identical and XLA would merge them.
    """
    return apply(unpack_unit(_all_gather(shard, comm), layout), h)


def _checkpointed(apply: Callable, layout: Layout, comm: _Comm) -> Callable:
    def forward(shard: jax.Array, h: Any) -> Any:
        return apply(unpack_unit(gather_unit(checkpoint_name(shard, _UNIT_SHARD), comm), layout), h)

    return jax.checkpoint(forward, policy=_save_activations)


def _keeping_fwd(apply: Callable, layout: Layout, comm: _Comm, shard: jax.Array, h: Any) -> tuple:
    out, vjp = jax.vjp(_checkpointed(apply, layout, comm), shard, h)
    return out, (shard, _residual_as_argument(vjp, shard))


def _keeping_bwd(apply: Callable, layout: Layout, comm: _Comm, res: tuple, grad: Any) -> tuple:
    shard, vjp = res
    return vjp(_depend_on(shard, grad), grad)


run_keeping_activations.defvjp(_keeping_fwd, _keeping_bwd)


class Units:
    """The unit buffers of one forward inside ``shard_map``: gathers a unit where it is used.

    ``gather(unit)`` returns the unit's ``{fqn: array}`` (the all-gather's VJP reduce-scatters the
    gradient); ``call(unit, apply, h)`` runs ``apply({fqn: array}, h)`` on the gathered unit, re-gathering
    it in the backward under ``reshard_after_forward`` or ``remat`` (then ``apply`` must read nothing but
    its arguments).
    """

    def __init__(self, fsdp: FSDP, local: Mapping[str, jax.Array]):
        self.fsdp, self.local = fsdp, local
        self.layouts = {lay.name: lay for lay in fsdp.layouts}

    def _comm(self, unit: str) -> _Comm:
        master, mp = self.local[unit].dtype, self.fsdp.mp_policy
        return _Comm(self.fsdp.axis, self.fsdp.replica_axis, mp.param_dtype or master,
                     mp.reduce_dtype or master, master)

    def gather(self, unit: str) -> dict[str, jax.Array]:
        return unpack_unit(gather_unit(self.local[unit], self._comm(unit)), self.layouts[unit])

    def call(self, unit: str, apply: Callable[[Mapping[str, jax.Array], Any], Any], h: Any) -> Any:
        if self.fsdp.remat:
            return run_resharded(apply, self.layouts[unit], self._comm(unit), self.local[unit], h)
        if self.fsdp.reshard_after_forward:
            return run_keeping_activations(apply, self.layouts[unit], self._comm(unit), self.local[unit], h)
        return apply(self.gather(unit), h)


def _stage_chain(stages: tuple[Stage, ...]) -> Callable[[Units, Any], Any]:
    def forward(units: Units, inputs: Any) -> Any:
        h = inputs
        for stage in stages:
            h = units.call(stage.unit, stage.apply, h)
        return h

    return forward


@dataclass(frozen=True)
class FSDP:
    """A model's FSDP plan on a mesh: its units' Layouts, its forward, and the mesh axes.

    Build it with ``shard_model`` (any flax NNX module or pure function); ``stages`` is the hand-written
    alternative: the forward as a chain of one ``Stage`` per unit, in the Layouts' order.

    Args:
        mesh: the device mesh (``Auto`` axes; see ``make_mesh``).
        layouts: one core ``Layout`` per unit, planned for ``mesh.shape[axis]`` devices.
        stages: the forward, one ``Stage`` per unit, in the Layouts' order (when ``model`` is None).
        axis: the mesh axis the buffers are sharded over.
        replica_axis: for HSDP, the mesh axis the shards are replicated over (gradients all-reduced).
        mp_policy: mixed precision (compute and reduce dtypes).
        remat: keep only each unit's shard and input from its forward; the backward re-gathers the unit
            and recomputes its activations (implies ``reshard_after_forward``).
        reshard_after_forward: free each unit's gathered parameters after its forward and re-gather them in
            its backward, keeping its activations (FSDP2's option of that name); ``None``: as ``remat``.
        model: the user's model as ``shard_model`` wraps it: ``model.forward(units, inputs)`` runs it on
            gathered units, ``model.tree`` is its parameter pytree (``jax.ShapeDtypeStruct`` leaves) and
            ``model.fqns`` the FQN of each of its leaves, in flattening order (the Layouts' names).

    Raises:
        LayoutMismatchError: an axis not in the mesh, a world size the Layouts were not planned for, or
            stages that do not name the Layouts' units in order.
    """

    mesh: Mesh
    layouts: tuple[Layout, ...]
    stages: tuple[Stage, ...] = ()
    axis: str = "fsdp"
    replica_axis: str | None = None
    mp_policy: MixedPrecisionPolicy = field(default_factory=MixedPrecisionPolicy)
    remat: bool = False
    model: Any = None
    reshard_after_forward: bool | None = None

    def __post_init__(self) -> None:
        if self.remat and self.reshard_after_forward is False:
            raise ValueError("remat=True re-gathers each unit in its backward (it keeps only the shard and "
                             "the unit's input); it cannot be combined with reshard_after_forward=False")
        object.__setattr__(self, "layouts", tuple(self.layouts))
        object.__setattr__(self, "stages", tuple(self.stages))
        check_mesh(self.mesh, self.layouts, self.axis, self.replica_axis)
        units, stage_units = [lay.name for lay in self.layouts], [s.unit for s in self.stages]
        if self.model is None and units != stage_units:
            raise LayoutMismatchError(f"stages run units {stage_units}, but the layouts are {units}")

    # ----- layout of data over the mesh --------------------------------------------------------------
    @property
    def data_axes(self) -> tuple[str, ...]:
        """The batch is split over every device: replicas first, then shards."""
        return (self.axis,) if self.replica_axis is None else (self.replica_axis, self.axis)

    @property
    def data_size(self) -> int:
        """Devices the batch is split over."""
        size = 1
        for a in self.data_axes:
            size *= self.mesh.shape[a]
        return size

    def _buffer_specs(self) -> dict[str, P]:
        return {lay.name: P(self.axis) for lay in self.layouts}

    def shard_optimizer(self, optimizer: optax.GradientTransformation) -> optax.GradientTransformation:
        """``optimizer`` as the step runs it on the local shards, with optax's result on the full params.

        The params pytree optax sees is the user's (``shard_model``), else ``{fqn: array}``; see
        ``jax_backend.shard_optimizer``.

        Raises:
            UnsupportedOptimizerError: a transformation the shards cannot honor, before anything runs.
        """
        return shard_optimizer(optimizer, self.layouts, self.axis,
                               self.model.tree if self.model is not None else None)

    def full_optimizer_state(self, optimizer: optax.GradientTransformation, state: Any) -> Any:
        """The step's state of ``optimizer`` as optax keeps it on the full params."""
        return full_optimizer_state(optimizer, state, self.layouts,
                                    self.model.tree if self.model is not None else None)

    def _state_specs(self, optimizer: optax.GradientTransformation) -> Any:
        """The shard_map specs of ``optimizer``'s state (``optimizer`` as ``shard_optimizer`` returns it)."""
        init = shard_map(optimizer.init, self.mesh, in_specs=(self._buffer_specs(),), out_specs=P())
        buffers = {lay.name: jax.ShapeDtypeStruct((lay.total_numel,), jnp.float32) for lay in self.layouts}
        return state_specs(jax.eval_shape(init, buffers), self.axis)

    # ----- buffers -----------------------------------------------------------------------------------
    def shard_params(self, params: Any) -> dict[str, jax.Array]:
        """Full parameters -> sharded unit buffers (see ``shard_params``).

        ``params``: ``{fqn: array}``, or (with ``shard_model``) the NNX module or the params pytree.
        """
        if self.model is not None and not _is_fqn_dict(params, self.layouts):
            params = self.model.flatten(params)
        return shard_params(params, self.layouts, self.mesh, self.axis)

    def full_params(self, buffers: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        """Sharded unit buffers -> full ``{fqn: array}`` (see ``full_params``)."""
        return full_params(buffers, self.layouts)

    def init(self, optimizer: optax.GradientTransformation, buffers: Mapping[str, jax.Array]) -> Any:
        """``optimizer.init`` on the local shards (``shard_optimizer``): the optimizer state of the step."""
        optimizer = self.shard_optimizer(optimizer)
        specs = self._state_specs(optimizer)
        init = shard_map(optimizer.init, self.mesh, in_specs=(self._buffer_specs(),), out_specs=specs)
        return jax.jit(init)(dict(buffers))

    def unit_initializer(self, make: Callable[[], Any], unit: str) -> Callable[[], jax.Array]:
        """A jitted ``() -> buffer`` of one unit, sharded like the buffers. ``make()`` (the model's
        constructor or params init) runs inside it and XLA keeps only this unit's tensors (the others are
        dead code), so no device holds more than this unit in full."""
        layout = next(lay for lay in self.layouts if lay.name == unit)

        def init() -> jax.Array:
            made = make()
            params = self.model.flatten(made) if self.model is not None else flatten_params(made)
            return pack_unit({t.name: params[t.name] for t in layout.tensors}, layout)

        return jax.jit(init, out_shardings=buffer_sharding(self.mesh, self.axis))

    def init_params(self, make: Callable[[], Any]) -> dict[str, jax.Array]:
        """Sharded init: ``{unit: buffer}`` from ``make()`` without the model ever existing in full.

        ``make`` builds the model (``lambda: MyModel(rngs=nnx.Rngs(0))``) or the params pytree from a
        seed; one jitted program per unit writes that unit's buffer, so the values are the unsharded
        init's with the same seed on every device count.
        """
        return {lay.name: self.unit_initializer(make, lay.name)() for lay in self.layouts}

    # ----- the step ----------------------------------------------------------------------------------
    def forward(self, local: Mapping[str, jax.Array], inputs: Any) -> Any:
        """Run the model on local shards (inside ``shard_map``), gathering each unit where it is used."""
        run = self.model.forward if self.model is not None else _stage_chain(self.stages)
        return run(Units(self, local), inputs)

    def check_batch(self, batches: Any) -> None:
        """Raise ``LayoutMismatchError`` unless every batch leaf splits evenly over the data devices."""
        for path, leaf in jax.tree_util.tree_flatten_with_path(batches)[0]:
            rows = leaf.shape[0] if getattr(leaf, "ndim", 0) else None
            if rows is None or rows % self.data_size:
                raise LayoutMismatchError(
                    f"batch leaf {jax.tree_util.keystr(path)} has shape {getattr(leaf, 'shape', ())}: its "
                    f"dim 0 must be divisible by the data-parallel size {self.data_size} (mesh axes "
                    f"{self.data_axes} = {[self.mesh.shape[a] for a in self.data_axes]})"
                )

    def apply_optimizer(self, optimizer: optax.GradientTransformation, grads: dict, opt_state: Any,
                        local: dict) -> tuple[dict, Any]:
        """``optimizer`` (as ``shard_optimizer`` returns it) on the local shards ``{unit: (S,)}``.

        The seam for optimizers that need more than the flat shards: ``self.layouts`` (every tensor's
        offset in its unit) and ``self.model.tree`` / ``self.model.fqns`` (the user's param pytree).
        """
        updates, opt_state = optimizer.update(grads, opt_state, local)
        return optax.apply_updates(local, updates), opt_state

    def train_step(self, optimizer: optax.GradientTransformation,
                   loss_fn: Callable[[Any, Any], Any]) -> Callable:
        """A jitted ``step(buffers, opt_state, inputs, targets) -> (buffers, opt_state, loss[, aux])``.

        ``inputs`` and ``targets`` are global batches split on dim 0 over every device (replicas, then
        shards); ``loss_fn(outputs, targets)`` returns a per-device mean loss, or ``(loss, aux)``, and the
        step minimises its mean over devices (equal local batches make that the global mean); ``aux`` is
        averaged over devices and returned as a fourth output. ``buffers`` and ``opt_state`` are donated.

        Raises:
            UnsupportedOptimizerError: an optimizer the shards cannot honor (``shard_optimizer``).
            LayoutMismatchError: optimizer state that is neither per-element nor scalar; a batch whose
                dim 0 the data-parallel size does not divide (when the step is traced).
        """
        n = self.data_size
        optimizer = self.shard_optimizer(optimizer)

        def local_step(local: dict, opt_state: Any, inputs: Any, targets: Any) -> tuple:
            def local_loss(bufs: dict) -> tuple[jax.Array, Any]:
                out = loss_fn(self.forward(bufs, inputs), targets)
                loss, aux = out if isinstance(out, tuple) else (out, None)
                # Pre-divide so that the psum_scatter of the gradients is the mean over devices.
                return loss / n, aux

            (loss, aux), grads = jax.value_and_grad(local_loss, has_aux=True)(local)
            local, opt_state = self.apply_optimizer(optimizer, grads, opt_state, local)
            aux = jax.tree.map(lambda a: lax.psum(a, self.data_axes) / n, aux)
            return local, opt_state, lax.psum(loss, self.data_axes), aux

        buffers, state, batch = self._buffer_specs(), self._state_specs(optimizer), P(self.data_axes)
        sharded = shard_map(local_step, self.mesh, in_specs=(buffers, state, batch, batch),
                            out_specs=(buffers, state, P(), P()))

        def step(buffers: dict, opt_state: Any, inputs: Any, targets: Any) -> tuple:
            self.check_batch({"inputs": inputs, "targets": targets})
            *out, aux = sharded(buffers, opt_state, inputs, targets)
            return (*out, aux) if aux is not None else tuple(out)

        return jax.jit(step, donate_argnums=(0, 1))


def _is_fqn_dict(params: Any, layouts: tuple[Layout, ...]) -> bool:
    names = {t.name for lay in layouts for t in lay.tensors}
    return isinstance(params, Mapping) and bool(params) and all(isinstance(k, str) for k in params) and (
        set(params) == names)
