"""How much of the hardware's peaks each kind of work reaches: the simulator's stated constants.

Defaults are assumptions made before looking at any measurement the simulator is compared with, each
with its reason; a calibration file (``ragged.simulate.calibrate``) replaces the ones it measures.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from ragged import RaggedError

DEFAULT_SOURCES = {
    "all_gather": "assumed 0.8 of the link peak: the usual NCCL bus-bandwidth share on NVSwitch systems",
    "reduce_scatter": "assumed 0.8 of the link peak, as all-gather",
    "all_reduce": "assumed 0.8 of the link peak, as all-gather",
    "copy": "assumed 0.8 of HBM peak for a large device-to-device copy (read + write)",
    "cast_copy": "assumed 0.8 of HBM peak for a copy with a dtype cast (read + write)",
    "gemm": "assumed 0.75 of dense bf16 peak: large cuBLAS GEMMs on Hopper reach about 70-80%",
    "attention": "assumed 0.4 of peak: FlashAttention-2 forward+backward on Hopper (FA3 reaches more)",
    "elementwise": "assumed 0.7 of HBM peak for the norms, rotary, activation and residual kernels",
    "optimizer": "assumed 0.7 of HBM peak for the fused optimizer step (memory bound)",
}


@dataclass(frozen=True)
class Efficiency:
    """Fractions of peak: link bandwidth for collectives, HBM bandwidth for copies and memory-bound
    kernels, bf16 FLOP/s for GEMMs and attention. ``sources`` says where each value comes from."""

    all_gather: float = 0.8
    reduce_scatter: float = 0.8
    all_reduce: float = 0.8
    copy: float = 0.8
    cast_copy: float = 0.8
    gemm: float = 0.75
    attention: float = 0.4
    elementwise: float = 0.7
    optimizer: float = 0.7
    sources: tuple[tuple[str, str], ...] = tuple(DEFAULT_SOURCES.items())

    def __post_init__(self) -> None:
        for name in self.names():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1.5:
                raise RaggedError(f"efficiency {name} must be a number in (0, 1.5], got {value!r}")

    @staticmethod
    def names() -> tuple[str, ...]:
        return tuple(f.name for f in fields(Efficiency) if f.name != "sources")

    def source(self, name: str) -> str:
        return dict(self.sources).get(name, "")

    def to_dict(self) -> dict[str, Any]:
        return {n: {"value": getattr(self, n), "source": self.source(n)} for n in self.names()}
