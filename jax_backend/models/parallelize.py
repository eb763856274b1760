"""Apply ragged-fsdp to the flax llama: a thin use of ``shard_model``.

Like torchtitan's ``parallelize.py`` this is the one place that knows both the model's structure and the
runtime. The units are those of the core preset (``tok_embeddings``, each ``layers.{i}``, and ``output`` =
final norm + head, here the root unit), planned in the preset's tensor order and named by FQN, so the
Layouts are the torch backend's for the same model, world size and granularity.
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import Mesh

import ragged
import ragged.models
from jax_backend._buffers import check_mesh
from jax_backend._model import shard_model
from jax_backend._names import flatten_params
from jax_backend._step import FSDP
from jax_backend._tensor_parallel import build_tensor_parallel
from jax_backend._units import MixedPrecisionPolicy
from jax_backend.models.llama import Llama
from ragged import Granularity, GranularityRule

# Megatron's split of the llama (weights are [out, in]): column-parallel projections split their outputs
# (wq, wk, wv by whole heads: the tensor size must divide n_kv_heads), row-parallel ones their inputs (wo,
# w2: one all-reduce after each); the embedding and the head split the vocabulary (a masked lookup and one
# all-reduce); norms stay whole. With the embedding split on its dim instead, the residual stream stays
# split and XLA all-gathers it before every projection (29 activation all-gathers in the compiled step at
# fsdp 4 x tensor 2, none this way).
TENSOR_RULES: dict[str, int | None] = {
    "layers.*.attention.w[qkv].weight": 0,
    "layers.*.attention.wo.weight": 1,
    "layers.*.feed_forward.w[13].weight": 0,
    "layers.*.feed_forward.w2.weight": 1,
    "tok_embeddings.weight": 0,
    "output.weight": 0,
}


def model_params(model: nnx.Module) -> dict[str, jax.Array]:
    """The model's parameters as ``{fqn: array}``."""
    return flatten_params(nnx.state(model, nnx.Param))


def parallelize(model: Llama, mesh: Mesh, *, axis: str = "fsdp", replica_axis: str | None = None,
                granularity: GranularityRule | Granularity | int | str = "rows:1",
                mp_policy: MixedPrecisionPolicy | None = None, remat: bool = False,
                reshard_after_forward: bool | None = None, preset: str = "llama-tiny",
                tensor_axis: str | None = None) -> FSDP:
    """``shard_model`` of the llama with the preset's units, planned in the preset's tensor order.

    Example:
        >>> mesh = make_mesh((4,), ("fsdp",))
        >>> fsdp = parallelize(Llama(rngs=nnx.Rngs(0)), mesh)
        >>> buffers = fsdp.shard_params(model_params(model))
        >>> step = fsdp.train_step(optax.adamw(1e-3), cross_entropy)

    Args:
        model: the flax llama (its parameters must be the preset's names and shapes).
        mesh, axis, replica_axis, granularity, mp_policy, remat, reshard_after_forward: as ``shard_model``.
        preset: the name of the core's units (``ragged.models.llama_shapes(preset, model.config)``), whose
            tensor order is planned.
        tensor_axis: a mesh axis of tensor parallelism, split by ``TENSOR_RULES``; the units are planned
            from each tensor rank's local shapes.

    Raises:
        LayoutMismatchError: the model's parameters differ from the preset's (named by FQN, with both
            shapes), or the mesh does not have the axes.
    """
    check_mesh(mesh, (), axis, replica_axis)  # the axes must exist before the planner reads their size
    units = ragged.models.llama_shapes(preset, model.config).units
    if tensor_axis is not None:
        tp = build_tensor_parallel({n: s for u in units for n, s in u.tensors}, {}, axis=tensor_axis,
                                   mesh_shape=dict(mesh.shape), data_axes=(axis,), rules=TENSOR_RULES)
        units = [(u.name, [(n, tp.local_shape(n, s)) for n, s in u.tensors]) for u in units]
    layouts = ragged.plan_model(units, mesh.shape[axis], granularity)
    return shard_model(model, mesh, units=["tok_embeddings", "layers.*"], root="output", layouts=layouts,
                       axis=axis, replica_axis=replica_axis, mp_policy=mp_policy, remat=remat,
                       reshard_after_forward=reshard_after_forward, tensor_axis=tensor_axis,
                       tensor_rules=TENSOR_RULES if tensor_axis is not None else None)
