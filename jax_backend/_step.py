"""The FSDP training step: per-unit all-gather, flax forward/backward, reduce-scatter, optax on local shards.

Inside one ``shard_map`` every device holds, per unit, its contiguous shard of ``S`` elements. The forward
walks the model as a chain of *stages*, one per unit: ``all_gather(shard, tiled=True)`` rebuilds the unit's
flat buffer (in the compute dtype), static slices give its parameters, and the stage runs. The gather is a
custom VJP whose backward is the unit's explicit ``psum_scatter(tiled=True)`` (in the reduce dtype),
followed by a ``psum`` over the replica axis under HSDP, so each device ends with the gradient of exactly
its own shard. The optax update then runs on the local shards: element-wise optimizers (Adam, AdamW, SGD)
give the same result as on the full parameters, because padding stays zero (zero gradient, zero value).

Only the units in use are unsharded. With ``remat=True`` each stage is a custom VJP that keeps just the
shard and the stage input: its backward gathers the unit again, runs the stage's VJP (recomputing its
activations) and reduce-scatters (``reshard_after_forward`` in FSDP2's words). With ``remat=False`` the
gathered buffers are kept from the forward for the backward, as FSDP2 does with
``reshard_after_forward=False``.
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
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jax_backend._buffers import LayoutMismatchError, check_mesh, shard_params, unpack_unit, unshard_params
from jax_backend._compat import shard_map
from jax_backend._optax import check_optimizer
from ragged import Layout


class Stage(NamedTuple):
    """One FSDP unit's part of the forward: ``apply({fqn: full param}, h) -> h``."""

    unit: str
    apply: Callable[[Mapping[str, jax.Array], Any], Any]


@dataclass(frozen=True)
class MixedPrecision:
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def run_resharded(apply: Callable, layout: Layout, comm: _Comm, shard: jax.Array, h: Any) -> Any:
    """``apply(unit params, h)`` on the gathered unit, keeping only ``(shard, h)`` for the backward.

    The backward gathers the unit again, runs the stage's VJP and reduce-scatters: the unsharded buffer
    lives during this stage's forward and its backward only (``reshard_after_forward``).
    """
    return apply(unpack_unit(_all_gather(shard, comm), layout), h)


def _resharded_fwd(apply: Callable, layout: Layout, comm: _Comm, shard: jax.Array, h: Any) -> tuple:
    return run_resharded(apply, layout, comm, shard, h), (shard, h)


def _resharded_bwd(apply: Callable, layout: Layout, comm: _Comm, res: tuple, grad: Any) -> tuple:
    shard, h = res
    # Make the re-gather depend on the incoming gradient. Otherwise XLA sees the forward's identical
    # all-gather and merges the two (XLA:CPU drops optimization barriers first), which would keep every
    # unit unsharded from its forward to its backward. The added value is a (signed) zero, NaN-safe.
    first = jax.tree.leaves(grad)[0].ravel()[0]
    shard = shard + (jnp.where(jnp.isfinite(first), first, 0) * 0).astype(shard.dtype)
    _, vjp = jax.vjp(lambda full, x: apply(unpack_unit(full, layout), x), _all_gather(shard, comm), h)
    full_grad, h_grad = vjp(grad)
    return _reduce_scatter(full_grad, comm), h_grad


run_resharded.defvjp(_resharded_fwd, _resharded_bwd)


