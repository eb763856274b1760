"""What the planner is measured against: the baselines' shardings of the same unit (FSDP1, FSDP2,
ZeRO-3, Megatron-FSDP) and the padding sweep of the paper's Figure 11 over models, world sizes and
granularities.

The baselines' code is ``ragged/_baselines.py``, in the core, because ``plan`` also tries
Megatron-FSDP's packing as a candidate (so it never pads more than Megatron-FSDP).
"""

from ragged._baselines import BASELINES, BaselineLayout, baseline_layouts, fsdp2
from ragged.bench._sweep import SWEEP_GRANULARITIES, SWEEP_MODELS, SWEEP_WORLD_SIZES, SweepRow, padding_sweep

__all__ = [
    "BASELINES",
    "BaselineLayout",
    "baseline_layouts",
    "fsdp2",
    "SWEEP_MODELS",
    "SWEEP_WORLD_SIZES",
    "SWEEP_GRANULARITIES",
    "SweepRow",
    "padding_sweep",
]
