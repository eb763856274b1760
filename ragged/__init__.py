"""ragged: the framework-agnostic core of ragged-fsdp (numpy and the standard library only).

RaggedShard placements, granularities, the structure-aware planner and its Layout, redistribution
plans, model shape presets and the baselines they are compared with.
"""

from ragged._advise import Advice, HsdpOption, advise
from ragged._baselines import BaselineLayout, baseline_layouts
from ragged._checkpoint import Checkpoint, CheckpointError, StoredTensor, load_checkpoint, save_checkpoint
from ragged._errors import GranularityError, PlacementError, PlanningError, RaggedError
from ragged._granularity import Granularity, block_numel, granularity_for
from ragged._layout import Layout, Piece, TensorSlot, TensorSpec
from ragged._model_plan import plan_model
from ragged._muon_roots import NS_COEFFS, NS_STEPS, assign_roots, muon_scale, newton_schulz_cost
from ragged._placement import RaggedShard
from ragged._planner import plan
from ragged._presets import LLAMA_TINY, LlamaConfig, ModelShapes, UnitShapes, model_names, model_shapes
from ragged._redistribute import (
    Transfer,
    chunk_sizes,
    ragged_holdings,
    replicate_holdings,
    shard_holdings,
    transfers,
)
from ragged._shapes_file import UnitSpecs, model_units, parse_shapes, read_shapes_file
from ragged._sweep import SweepRow, padding_sweep, run_sweep
from ragged._tiles import (
    TILE,
    PieceTable,
    TileError,
    block_ids,
    check_tiles_local,
    piece_table,
    quant_block,
    tile_granularity,
    tile_grid,
)

__all__ = [
    "NS_COEFFS",
    "NS_STEPS",
    "TILE",
    "PieceTable",
    "TileError",
    "assign_roots",
    "block_ids",
    "piece_table",
    "check_tiles_local",
    "quant_block",
    "newton_schulz_cost",
    "tile_granularity",
    "tile_grid",
    "Checkpoint",
    "CheckpointError",
    "StoredTensor",
    "load_checkpoint",
    "save_checkpoint",
    "Advice",
    "HsdpOption",
    "advise",
    "BaselineLayout",
    "baseline_layouts",
    "UnitSpecs",
    "model_units",
    "muon_scale",
    "parse_shapes",
    "read_shapes_file",
    "SweepRow",
    "padding_sweep",
    "run_sweep",
    "LLAMA_TINY",
    "Granularity",
    "GranularityError",
    "Layout",
    "LlamaConfig",
    "ModelShapes",
    "Piece",
    "PlacementError",
    "PlanningError",
    "RaggedError",
    "RaggedShard",
    "TensorSlot",
    "TensorSpec",
    "Transfer",
    "UnitShapes",
    "block_numel",
    "granularity_for",
    "chunk_sizes",
    "model_names",
    "model_shapes",
    "plan",
    "plan_model",
    "ragged_holdings",
    "replicate_holdings",
    "shard_holdings",
    "transfers",
]
