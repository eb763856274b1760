"""Apply ragged-fsdp to the flax llama: a thin use of ``shard_model``.

Like torchtitan's ``parallelize.py`` this is the one place that knows both the model's structure and the
runtime. The units are those of the core preset (``tok_embeddings``, each ``layers.{i}``, and ``output`` =
final norm + head, here the root unit), planned in the preset's tensor order and named by FQN, so the
Layouts are the torch backend's for the same model, world size and granularity. ``llama_stages`` is the
same forward as a hand-written chain of ``Stage`` s (for ``FSDP(mesh, layouts, stages)``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import jax
from flax import nnx
from jax.sharding import Mesh

import ragged
import ragged.models
from jax_backend._buffers import (
    LayoutMismatchError,
    check_mesh,
)
from jax_backend._model import shard_model
from jax_backend._names import flatten_params, fqn
from jax_backend._step import FSDP, MixedPrecisionPolicy, Stage
from jax_backend.models.llama import Llama
from ragged import Granularity, GranularityRule


def model_params(model: nnx.Module) -> dict[str, jax.Array]:
    """The model's parameters as ``{fqn: array}``."""
    return flatten_params(nnx.state(model, nnx.Param))


def _builder(module: nnx.Module, prefix: str) -> Callable[[Mapping[str, jax.Array]], nnx.Module]:
    """A function from ``{fqn: array}`` to a copy of ``module`` holding those arrays (``nnx.merge``)."""
    graphdef, state = nnx.split(module)
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    names = [f"{prefix}.{fqn(path)}" for path, _ in leaves]
    treedef = jax.tree_util.tree_structure(state)
    return lambda p: nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, [p[n] for n in names]))


def llama_stages(model: Llama) -> tuple[Stage, ...]:
    """The llama forward as one stage per unit: embedding, each block, then norm and head together."""
    embed = _builder(model.tok_embeddings, "tok_embeddings")
    blocks = [_builder(layer, f"layers.{i}") for i, layer in enumerate(model.layers)]
    norm, head = _builder(model.norm, "norm"), _builder(model.output, "output")
    return (
        Stage("tok_embeddings", lambda p, tokens: embed(p)(tokens)),
        *(Stage(f"layers.{i}", lambda p, h, block=block: block(p)(h)) for i, block in enumerate(blocks)),
        Stage("output", lambda p, h: head(p)(norm(p)(h))),
    )


def parallelize(model: Llama, mesh: Mesh, *, axis: str = "fsdp", replica_axis: str | None = None,
                granularity: GranularityRule | Granularity | int | str = "rows:1",
                mp_policy: MixedPrecisionPolicy | None = None, remat: bool = False,
                reshard_after_forward: bool | None = None, preset: str = "llama-tiny") -> FSDP:
    """Plan ``model``'s FSDP units for ``mesh.shape[axis]`` devices and return the ``FSDP`` runtime.

    Example:
        >>> mesh = make_mesh((4,), ("fsdp",))
        >>> fsdp = parallelize(Llama(rngs=nnx.Rngs(0)), mesh)
        >>> buffers = fsdp.shard_params(model_params(model))
        >>> step = fsdp.train_step(optax.adamw(1e-3), cross_entropy)

    Args:
        model: the flax llama (its parameters must be the preset's names and shapes).
        mesh: the device mesh; ``axis`` shards, ``replica_axis`` (HSDP) replicates.
        granularity: ``(fqn, shape) -> granularity`` or one granularity for every matrix.
        mp_policy: mixed precision; ``None`` computes and reduces in the master dtype.
        remat: re-gather each unit in the backward and recompute its activations (keeps one unit
            unsharded at a time).
        reshard_after_forward: re-gather each unit in the backward but keep its activations; ``None``: as
            ``remat``.
        preset: the name of the core's units (``ragged.models.llama_shapes(preset, model.config)``), whose
            tensor order is planned.

    Raises:
        LayoutMismatchError: the model's parameters differ from the preset's (named by FQN), or the mesh
            does not have the axes.
    """
    units = ragged.models.llama_shapes(preset, model.config).units
    params = model_params(model)
    planned = {name: shape for unit in units for name, shape in unit.tensors}
    for name, shape in planned.items():
        if name not in params or tuple(params[name].shape) != shape:
            got = tuple(params[name].shape) if name in params else "missing"
            raise LayoutMismatchError(f"{name}: the model has {got}, preset {preset!r} has shape {shape}")
    extra = sorted(set(params) - set(planned))
    if extra:
        raise LayoutMismatchError(f"the model has parameters {extra[:5]} that preset {preset!r} does not")
    check_mesh(mesh, (), axis, replica_axis)  # the axes must exist before the planner reads their size
    layouts = ragged.plan_model(units, mesh.shape[axis], granularity)
    return shard_model(model, mesh, units=["tok_embeddings", "layers.*"], root="output", layouts=layouts,
                       axis=axis, replica_axis=replica_axis, mp_policy=mp_policy, remat=remat,
                       reshard_after_forward=reshard_after_forward)
