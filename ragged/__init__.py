"""ragged: the framework-agnostic core of ragged-fsdp (numpy and the standard library only).

RaggedShard placements, granularities, the structure-aware planner and its Layout, redistribution
plans, model shape presets and the baselines they are compared with.
"""

from ragged._advise import Advice, HsdpOption, advise
from ragged._baselines import BASELINES, BaselineLayout, baseline_layouts
from ragged._checkpoint import (
    Checkpoint,
    CheckpointError,
    StoredTensor,
    load_neutral_checkpoint,
    save_neutral_checkpoint,
)
from ragged._drawing import LayoutDrawing, Picture, Segment, draw_layout, draw_plan, draw_side_by_side
from ragged._errors import GranularityError, PlacementError, PlanningError, RaggedError
from ragged._granularity import Granularity, block_numel, granularity_for
from ragged._layout import Layout, Piece, TensorSlot, TensorSpec
from ragged._memory import MemoryPlan, flops_per_token, gib, memory_plan, trained_llama, trained_model_names
from ragged._model_plan import GranularityRule, plan_model
from ragged._muon_roots import (
    NS_COEFFS,
    NS_STEPS,
    assign_roots,
    bucket_holdings,
    muon_scale,
    newton_schulz_flops,
    newton_schulz_load,
    root_buckets,
)
from ragged._muon_split import (
    assign_groups,
    group_load,
    split_newton_schulz_bytes,
    split_newton_schulz_flops,
    split_newton_schulz_reference,
)
from ragged._placement import RaggedShard
from ragged._planner import plan
from ragged._presets import (
    LLAMA_TINY,
    LlamaConfig,
    ModelShapes,
    UnitShapes,
    llama_shapes,
    model_names,
    model_shapes,
)
from ragged._redistribute import (
    Holdings,
    Transfer,
    chunk_sizes,
    ragged_holdings,
    replicate_holdings,
    shard_holdings,
    transfers,
)
from ragged._shapes_file import UnitSpecs, model_units, parse_shapes, read_shapes_file
from ragged._sweep import SWEEP_GRANULARITIES, SWEEP_MODELS, SWEEP_WORLD_SIZES, SweepRow, padding_sweep
from ragged._tiles import (
    TILE,
    PieceTable,
    TileError,
    check_tiles_local,
    piece_table,
    quant_tile,
    tile_granularity,
    tile_grid,
    tile_ids,
)

__all__ = [
    "LLAMA_TINY",
    "NS_COEFFS",
    "NS_STEPS",
    "TILE",
    "Advice",
    "advise",
    "assign_groups",
    "assign_roots",
    "baseline_layouts",
    "BASELINES",
    "BaselineLayout",
    "tile_ids",
    "bucket_holdings",
    "block_numel",
    "check_tiles_local",
    "Checkpoint",
    "CheckpointError",
    "chunk_sizes",
    "draw_layout",
    "draw_plan",
    "draw_side_by_side",
    "Granularity",
    "granularity_for",
    "group_load",
    "GranularityError",
    "GranularityRule",
    "Holdings",
    "HsdpOption",
    "Layout",
    "LayoutDrawing",
    "LlamaConfig",
    "MemoryPlan",
    "memory_plan",
    "flops_per_token",
    "gib",
    "trained_llama",
    "trained_model_names",
    "load_neutral_checkpoint",
    "llama_shapes",
    "model_names",
    "model_shapes",
    "model_units",
    "ModelShapes",
    "muon_scale",
    "newton_schulz_flops",
    "newton_schulz_load",
    "padding_sweep",
    "parse_shapes",
    "Picture",
    "Piece",
    "piece_table",
    "PieceTable",
    "PlacementError",
    "plan",
    "plan_model",
    "PlanningError",
    "quant_tile",
    "ragged_holdings",
    "RaggedError",
    "RaggedShard",
    "read_shapes_file",
    "replicate_holdings",
    "root_buckets",
    "save_neutral_checkpoint",
    "Segment",
    "split_newton_schulz_bytes",
    "split_newton_schulz_flops",
    "split_newton_schulz_reference",
    "shard_holdings",
    "StoredTensor",
    "SweepRow",
    "SWEEP_GRANULARITIES",
    "SWEEP_MODELS",
    "SWEEP_WORLD_SIZES",
    "TensorSlot",
    "TensorSpec",
    "tile_granularity",
    "tile_grid",
    "TileError",
    "Transfer",
    "transfers",
    "UnitShapes",
    "UnitSpecs",
]
