"""ragged.simulate: one training step at cluster scale, from the exact layouts (numpy and stdlib only).

Hardware profiles as data, an alpha-beta model of ring collectives, and a two-stream schedule of one step
for ours, FSDP2 and Megatron-FSDP from the same units' buffers; calibration from measured times. See
docs/simulate.md for the model, its constants and what it leaves out.
"""

from ragged.simulate._advise_step import StepOption, advise_step_time
from ragged.simulate._calibration import Calibration, calibrate, load_calibration
from ragged.simulate._collectives import Link, collective_time, hierarchical_time, ring_link, ring_time
from ragged.simulate._efficiency import Efficiency
from ragged.simulate._hardware import PROFILES, Hardware, hardware, load_hardware
from ragged.simulate._schedule import Op, UnitTimes
from ragged.simulate._step import StepConfig, StepResult, simulate
from ragged.simulate._timeline_svg import TIMELINE_COLORS, timeline_svg
from ragged.simulate._workload import METHODS, Method, UnitCost

__all__ = [
    "METHODS",
    "PROFILES",
    "Calibration",
    "Efficiency",
    "Hardware",
    "Link",
    "Method",
    "Op",
    "StepConfig",
    "StepOption",
    "StepResult",
    "UnitCost",
    "UnitTimes",
    "advise_step_time",
    "calibrate",
    "collective_time",
    "hardware",
    "hierarchical_time",
    "load_calibration",
    "load_hardware",
    "ring_link",
    "ring_time",
    "simulate",
    "TIMELINE_COLORS",
    "timeline_svg",
]
