"""jax_backend.optim: structure-aware optax optimizers (8-bit tile Adam, distributed Muon).

Each is a ``scale_by_*`` transform with its own ``*State`` NamedTuple plus an alias that chains it with
weight decay and the learning rate. Pass ``tiles=shard_tiles(...)`` / ``plan=muon_plan(...)`` to run
them on FSDP unit shards inside ``FSDP.train_step``.
"""

from jax_backend.optim._adam8bit import (
    ScaleByAdam8bitState,
    ShardTiles,
    WholeTiles,
    adamw8bit,
    scale_by_adam8bit,
    shard_tiles,
)
from jax_backend.optim._muon import MuonPlan, ScaleByMuonState, muon, muon_plan, newton_schulz, scale_by_muon

__all__ = [
    "MuonPlan",
    "ScaleByAdam8bitState",
    "ScaleByMuonState",
    "ShardTiles",
    "WholeTiles",
    "adamw8bit",
    "muon",
    "muon_plan",
    "newton_schulz",
    "scale_by_adam8bit",
    "scale_by_muon",
    "shard_tiles",
]
