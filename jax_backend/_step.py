"""The FSDP training step: the model's forward on gathered units, reduce-scatter, optax on local shards.

One ``shard_map`` runs the step on every device's shards ``{unit: (S,)}`` and its copy of the model
state (what the model keeps besides its Params: batch statistics, RNG streams, counters; one copy per
data-parallel device, returned as the forward leaves it). A parameter's way through it
reads one way: the model's forward (``ShardedModel.forward``) asks the step's ``Units`` for a unit where it
uses it; ``Units`` gathers the unit's buffer and slices it (``_units``, ``_buffers``); the gather's VJP
reduce-scatters the gradient back to the shard; the optax update then runs on the local shards with optax's
result on the full params pytree (``shard_optimizer``: element-wise optimizers as they are, since padding
stays zero; masks, labels and norms on each device's pieces of every parameter).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_backend._buffers import (
    Axis,
    LayoutMismatchError,
    axis_names,
    axis_size,
    buffer_sharding,
    check_mesh,
    full_params,
    onto_mesh,
    pack_unit,
    shard_params,
)
from jax_backend._checkpoint_tree import abstract_checkpoint_tree, checkpoint_tree, from_checkpoint_tree
from jax_backend._compat import shard_map
from jax_backend._names import fqn
from jax_backend._optax import (
    UnsupportedOptimizerError,
    full_optimizer_state,
    shard_optimizer,
    shard_optimizer_state,
    state_specs,
)
from jax_backend._tensor_parallel import TensorParallel, full_tp_params, pack_tp_unit, shard_tp_params
from jax_backend._units import MixedPrecisionPolicy, Units
from ragged import Layout


class ShardedModel(Protocol):
    """What ``FSDP`` needs of a model (``shard_model`` builds one for an NNX module or a pure function).

    ``tree``: the parameter pytree optax sees, with ``jax.ShapeDtypeStruct`` leaves whose FQNs are the
    Layouts' tensor names. ``state``: the model state (everything the model keeps but its parameters:
    batch statistics, RNG streams, counters), abstract leaves; empty for a pure function.
    ``flatten(model)``: the model (or its params pytree) as ``{fqn: array}``. ``split_state(model)``: its
    model state, shaped like ``state``. ``forward(units, state, inputs)``: the model's output on
    ``inputs`` and its state after the forward, inside ``shard_map``, reading each unit's parameters
    through ``units`` (``Units.gather`` / ``Units.call``) and one device's model state.
    """

    @property
    def tree(self) -> Any: ...

    @property
    def state(self) -> Any: ...

    def flatten(self, model: Any) -> dict[str, jax.Array]: ...

    def split_state(self, model: Any) -> Any: ...

    def forward(self, units: Units, state: Any, inputs: Any) -> tuple[Any, Any]: ...


@dataclass(frozen=True)
class FSDP:
    """A model's FSDP plan on a mesh: its units' Layouts, its forward, and the mesh axes.

    Build it with ``shard_model`` (any flax NNX module or pure function), which also checks that the
    Layouts own the model's parameters.

    Args:
        mesh: the device mesh (``Auto`` axes; see ``make_mesh``).
        layouts: one core ``Layout`` per unit, planned for ``mesh.shape[axis]`` devices.
        model: the model's forward on gathered units and its parameter pytree (``ShardedModel``).
        axis: the mesh axis the buffers are sharded over, or several taken as one (``("ep", "fsdp")``).
        replica_axis: for HSDP, the mesh axis the shards are replicated over (gradients all-reduced).
        mp_policy: mixed precision (compute and reduce dtypes).
        remat: keep only each unit's shard and input from its forward; the backward re-gathers the unit
            and recomputes its activations (implies ``reshard_after_forward``).
        reshard_after_forward: free each unit's gathered parameters after its forward and re-gather them in
            its backward, keeping its activations (FSDP2's option of that name); ``None``: as ``remat``.
            ``shard_model`` passes True for NNX modules (its default, as FSDP2's).
        expert_layouts: units gathered over ``expert_axis`` only (expert parallelism: each EP rank's
            experts, ``ragged.models.ExpertParallelUnit``): ``{unit: its layout over expert_axis}``, under
            the model's names; ``layouts`` holds the unit's composition over ``axis`` (its buffer).
        expert_axis: the part of ``axis`` expert units are sharded over (``"fsdp"``).
        tensor_parallel: a tensor mesh axis and the dim of each parameter it splits
            (``_tensor_parallel``): the Layouts are then planned from the tensor ranks' local shapes and a
            unit's buffer is ``(T, W * S)``; the step is manual over the data axes only.

    Raises:
        LayoutMismatchError: an axis not in the mesh, or a world size the Layouts were not planned for.
        ValueError: ``remat=True`` with ``reshard_after_forward=False``.
    """

    mesh: Mesh
    layouts: tuple[Layout, ...]
    model: ShardedModel
    axis: Axis = "fsdp"
    replica_axis: str | None = None
    mp_policy: MixedPrecisionPolicy = field(default_factory=MixedPrecisionPolicy)
    remat: bool = False
    reshard_after_forward: bool | None = None
    expert_layouts: Mapping[str, Layout] = field(default_factory=dict)
    expert_axis: str | None = None
    tensor_parallel: TensorParallel | None = None

    def __post_init__(self) -> None:
        if self.remat and self.reshard_after_forward is False:
            raise ValueError("remat=True re-gathers each unit in its backward (it keeps only the shard and "
                             "the unit's input); it cannot be combined with reshard_after_forward=False")
        object.__setattr__(self, "layouts", tuple(self.layouts))
        check_mesh(self.mesh, self.layouts, self.axis, self.replica_axis)
        if self.expert_layouts:
            self._check_expert_layouts()
        if self.tensor_parallel is not None and self.tensor_parallel.axis in self.data_axes:
            raise LayoutMismatchError(f"the tensor axis {self.tensor_parallel.axis!r} is also a data axis "
                                      f"{self.data_axes}; tensor parallelism needs an axis of its own")
        if self.tensor_parallel is not None and self.expert_layouts:
            raise LayoutMismatchError("expert parallelism with a tensor axis is not supported yet: give "
                                      "expert_layouts or tensor_parallel, not both")

    def _check_expert_layouts(self) -> None:
        """Each expert unit's layout over ``expert_axis`` must tile its buffer over ``axis`` a whole number
        of times (one copy per EP rank)."""
        if self.expert_axis not in axis_names(self.axis):
            raise LayoutMismatchError(f"expert_axis={self.expert_axis!r} must be one of the shard axes "
                                      f"{axis_names(self.axis)}")
        whole = {lay.name: lay for lay in self.layouts}
        copies = axis_size(self.mesh, self.axis) // self.mesh.shape[self.expert_axis]
        for unit, local in self.expert_layouts.items():
            if unit not in whole or local.world_size != self.mesh.shape[self.expert_axis] or (
                    whole[unit].total_numel != copies * local.total_numel):
                raise LayoutMismatchError(
                    f"expert unit {unit!r}: its layout over {self.expert_axis!r} ({local.world_size} x "
                    f"{local.shard_size}) must be planned for mesh axis {self.expert_axis!r} "
                    f"({self.mesh.shape[self.expert_axis]} devices) and tile the unit's buffer in "
                    f"`layouts` {copies} times (ragged.models.plan_expert_parallel)")

    # ----- layout of data over the mesh --------------------------------------------------------------
    @property
    def data_axes(self) -> tuple[str, ...]:
        """The batch is split over every device: replicas first, then shards."""
        shard = axis_names(self.axis)
        return shard if self.replica_axis is None else (self.replica_axis, *shard)

    @property
    def data_size(self) -> int:
        """Devices the batch is split over."""
        return axis_size(self.mesh, self.data_axes)

    @property
    def _buffer_spec(self) -> P:
        """A buffer's spec in the step's ``shard_map`` (dim 0 of a ``(T, W * S)`` buffer is left to XLA)."""
        return P(self.axis) if self.tensor_parallel is None else P(None, self.axis)

    def _buffer_specs(self) -> dict[str, P]:
        return {lay.name: self._buffer_spec for lay in self.layouts}

    def _buffer_shape(self, layout: Layout) -> tuple[int, ...]:
        tp = self.tensor_parallel
        return (layout.total_numel,) if tp is None else (tp.size, layout.total_numel)

    def buffer_sharding(self) -> NamedSharding:
        """The sharding of every unit buffer: over ``axis`` (and the tensor axis first, with one)."""
        tp = self.tensor_parallel
        return buffer_sharding(self.mesh, self.axis) if tp is None else NamedSharding(
            self.mesh, P(tp.axis, self.axis))

    def _shard_map(self, f: Callable, in_specs: Any, out_specs: Any) -> Callable:
        """``shard_map`` manual over every axis, or over the data axes only with a tensor axis (``Auto``:
        XLA partitions the model's tensor-parallel arithmetic)."""
        manual = None if self.tensor_parallel is None else frozenset(self.data_axes)
        return shard_map(f, self.mesh, in_specs=in_specs, out_specs=out_specs, axis_names=manual)

    def shard_optimizer(self, optimizer: optax.GradientTransformation) -> optax.GradientTransformation:
        """``optimizer`` as the step runs it on the local shards, with optax's result on the full params.

        The params pytree optax sees is the model's (``ShardedModel.tree``); see
        ``jax_backend.shard_optimizer``.

        Raises:
            UnsupportedOptimizerError: a transformation the shards cannot honor, before anything runs.
        """
        sharded = shard_optimizer(optimizer, self.layouts, self.axis, self.model.tree)
        if self.tensor_parallel is not None and sharded is not optimizer:
            raise UnsupportedOptimizerError(
                "with a tensor axis the step runs element-wise optax transformations (adam, adamw, sgd, "
                "lion, ...) on the (T, S) shards; this one needs the parameters' pieces (masks, norms, "
                "labels) or the flat shards (on_shards), which tensor parallelism does not provide")
        return sharded

    def full_optimizer_state(self, optimizer: optax.GradientTransformation, state: Any) -> Any:
        """The step's state of ``optimizer`` as optax keeps it on the full params."""
        return full_optimizer_state(optimizer, state, self.layouts, self.model.tree)

    def shard_optimizer_state(self, optimizer: optax.GradientTransformation, state: Any) -> Any:
        """The inverse of ``full_optimizer_state``: optax's state on the full params (of this FSDP or of
        another mesh's, on any devices) -> the step's state of ``optimizer`` on this mesh
        (``jax_backend.shard_optimizer_state``)."""
        if self.tensor_parallel is not None:
            raise LayoutMismatchError("shard_optimizer_state with a tensor axis is not supported: the "
                                      "step's state holds (T, W * S) shards")
        return shard_optimizer_state(optimizer, state, self.layouts, self.mesh, self.axis, self.model.tree)

    def _state_specs(self, optimizer: optax.GradientTransformation) -> Any:
        """The shard_map specs of ``optimizer``'s state (``optimizer`` as ``shard_optimizer`` returns it)."""
        init = self._shard_map(optimizer.init, in_specs=(self._buffer_specs(),), out_specs=P())
        buffers = {lay.name: jax.ShapeDtypeStruct(self._buffer_shape(lay), jnp.float32)
                   for lay in self.layouts}
        return state_specs(jax.eval_shape(init, buffers), self.axis, self._buffer_spec)

    # ----- buffers -----------------------------------------------------------------------------------
    def shard_params(self, params: Any) -> dict[str, jax.Array]:
        """Full parameters -> sharded unit buffers (see ``shard_params``).

        ``params``: ``{fqn: array}``, the NNX module or the params pytree.
        """
        if not _is_fqn_dict(params, self.tensor_parallel or self.layouts):
            params = self.model.flatten(params)
        if self.tensor_parallel is not None:
            return shard_tp_params(params, self.layouts, self.mesh, self.axis, self.tensor_parallel)
        return shard_params(params, self.layouts, self.mesh, self.axis)

    def full_params(self, buffers: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        """Sharded unit buffers -> full ``{fqn: array}`` (see ``full_params``)."""
        if self.tensor_parallel is not None:
            return full_tp_params(buffers, self.layouts, self.tensor_parallel)
        return full_params(buffers, self.layouts)

    def init(self, optimizer: optax.GradientTransformation, buffers: Mapping[str, jax.Array]) -> Any:
        """``optimizer.init`` on the local shards (``shard_optimizer``): the optimizer state of the step."""
        optimizer = self.shard_optimizer(optimizer)
        specs = self._state_specs(optimizer)
        init = self._shard_map(optimizer.init, in_specs=(self._buffer_specs(),), out_specs=specs)
        if self.tensor_parallel is None:
            return jax.jit(init)(dict(buffers))
        # The specs leave dim 0 (tensor) to XLA, which replicates moments made from no input over it (T
        # copies, and a step compiled for them would not take the state it returns): place them as the
        # buffers, as the step does.
        shardings = jax.tree.map(lambda s: self.buffer_sharding() if s == self._buffer_spec
                                 else NamedSharding(self.mesh, s), specs)
        return jax.jit(init, out_shardings=shardings)(dict(buffers))

    def unit_initializer(self, make: Callable[[], Any], unit: str) -> Callable[[], jax.Array]:
        """A jitted ``() -> buffer`` of one unit, sharded like the buffers. ``make()`` (the model's
        constructor or params init) runs inside it and XLA keeps only this unit's tensors (the others are
        dead code), so no device holds more than this unit in full."""
        layout = next(lay for lay in self.layouts if lay.name == unit)
        if unit in self.expert_layouts:
            raise LayoutMismatchError(f"expert unit {unit!r} holds other experts on each EP rank: shard the "
                                      "full model's parameters instead (ExpertParallel.shard_params)")

        def init() -> jax.Array:
            params = self.model.flatten(make())
            mine = {t.name: params[t.name] for t in layout.tensors}
            tp = self.tensor_parallel
            return pack_unit(mine, layout) if tp is None else pack_tp_unit(mine, layout, tp)

        return jax.jit(init, out_shardings=self.buffer_sharding())

    # ----- model state: one copy per data-parallel device -------------------------------------------
    def _per_device(self, state: Any) -> Any:
        """``state`` stacked once per data-parallel device (dim 0, sharded over the data axes), each
        typed PRNG key folded with the device's index when there are several: device ``d``'s Dropout
        masks are then its own, as its batch rows are (one device keeps the model's own keys)."""
        n = self.data_size

        def stack(x: jax.Array) -> jax.Array:
            if n > 1 and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
                return jax.vmap(lambda d: jax.random.fold_in(x, d))(jnp.arange(n))
            return jnp.broadcast_to(x, (n, *jnp.shape(x)))

        return jax.tree.map(stack, state)

    def _state_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, P(self.data_axes))

    def shard_model_state(self, model: Any) -> Any:
        """The step's model state from a built model: every ``nnx.Variable`` but its Params (batch
        statistics, RNG streams, counters), one copy per data-parallel device on dim 0 (RNG keys folded
        with the device's index at more than one device). Empty for a pure function."""
        return self.stack_model_state(self.model.split_state(model))

    def stack_model_state(self, state: Any) -> Any:
        """One copy of the model state (``full_model_state``'s, of any mesh; on any devices) -> the step's,
        as ``shard_model_state`` makes it."""
        state = onto_mesh(state, self.mesh)  # another mesh's arrays, say
        return jax.jit(self._per_device, out_shardings=self._state_sharding())(state)

    def init_model_state(self, make: Callable[[], Any]) -> Any:
        """``shard_model_state(make())`` in one jitted program: XLA drops the parameters as dead code, so
        an abstract model (``nnx.eval_shape``) with ``init_params`` creates all of the model's state."""
        return jax.jit(lambda: self._per_device(self.model.split_state(make())),
                       out_shardings=self._state_sharding())()

    def full_model_state(self, model_state: Any, device: int = 0) -> Any:
        """One data-parallel device's copy of the model state (device 0: the first replica's first shard,
        as a DDP checkpoint saves rank 0's buffers), for ``nnx.update(model, ...)``."""
        return jax.tree.map(lambda a: a[device], model_state)

    # ----- checkpoints: a mesh-independent tree for Orbax (``_checkpoint_tree``) ------------------------
    def checkpoint_tree(self, buffers: Mapping[str, jax.Array],
                        optimizer: optax.GradientTransformation | None = None, opt_state: Any = None,
                        model_state: Any = None) -> dict[str, Any]:
        """``{"params": {fqn: array}, "opt_state": ..., "model_state": ...}``: per-parameter arrays
        spread over the mesh, for ``ocp.args.StandardSave`` (docs/orbax.md); restorable onto any mesh."""
        return checkpoint_tree(self, buffers, optimizer, opt_state, model_state)

    def abstract_checkpoint_tree(self, optimizer: optax.GradientTransformation | None = None,
                                 model_state: bool | None = None) -> dict[str, Any]:
        """The checkpoint tree's shapes, dtypes and this mesh's shardings: ``ocp.args.StandardRestore``'s
        target."""
        return abstract_checkpoint_tree(self, optimizer, model_state)

    def from_checkpoint_tree(self, tree: Mapping[str, Any],
                             optimizer: optax.GradientTransformation | None = None) -> tuple[dict, Any, Any]:
        """A checkpoint tree of any mesh -> ``(buffers, opt_state, model_state)`` of this step."""
        return from_checkpoint_tree(self, tree, optimizer)

    def init_params(self, make: Callable[[], Any]) -> dict[str, jax.Array]:
        """Sharded init: ``{unit: buffer}`` from ``make()`` without the model ever existing in full.

        ``make`` builds the model (``lambda: MyModel(rngs=nnx.Rngs(0))``) or the params pytree from a
        seed; one jitted program per unit writes that unit's buffer, so the values are the unsharded
        init's with the same seed on every device count.
        """
        return {lay.name: self.unit_initializer(make, lay.name)() for lay in self.layouts}

    # ----- the step ----------------------------------------------------------------------------------
    def forward(self, local: Mapping[str, jax.Array], state: Any, inputs: Any) -> tuple[Any, Any]:
        """Run the model on local shards and this device's model state (inside ``shard_map``), gathering
        each unit where it is used; returns the output and the model state after the forward."""
        units = Units(local, self.layouts, axis=self.axis, replica_axis=self.replica_axis,
                      mp_policy=self.mp_policy, remat=self.remat,
                      reshard_after_forward=self.reshard_after_forward, expert_layouts=self.expert_layouts,
                      expert_axis=self.expert_axis, tp=self.tensor_parallel)
        return self.model.forward(units, state, inputs)

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

    def check_model_state(self, model_state: Any) -> None:
        """Raise ``LayoutMismatchError`` unless ``model_state`` is this model's with one copy per data
        device (``shard_model_state`` of this FSDP: another mesh's has another count)."""
        if jax.tree_util.tree_structure(model_state) != jax.tree_util.tree_structure(self.model.state):
            raise LayoutMismatchError("model_state is not this model's (other variables): make it with "
                                      "fsdp.shard_model_state(model) or fsdp.init_model_state(make)")
        for path, leaf in jax.tree_util.tree_flatten_with_path(model_state)[0]:
            if not jnp.ndim(leaf) or leaf.shape[0] != self.data_size:
                raise LayoutMismatchError(
                    f"model_state leaf {fqn(path)} has shape {jnp.shape(leaf)}: dim 0 must be one copy per "
                    f"data-parallel device, {self.data_size} here; make it with this FSDP's "
                    "shard_model_state / init_model_state (or full_model_state, then shard_model_state)")

    def apply_optimizer(self, optimizer: optax.GradientTransformation, grads: dict, opt_state: Any,
                        local: dict) -> tuple[dict, Any]:
        """``optimizer`` (as ``shard_optimizer`` returns it) on the local shards ``{unit: (S,)}``.

        The seam for optimizers that need more than the flat shards: ``self.layouts`` (every tensor's
        offset in its unit) and ``self.model.tree`` (the model's param pytree).
        """
        updates, opt_state = optimizer.update(grads, opt_state, local)
        return optax.apply_updates(local, updates), opt_state

    def train_step(self, optimizer: optax.GradientTransformation,
                   loss_fn: Callable[[Any, Any], Any]) -> Callable:
        """A jitted ``step(buffers, opt_state, inputs, targets[, model_state])
        -> (buffers, opt_state, loss[, aux][, model_state])``.

        ``inputs`` and ``targets`` are global batches split on dim 0 over every device (replicas, then
        shards); ``loss_fn(outputs, targets)`` returns a per-device mean loss, or ``(loss, aux)``, and the
        step minimises its mean over devices (equal local batches make that the global mean); ``aux`` is
        averaged over devices and returned as a fourth output. A model with state besides its parameters
        (batch statistics, ``nnx.Rngs`` streams, counters) needs ``model_state``
        (``shard_model_state`` / ``init_model_state``): each device runs on its copy and the step returns
        the copies as the forward left them, last. ``buffers``, ``opt_state`` and ``model_state`` are
        donated.

        Raises:
            UnsupportedOptimizerError: an optimizer the shards cannot honor (``shard_optimizer``).
            LayoutMismatchError: optimizer state that is neither per-element nor scalar; a batch whose
                dim 0 the data-parallel size does not divide (when the step is traced).
            TypeError: a model with state called without ``model_state``.
            LayoutMismatchError: a ``model_state`` of another model or another data-parallel size.
        """
        n = self.data_size
        optimizer = self.shard_optimizer(optimizer)

        def local_step(local: dict, opt_state: Any, model_state: Any, inputs: Any, targets: Any) -> tuple:
            mine = jax.tree.map(lambda a: a[0], model_state)  # this device's copy

            def local_loss(bufs: dict) -> tuple[jax.Array, Any]:
                outputs, new_state = self.forward(bufs, mine, inputs)
                out = loss_fn(outputs, targets)
                loss, aux = out if isinstance(out, tuple) else (out, None)
                # Pre-divide so that the psum_scatter of the gradients is the mean over devices.
                return loss / n, (aux, new_state)

            (loss, (aux, new_state)), grads = jax.value_and_grad(local_loss, has_aux=True)(local)
            local, opt_state = self.apply_optimizer(optimizer, grads, opt_state, local)
            aux = jax.tree.map(lambda a: lax.psum(a, self.data_axes) / n, aux)
            new_state = jax.tree.map(lambda a: a[None], new_state)
            return local, opt_state, new_state, lax.psum(loss, self.data_axes), aux

        buffers, state, batch = self._buffer_specs(), self._state_specs(optimizer), P(self.data_axes)
        sharded = self._shard_map(local_step, in_specs=(buffers, state, batch, batch, batch),
                                  out_specs=(buffers, state, batch, P(), P()))
        has_state = bool(jax.tree.leaves(self.model.state))

        def step(buffers: dict, opt_state: Any, inputs: Any, targets: Any, model_state: Any = None) -> tuple:
            if model_state is None and has_state:
                names = [fqn(p) for p, _ in jax.tree_util.tree_flatten_with_path(self.model.state)[0]]
                raise TypeError(
                    f"the model keeps state besides its parameters ({names[:4]}{' ...' * (len(names) > 4)}): "
                    "pass model_state=fsdp.shard_model_state(model) (or fsdp.init_model_state(make)) as "
                    "the step's fifth argument; the step returns it updated, last")
            self.check_batch({"inputs": inputs, "targets": targets})
            if model_state is not None:
                self.check_model_state(model_state)
            new_buffers, new_opt, new_state, loss, aux = sharded(
                buffers, opt_state, {} if model_state is None else model_state, inputs, targets)
            if self.tensor_parallel is not None:  # keep dim 0 of the (T, S) shards on the tensor axis
                def pin(a: jax.Array) -> jax.Array:
                    return lax.with_sharding_constraint(a, self.buffer_sharding()) if a.ndim == 2 else a
                new_buffers, new_opt = jax.tree.map(pin, (new_buffers, new_opt))
            out = (new_buffers, new_opt, loss) + ((aux,) if aux is not None else ())
            return out + ((new_state,) if model_state is not None else ())

        return jax.jit(step, donate_argnums=(0, 1, 4))


def _is_fqn_dict(params: Any, names_of: tuple[Layout, ...] | TensorParallel) -> bool:
    names = (set(dict(names_of.dims)) if isinstance(names_of, TensorParallel)
             else {t.name for lay in names_of for t in lay.tensors})
    return isinstance(params, Mapping) and bool(params) and all(isinstance(k, str) for k in params) and (
        set(params) == names)
