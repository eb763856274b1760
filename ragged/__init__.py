"""ragged: the framework-agnostic core of ragged-fsdp (numpy and the standard library only).

The names a reader needs first: ``RaggedShard`` placements, granularities (a tensor's blocks), the
structure-aware planner (``plan``, ``plan_model``) and its ``Layout``, the errors, and redistribution
plans (``transfers`` between any two holdings of a tensor). The rest lives in sub-packages that import
the core, never the other way:

- ``ragged.models``: model shape presets, shapes files, memory and FLOPs estimates;
- ``ragged.muon``: which device runs Newton-Schulz on each matrix (the NS device), split groups, costs;
- ``ragged.quant``: 8-bit Adam's quantization tiles and codebooks;
- ``ragged.checkpoint``: the neutral checkpoint both runtimes write and read;
- ``ragged.viz``: pictures of a layout (SVG, terminal);
- ``ragged.bench``: the baselines (FSDP1, FSDP2, ZeRO-3, Megatron-FSDP) and the padding sweep;
- ``ragged.advise``: HSDP group size and unit merging for a model and a GPU count;
- ``ragged.cli``: the ``ragged`` command.
"""

from ragged._errors import GranularityError, PlacementError, PlanningError, RaggedError
from ragged._granularity import Granularity, block_numel, granularity_for
from ragged._layout import Layout, Piece, TensorSlot, TensorSpec
from ragged._model_plan import GranularityRule, plan_model
from ragged._placement import RaggedShard
from ragged._planner import plan
from ragged._redistribute import (
    Holdings,
    Transfer,
    box_intervals,
    chunk_sizes,
    ragged_holdings,
    replicate_holdings,
    shard_holdings,
    transfers,
)

__all__ = [
    # placement
    "RaggedShard",
    # granularity: the blocks a shard boundary may not cut
    "Granularity",
    "granularity_for",
    "block_numel",
    # planning
    "TensorSpec",
    "TensorSlot",
    "Layout",
    "Piece",
    "plan",
    "plan_model",
    "GranularityRule",
    # errors
    "RaggedError",
    "PlanningError",
    "GranularityError",
    "PlacementError",
    # redistribution
    "Holdings",
    "Transfer",
    "transfers",
    "box_intervals",
    "ragged_holdings",
    "shard_holdings",
    "replicate_holdings",
    "chunk_sizes",
]
