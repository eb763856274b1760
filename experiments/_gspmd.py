"""The GSPMD baseline of the JAX benchmark and tests: plain ``jax.jit`` with a ``NamedSharding`` on every
parameter, on the same mesh as ragged-fsdp.

The usual recipe: each parameter is sharded on the tensor axis along the dim that the tensor-parallel split
names (if any, the same ``TensorParallel`` that ragged-fsdp resolved from the annotations or rules, so both
programs split the same dims) and on the fsdp axis along its largest other dim that the fsdp size divides
(replicated over fsdp where none does; always replicated over a replica axis); the optimizer state follows
its parameters (same shapes; scalars replicated); the batch is split over the data axes; the model state
besides the Params (batch statistics, RNG streams) is replicated, since jit's semantics are one device's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_backend import TensorParallel, flatten_params

Shape = tuple[int, ...]


def gspmd_spec(shape: Shape, fsdp_size: int, *, axis: str | tuple[str, ...] = "fsdp",
               tensor_axis: str | None = None, tensor_dim: int | None = None) -> P:
    """``tensor_dim`` on ``tensor_axis``; ``axis`` on the largest other dim ``fsdp_size`` divides."""
    entries: list[str | None] = [None] * len(shape)
    if tensor_dim is not None:
        entries[tensor_dim] = tensor_axis
    free = sorted((d for d in range(len(shape)) if entries[d] is None and shape[d] % fsdp_size == 0),
                  key=lambda d: -shape[d])
    if free:
        entries[free[0]] = axis
    return P(*entries) if any(entries) else P()


def gspmd_step(model: nnx.Module, loss_fn: Callable, opt: optax.GradientTransformation, mesh: Mesh, *,
               axis: str = "fsdp", data_axes: Sequence[str] = ("fsdp",),
               tensor: TensorParallel | None = None) -> tuple[Callable, tuple]:
    """The jitted GSPMD train step of ``model`` and its first carry.

    Args:
        model: an NNX module called on the inputs; ``loss_fn(outputs, targets)`` returns the loss or
            ``(loss, aux)``.
        opt: the optimizer, run on the full parameter pytree.
        mesh, axis, data_axes: the mesh, its fsdp axis and the axes the batch is split over.
        tensor: the tensor-parallel split (``FSDP.tensor_parallel`` of the run compared with), or None.

    Returns:
        ``(step, (params, opt_state, rest))``: ``step(params, opt_state, rest, x, y) -> (params, opt_state,
        rest, loss)`` with its first three arguments donated; ``rest`` is the model state besides Params.
    """
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    fsdp_size = mesh.shape[axis]

    def spec(name: str, shape: Shape) -> P:
        if tensor is None:
            return gspmd_spec(shape, fsdp_size, axis=axis)
        return gspmd_spec(shape, fsdp_size, axis=axis, tensor_axis=tensor.axis, tensor_dim=tensor.dim(name))

    specs = [spec(name, a.shape) for name, a in flatten_params(params).items()]
    shardings = jax.tree.unflatten(jax.tree.structure(params), [NamedSharding(mesh, s) for s in specs])
    replicated = NamedSharding(mesh, P())
    # Copies, never the model's own arrays: the step donates its carry.
    params = jax.device_put(params, shardings, may_alias=False)
    rest_shardings = jax.tree.map(lambda _: replicated, rest)
    rest = jax.device_put(rest, rest_shardings, may_alias=False)
    # Each moment as its parameter (optax's way to map the copies of the params inside a state); the rest
    # (step counts) replicated.
    state_shapes = jax.eval_shape(opt.init, params)
    state_shardings = optax.tree_map_params(opt, lambda _, sharding: sharding, state_shapes, shardings,
                                            transform_non_params=lambda _: replicated)
    state = jax.jit(opt.init, out_shardings=state_shardings)(params)
    data = NamedSharding(mesh, P(tuple(data_axes)))

    def step(params, state, rest, x, y):
        def loss_of(p):
            m = nnx.merge(graphdef, p, jax.tree.map(lambda a: a, rest))  # Variables of this trace
            out = loss_fn(m(x), y)
            loss = out[0] if isinstance(out, tuple) else out
            return loss, nnx.state(m, nnx.Not(nnx.Param))

        (loss, rest), grads = jax.value_and_grad(loss_of, has_aux=True)(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, rest, loss

    jitted = jax.jit(step, in_shardings=(shardings, state_shardings, rest_shardings, data, data),
                     out_shardings=(shardings, state_shardings, rest_shardings, replicated),
                     donate_argnums=(0, 1, 2))
    return jitted, (params, state, rest)
