"""The units to plan, from a preset model or a shapes file, with their granularities resolved.

A shapes file is JSON::

    {"units": [{"name": "layers.0",
                "tensors": [{"name": "layers.0.wq.weight", "shape": [4096, 4096]},
                            {"name": "layers.0.norm.weight", "shape": [4096], "granularity": "whole"}]}]}

A tensor's own ``granularity`` wins; otherwise the default rule ``granularity_for(shape, matrix)``
applies (``matrix`` for tensors of two or more dims, element-wise for 1-D ones).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ragged._errors import RaggedError
from ragged._granularity import Granularity, granularity_for
from ragged._layout import TensorSpec
from ragged._units import ModelShapes, UnitSpecs
from ragged.models._presets import model_shapes


def model_units(model: str | ModelShapes, matrix: Granularity | int | str = "rows:1"
                ) -> tuple[UnitSpecs, ...]:
    """The units of a preset (by name or as ``ModelShapes``) under the default granularity rule.

    Raises:
        RaggedError: unknown model; GranularityError (naming the tensor) when ``matrix`` does not
            divide one of its tensors.
    """
    shapes = model_shapes(model) if isinstance(model, str) else model
    matrix = Granularity.parse(matrix)
    return tuple(
        UnitSpecs(u.name, tuple(TensorSpec(n, s, granularity_for(s, matrix)) for n, s in u.tensors))
        for u in shapes.units
    )


def parse_shapes(data: Any, matrix: Granularity | int | str = "rows:1", source: str = "shapes"
                 ) -> tuple[UnitSpecs, ...]:
    """Units from a decoded shapes document (see the module docstring).

    Args:
        data: the decoded JSON document.
        matrix: the granularity of tensors of two or more dims that give none of their own.
        source: where ``data`` came from, quoted in errors.

    Raises:
        RaggedError: a malformed document, naming the entry (``units[1].tensors[0].shape``) and
            what it must be; GranularityError naming the tensor a granularity does not divide.
    """
    matrix = Granularity.parse(matrix)
    units = _field(data, "units", list, source)
    if not units:
        raise RaggedError(f"{source}: 'units' is empty; give at least one unit")
    out = []
    for i, unit in enumerate(units):
        where = f"{source}: units[{i}]"
        name = _field(unit, "name", str, where)
        tensors = _field(unit, "tensors", list, where)
        specs = []
        for j, t in enumerate(tensors):
            at = f"{where}.tensors[{j}]"
            tname = _field(t, "name", str, at)
            shape = _field(t, "shape", list, f"{at} ({tname})")
            if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
                raise RaggedError(f"{at} ({tname}): 'shape' must be a list of non-negative ints, got {shape}")
            gran = t.get("granularity")
            gran = granularity_for(shape, matrix) if gran is None else Granularity.parse(gran)
            specs.append(TensorSpec(tname, tuple(shape), gran))
        out.append(UnitSpecs(name, tuple(specs)))
    return tuple(out)


def read_shapes_file(path: str | Path, matrix: Granularity | int | str = "rows:1") -> tuple[UnitSpecs, ...]:
    """``parse_shapes`` of the JSON file at ``path``.

    Raises:
        RaggedError: the file is missing, unreadable or not JSON, or ``parse_shapes`` rejects it.
    """
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise RaggedError(f"shapes file {str(path)!r}: cannot read it ({e.strerror or e})") from None
    except json.JSONDecodeError as e:
        raise RaggedError(f"shapes file {str(path)!r}: not valid JSON ({e.msg} at line {e.lineno})") from None
    return parse_shapes(data, matrix, source=f"shapes file {str(path)!r}")


def _field(obj: Any, key: str, kind: type, where: str) -> Any:
    if not isinstance(obj, dict):
        raise RaggedError(f"{where}: must be a JSON object with {key!r}, got {type(obj).__name__}")
    if key not in obj:
        raise RaggedError(f"{where}: missing {key!r}")
    if not isinstance(obj[key], kind):
        raise RaggedError(f"{where}: {key!r} must be a {kind.__name__}, got {obj[key]!r:.60}")
    return obj[key]
