"""jax_backend: the core's planned layouts on a ``jax.sharding.Mesh``, with ``shard_map``, flax NNX and optax.

Each FSDP unit is one flat, sharded ``jax.Array`` laid out by ``ragged.plan``; the training step gathers
one unit at a time, reduce-scatters its gradient and applies optax to the local shards. The way in is
``shard_model`` (``jax_backend.models.parallelize`` for the bundled llama).
"""

from jax_backend._buffers import LayoutMismatchError, full_params, shard_params
from jax_backend._checkpoint import (
    load_neutral_checkpoint,
    load_neutral_params,
    save_neutral_checkpoint,
    save_neutral_params,
)
from jax_backend._compat import make_mesh, shard_map
from jax_backend._model import shard_model
from jax_backend._names import flatten_params
from jax_backend._optax import (
    ShardedState,
    UnsupportedOptimizerError,
    check_optimizer,
    clip_by_global_norm,
    full_optimizer_state,
    global_norm,
    on_shards,
    shard_optimizer,
    shard_optimizer_state,
)
from jax_backend._step import FSDP
from jax_backend._tensor_parallel import TensorParallel, TensorParallelError
from jax_backend._units import MixedPrecisionPolicy, UnitError

__all__ = [
    "FSDP",
    "LayoutMismatchError",
    "MixedPrecisionPolicy",
    "ShardedState",
    "TensorParallel",
    "TensorParallelError",
    "UnitError",
    "UnsupportedOptimizerError",
    "check_optimizer",
    "clip_by_global_norm",
    "flatten_params",
    "full_optimizer_state",
    "full_params",
    "global_norm",
    "load_neutral_checkpoint",
    "load_neutral_params",
    "make_mesh",
    "on_shards",
    "save_neutral_checkpoint",
    "save_neutral_params",
    "shard_map",
    "shard_model",
    "shard_optimizer",
    "shard_optimizer_state",
    "shard_params",
]
