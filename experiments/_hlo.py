"""What a compiled XLA program moves and holds: collective bytes from its HLO text, its memory_analysis."""

from __future__ import annotations

import re

import numpy as np

_COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute", "all-to-all")
_SHAPE = re.compile(r"\b(f32|bf16|f16|s32|u32|f64|s64|u8|s8|pred)\[([\d,]*)\]")
_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u8": 1, "s8": 1, "pred": 1}


def collective_bytes(hlo: str) -> dict[str, dict[str, int]]:
    """Per collective kind: how many ops and the bytes of their results, per device (SPMD program)."""
    out = {k: {"ops": 0, "bytes": 0} for k in _COLLECTIVES}
    for line in hlo.splitlines():
        m = re.search(r"=\s*(.*?)\s(" + "|".join(_COLLECTIVES) + r")(-start)?\(", line)
        if not m:
            continue
        kind = m.group(2)
        out[kind]["ops"] += 1
        for dtype, dims in _SHAPE.findall(m.group(1)):
            out[kind]["bytes"] += _BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d]))
    return out


def memory(compiled) -> dict[str, int]:
    """``memory_analysis()`` of a compiled program, per device: argument, output, temp, alias bytes (and
    the peak where this JAX reports it)."""
    m = compiled.memory_analysis()
    out = {k: int(getattr(m, f"{k}_size_in_bytes")) for k in ("argument", "output", "temp", "alias")}
    if getattr(m, "peak_memory_in_bytes", None) is not None:
        out["peak"] = int(m.peak_memory_in_bytes)
    return out