@dataclass(frozen=True)
class FSDP:
    """A model's FSDP plan on a mesh: its units' Layouts, its forward as stages, and the mesh axes.

    Args:
        mesh: the device mesh (``Auto`` axes; see ``make_mesh``).
        layouts: one core ``Layout`` per unit, planned for ``mesh.shape[axis]`` devices.
        stages: the forward, one ``Stage`` per unit, in the Layouts' order.
        axis: the mesh axis the buffers are sharded over.
        replica_axis: for HSDP, the mesh axis the shards are replicated over (gradients all-reduced).
        mp: mixed precision (compute and reduce dtypes).
        remat: re-gather each unit in the backward instead of keeping it from the forward.

    Raises:
        LayoutMismatchError: an axis not in the mesh, a world size the Layouts were not planned for, or
            stages that do not name the Layouts' units in order.
    """

    mesh: Mesh
    layouts: tuple[Layout, ...]
    stages: tuple[Stage, ...]
    axis: str = "fsdp"
    replica_axis: str | None = None
    mp: MixedPrecision = field(default_factory=MixedPrecision)
    remat: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "layouts", tuple(self.layouts))
        object.__setattr__(self, "stages", tuple(self.stages))
        check_mesh(self.mesh, self.layouts, self.axis, self.replica_axis)
        units, stage_units = [lay.name for lay in self.layouts], [s.unit for s in self.stages]
        if units != stage_units:
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

    def _state_specs(self, optimizer: optax.GradientTransformation) -> Any:
        """Per-element optimizer state is sharded like the buffers; scalars (step counts) are replicated.

        Checks first that ``optimizer`` on flat shards equals optax on the full params (``check_optimizer``).
        """
        check_optimizer(optimizer, self.layouts)
        local = {lay.name: jax.ShapeDtypeStruct((lay.shard_size,), jnp.float32) for lay in self.layouts}

        def spec(path: Any, leaf: jax.ShapeDtypeStruct) -> P:
            if leaf.ndim == 0:
                return P()
            if leaf.ndim == 1:
                return P(self.axis)
            raise LayoutMismatchError(
                f"optimizer state leaf {jax.tree_util.keystr(path)} has shape {leaf.shape}: only per-element "
                "state (like Adam's moments) and scalars can live on flat shards"
            )

        return jax.tree_util.tree_map_with_path(spec, jax.eval_shape(optimizer.init, local))

    # ----- buffers -----------------------------------------------------------------------------------
    def shard(self, params: Mapping[str, Any]) -> dict[str, jax.Array]:
        """Full ``{fqn: array}`` -> sharded unit buffers (see ``shard_params``)."""
        return shard_params(params, self.layouts, self.mesh, self.axis)

    def unshard(self, buffers: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        """Sharded unit buffers -> full ``{fqn: array}`` (see ``unshard_params``)."""
        return unshard_params(buffers, self.layouts)

    def init(self, optimizer: optax.GradientTransformation, buffers: Mapping[str, jax.Array]) -> Any:
        """``optimizer.init`` on the local shards; the state is sharded like the buffers."""
        specs = self._state_specs(optimizer)
        init = shard_map(optimizer.init, self.mesh, in_specs=(self._buffer_specs(),), out_specs=specs)
        return jax.jit(init)(dict(buffers))

    # ----- the step ----------------------------------------------------------------------------------
    def forward(self, local: Mapping[str, jax.Array], inputs: Any) -> Any:
        """Run the stages on local shards (inside ``shard_map``), gathering one unit at a time."""
        h = inputs
        for stage, layout in zip(self.stages, self.layouts):
            master = local[layout.name].dtype
            comm = _Comm(self.axis, self.replica_axis, self.mp.param_dtype or master,
                         self.mp.reduce_dtype or master, master)

            if self.remat:
                h = run_resharded(stage.apply, layout, comm, local[layout.name], h)
            else:
                h = stage.apply(unpack_unit(gather_unit(local[layout.name], comm), layout), h)
        return h

    def train_step(self, optimizer: optax.GradientTransformation,
                   loss_fn: Callable[[Any, Any], jax.Array]) -> Callable:
        """A jitted ``step(buffers, opt_state, inputs, targets) -> (buffers, opt_state, loss)``.

        ``inputs`` and ``targets`` are global batches split on dim 0 over every device (replicas, then
        shards); ``loss_fn(outputs, targets)`` is a per-device mean, and the step minimises its mean over
        devices (equal local batches make that the global mean). ``buffers`` and ``opt_state`` are donated.

        Raises:
            LayoutMismatchError: optimizer state that is neither per-element nor scalar.
        """
        n = self.data_size

        def local_step(local: dict, opt_state: Any, inputs: Any, targets: Any) -> tuple:
            def local_loss(bufs: dict) -> jax.Array:
                # Pre-divide so that the psum_scatter of the gradients is the mean over devices.
                return loss_fn(self.forward(bufs, inputs), targets) / n

            loss, grads = jax.value_and_grad(local_loss)(local)
            updates, opt_state = optimizer.update(grads, opt_state, local)
            return optax.apply_updates(local, updates), opt_state, lax.psum(loss, self.data_axes)

        buffers, state, batch = self._buffer_specs(), self._state_specs(optimizer), P(self.data_axes)
        step = shard_map(local_step, self.mesh, in_specs=(buffers, state, batch, batch),
                         out_specs=(buffers, state, P()))
        return jax.jit(step, donate_argnums=(0, 1))

