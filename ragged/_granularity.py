"""Granularity: how finely the planner may cut a tensor.

A granularity resolves, for one tensor, to a block size in elements; no shard boundary may fall
strictly inside a block. Accepted forms:

- an ``int`` N or ``"N"``: blocks of N elements of the flattened tensor;
- ``"element"``: blocks of one element (FSDP1 / ZeRO-3 style);
- ``"rows:N"``: N consecutive rows of the 2-D view ``(prod(shape[:-1]), shape[-1])``;
- ``"tiles:RxC"``: ``rows:R`` plus ``shape[-1] % C == 0``, so every RxC tile stays on one device;
- ``"whole"``: never cut; one device holds the tensor.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ragged._errors import GranularityError

Shape = tuple[int, ...]

_ROWS = re.compile(r"rows:(\d+)$")
_TILES = re.compile(r"tiles:(\d+)x(\d+)$")


@dataclass(frozen=True)
class Granularity:
    """A parsed granularity. ``kind`` is one of elements, rows, tiles, whole."""

    kind: str
    n: int = 1
    cols: int = 1

    def __post_init__(self) -> None:
        if self.kind not in ("elements", "rows", "tiles", "whole"):
            raise GranularityError(
                f"unknown granularity kind {self.kind!r}; expected elements, rows, tiles or whole"
            )
        if self.n < 1 or self.cols < 1:
            raise GranularityError(
                f"granularity {self.kind} n={self.n} cols={self.cols} must have sizes >= 1"
            )

    @staticmethod
    def parse(value: Granularity | int | str) -> Granularity:
        """Parse ``int | "element" | "N" | "rows:N" | "tiles:RxC" | "whole"``."""
        if isinstance(value, Granularity):
            return value
        if isinstance(value, bool):
            raise GranularityError(f"granularity {value!r} is not an int or a string")
        if isinstance(value, int):
            if value < 1:
                raise GranularityError(f"granularity {value} must be a positive number of elements")
            return Granularity("elements", value)
        if not isinstance(value, str):
            raise GranularityError(f"granularity {value!r} is not an int or a string")
        text = value.strip().lower()
        if text in ("element", "elements"):
            return Granularity("elements", 1)
        if text == "whole":
            return Granularity("whole")
        if text.isdigit():
            return Granularity.parse(int(text))
        if m := _ROWS.match(text):
            return Granularity("rows", int(m.group(1)))
        if m := _TILES.match(text):
            return Granularity("tiles", int(m.group(1)), int(m.group(2)))
        raise GranularityError(
            f"granularity {value!r} is not one of: an int, 'element', 'rows:N', 'tiles:RxC', 'whole'"
        )

    def __str__(self) -> str:
        if self.kind == "elements":
            return "element" if self.n == 1 else str(self.n)
        if self.kind == "rows":
            return f"rows:{self.n}"
        if self.kind == "tiles":
            return f"tiles:{self.n}x{self.cols}"
        return "whole"

    def block_numel(self, shape: Shape, name: str = "tensor") -> int:
        """The block size in elements for a tensor of ``shape``; raises if it does not divide.

        A zero-size tensor has block 1: it occupies no elements, so nothing can be cut.
        """
        shape = tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise GranularityError(f"{name}: shape {shape} has a negative dim")
        numel = math.prod(shape)
        if numel == 0:
            return 1
        if self.kind == "whole":
            return numel
        if self.kind == "elements":
            if numel % self.n:
                raise GranularityError(
                    f"{name}: granularity {self} does not divide the tensor: numel {numel} of shape "
                    f"{shape} is not a multiple of {self.n}; give this tensor a granularity that divides it"
                )
            return self.n
        cols = shape[-1] if shape else 1
        rows = numel // cols
        if rows % self.n:
            raise GranularityError(
                f"{name}: granularity {self} does not divide the tensor: its 2-D view has {rows} rows "
                f"(shape {shape}), not a multiple of {self.n}; give this tensor a granularity that divides it"
            )
        if self.kind == "tiles" and cols % self.cols:
            raise GranularityError(
                f"{name}: granularity {self} does not divide the tensor: its last dim {cols} "
                f"(shape {shape}) is not a multiple of the tile width {self.cols}"
            )
        return self.n * cols


def block_numel(granularity: Granularity | int | str, shape: Shape, name: str = "tensor") -> int:
    """Resolve ``granularity`` for a tensor ``name`` of ``shape`` to a block size in elements."""
    return Granularity.parse(granularity).block_numel(shape, name)


def granularity_for(shape: Shape, matrix: Granularity | int | str = "rows:1") -> Granularity:
    """The default rule: ``matrix`` for tensors of two or more dims, element-wise for 1-D ones.

    This is what FSDP2 users expect (whole rows of every matrix stay on one device) and what the
    ``ragged plan`` command applies to tensors without their own granularity.
    """
    return Granularity.parse(matrix) if len(shape) >= 2 else Granularity("elements", 1)
