"""Calibration: measured per-unit times in, efficiencies out.

A calibration file is JSON (``load_calibration``)::

    {"format": "ragged-simulate-calibration/1",
     "source": "where the times come from (a paper's table, a gpu_check run)",
     "hardware": "h800", "model": "gpt-oss-120b", "method": "fsdp2", "gpus": 64, "replicas": 1,
     "unit": "layers.0", "batch_per_device": 1, "seq_len": 4096, "dtype": "bf16",
     "measured_ms": {"all_gather": 43.71, "ag_copy_out": 5.22, "reduce_scatter": 94.24, "rs_copy_in": 12.37}}

``measured_ms`` holds the times of one unit's pieces (any subset of ``MEASURED``). ``calibrate`` solves,
for each efficiency a measurement informs, the value at which the model gives the measured time for that
unit (the sum of the measured times where several pieces inform one efficiency); the others keep their
defaults. Solving is exact: the model reproduces a calibration's own numbers by construction, so agreement
with them checks nothing; what the calibrated constants predict elsewhere does.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from ragged import RaggedError
from ragged.models import LlamaConfig, ModelShapes, UnitSpecs, model_units
from ragged.simulate._efficiency import Efficiency
from ragged.simulate._hardware import Hardware
from ragged.simulate._step import DTYPE_BYTES, StepConfig, unit_times
from ragged.simulate._workload import unit_costs

FORMAT = "ragged-simulate-calibration/1"
COMPUTE_FIELDS = ("gemm", "attention", "elementwise")  # forward/backward scale these together
MEASURED = {"all_gather": "all_gather", "reduce_scatter": "reduce_scatter", "all_reduce": "all_reduce",
            "ag_copy_in": "copy", "ag_copy_out": "copy", "rs_copy_out": "copy", "rs_copy_in": "cast_copy",
            "forward": "compute", "backward": "compute"}


@dataclass(frozen=True)
class Calibration:
    """Measured times of one unit's step pieces, in milliseconds, and the setting they were measured in."""

    source: str
    hardware: str
    model: str
    method: str
    gpus: int
    unit: str
    measured_ms: dict[str, float]
    replicas: int = 1
    batch_per_device: int = 1
    seq_len: int = 4096
    dtype: str = "bf16"
    format: str = FORMAT

    def __post_init__(self) -> None:
        if self.format != FORMAT:
            raise RaggedError(f"calibration: format {self.format!r} is not {FORMAT!r}")
        bad = sorted(set(self.measured_ms) - set(MEASURED))
        if bad:
            raise RaggedError(f"calibration: measured_ms has unknown pieces {bad}; known: {sorted(MEASURED)}")
        for k, v in self.measured_ms.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise RaggedError(f"calibration: measured_ms[{k!r}] must be a time > 0 in ms, got {v!r}")

    def config(self) -> StepConfig:
        return StepConfig(self.gpus, self.replicas, self.batch_per_device, self.seq_len, dtype=self.dtype)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def load_calibration(path: str | Path) -> Calibration:
    """A ``Calibration`` from a JSON file (see the module docstring).

    Raises:
        RaggedError: not JSON, not an object, unknown or missing fields, or bad measurements.
    """
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise RaggedError(f"calibration file {path}: not JSON ({e})") from None
    if not isinstance(data, dict):
        raise RaggedError(f"calibration file {path}: must be a JSON object")
    names = {f.name for f in fields(Calibration)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise RaggedError(f"calibration file {path}: unknown fields {unknown}; allowed: {sorted(names)}")
    try:
        return Calibration(**data)
    except TypeError as e:
        raise RaggedError(f"calibration file {path}: {e}") from None


def calibrate(cal: Calibration, units: ModelShapes | Sequence[UnitSpecs], c: LlamaConfig, hw: Hardware,
              base: Efficiency | None = None, granularity: str = "rows:1") -> Efficiency:
    """``base`` with every efficiency that ``cal`` measures solved so the model gives the measured times.

    Args:
        cal: the measurements (its ``unit`` must be one of ``units``' names).
        units: the model's units, as given to ``simulate``.
        c: the llama standing in for compute (as in ``simulate``).
        hw: the hardware the measurements were taken on.
        base: the efficiencies not measured.

    Raises:
        RaggedError: an unknown unit, or a measured time the model cannot reach at any efficiency in
            (0, 1.5] (check the setting: bytes, dtype, GPU count).
    """
    if hw.name != cal.hardware:
        raise RaggedError(f"calibrate: the measurements are on {cal.hardware!r}, the profile is {hw.name!r}")
    specs = model_units(units, granularity) if isinstance(units, ModelShapes) else tuple(units)
    names = [u.name for u in specs]
    if cal.unit not in names:
        raise RaggedError(f"calibrate: unit {cal.unit!r} is not in the model (units: {names[:3]}...)")
    config = cal.config()
    cost = unit_costs(specs, cal.method, config.group_size, c, tokens=config.tokens_per_device,
                      seq_len=config.seq_len, compute_bytes=DTYPE_BYTES[config.dtype])[names.index(cal.unit)]
    eff = base or Efficiency()
    notes = dict(eff.sources)
    for target in dict.fromkeys(MEASURED[k] for k in cal.measured_ms):
        pieces = [k for k in cal.measured_ms if MEASURED[k] == target]
        measured = sum(cal.measured_ms[k] for k in pieces) / 1e3

        def modelled(value: float, pieces: list[str] = pieces, target: str = target,
                     eff: Efficiency = eff) -> float:
            trial = _with(eff, target, value)
            t = unit_times(cost, hw, config, trial)
            return sum(getattr(t, k) for k in pieces)

        value = _solve(modelled, measured, f"{'+'.join(pieces)} = {1e3 * measured:g} ms")
        eff = _with(eff, target, value)
        for f in COMPUTE_FIELDS if target == "compute" else (target,):
            notes[f] = (f"calibrated to {cal.source}: {'+'.join(pieces)} of {cal.unit} = "
                        f"{1e3 * measured:g} ms on {cal.gpus} {cal.hardware}")
    return replace(eff, sources=tuple(notes.items()))


def _with(eff: Efficiency, target: str, value: float) -> Efficiency:
    """``eff`` with ``target`` set to ``value``; ``compute`` scales the default GEMM, attention and
    elementwise efficiencies by ``value`` (their ratios stay as assumed)."""
    if target == "compute":
        d = Efficiency()
        return replace(eff, **{f: min(1.5, getattr(d, f) * value) for f in COMPUTE_FIELDS})
    return replace(eff, **{target: value})


def _solve(modelled: Any, measured: float, what: str) -> float:
    """The value in (0, 1.5] where the decreasing ``modelled(value)`` equals ``measured`` (bisection)."""
    lo, hi = 1e-4, 1.5
    if modelled(hi) > measured:
        raise RaggedError(f"calibrate: {what} is faster than the model gives at 150% of peak; "
                          "check the GPU count, dtype and unit")
    if modelled(lo) < measured:
        raise RaggedError(f"calibrate: {what} is slower than the model gives at 0.01% of peak")
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if modelled(mid) > measured else (lo, mid)
    return (lo + hi) / 2
