"""A model's FSDP units as ``plan_model`` reads them: shapes (``UnitShapes``, ``ModelShapes``) or specs
(``UnitSpecs``, with each tensor's granularity resolved).

They live in the core because ``plan_model`` dispatches on them; ``ragged.models`` exports them with the
presets and the shapes-file reader that make them (so the core never imports its sub-packages).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from ragged._layout import TensorSpec

Shape = tuple[int, ...]


@dataclass(frozen=True)
class UnitShapes:
    """The tensors of one FSDP unit: ``(fqn, shape)`` pairs in model order."""

    name: str
    tensors: tuple[tuple[str, Shape], ...]

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for _, s in self.tensors)


@dataclass(frozen=True)
class ModelShapes:
    name: str
    units: tuple[UnitShapes, ...]

    @property
    def numel(self) -> int:
        return sum(u.numel for u in self.units)


class UnitSpecs(NamedTuple):
    """One FSDP unit ready to plan: its name and its tensors in model order."""

    name: str
    tensors: tuple[TensorSpec, ...]
