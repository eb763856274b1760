"""jax_backend: the core's planned layouts on a ``jax.sharding.Mesh``, with ``shard_map``, flax NNX and optax.

Each FSDP unit is one flat, sharded ``jax.Array`` laid out by ``ragged.plan``; the training step gathers
one unit at a time, reduce-scatters its gradient and applies optax to the local shards.
"""

from jax_backend._buffers import (
    LayoutMismatchError,
    check_mesh,
    check_params,
    full_params,
    pack_unit,
    shard_params,
    unpack_unit,
)
from jax_backend._checkpoint import load_neutral_checkpoint, load_neutral_params, save_neutral_checkpoint
from jax_backend._compat import make_mesh, shard_map
from jax_backend._model import UnitError, fully_shard, shard_model
from jax_backend._names import flatten_params, fqn
from jax_backend._optax import (
    ShardedState,
    UnsupportedOptimizerError,
    check_optimizer,
    clip_by_global_norm,
    full_optimizer_state,
    global_norm,
    on_shards,
    shard_optimizer,
)
from jax_backend._redistribute import gather_tensor, scatter_tensor
from jax_backend._step import FSDP, MixedPrecisionPolicy, Stage, Units, gather_unit

__all__ = [
    "FSDP",
    "LayoutMismatchError",
    "MixedPrecisionPolicy",
    "ShardedState",
    "Stage",
    "UnitError",
    "Units",
    "UnsupportedOptimizerError",
    "check_mesh",
    "check_optimizer",
    "check_params",
    "clip_by_global_norm",
    "flatten_params",
    "fqn",
    "fully_shard",
    "gather_tensor",
    "gather_unit",
    "global_norm",
    "load_neutral_checkpoint",
    "load_neutral_params",
    "make_mesh",
    "on_shards",
    "pack_unit",
    "save_neutral_checkpoint",
    "scatter_tensor",
    "shard_map",
    "shard_model",
    "shard_optimizer",
    "shard_params",
    "unpack_unit",
    "full_params",
    "full_optimizer_state",
]
