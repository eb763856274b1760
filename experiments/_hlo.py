"""What a compiled XLA program moves and holds: collective bytes and bytes touched per op kind from its HLO
text, its memory_analysis."""

from __future__ import annotations

import re

import numpy as np

_COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute", "all-to-all")
_SHAPE = re.compile(r"\b(f32|bf16|f16|s32|u32|f64|s64|u8|s8|pred)\[([\d,]*)\]")
_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u8": 1, "s8": 1, "pred": 1}


def _shape_bytes(text: str) -> int:
    """Bytes of every array shape written in ``text`` (a result type, possibly a tuple)."""
    return sum(_BYTES[d] * int(np.prod([int(x) for x in dims.split(",") if x]))
               for d, dims in _SHAPE.findall(text))


def collective_bytes(hlo: str) -> dict[str, dict[str, int]]:
    """Per collective kind: how many ops and the bytes of their results, per device (SPMD program)."""
    out = {k: {"ops": 0, "bytes": 0} for k in _COLLECTIVES}
    for line in hlo.splitlines():
        m = re.search(r"=\s*(.*?)\s(" + "|".join(_COLLECTIVES) + r")(-start)?\(", line)
        if not m:
            continue
        kind = m.group(2)
        out[kind]["ops"] += 1
        out[kind]["bytes"] += _shape_bytes(m.group(1))
    return out


def memory(compiled) -> dict[str, int]:
    """``memory_analysis()`` of a compiled program, per device: argument, output, temp, alias bytes (and
    the peak where this JAX reports it)."""
    m = compiled.memory_analysis()
    out = {k: int(getattr(m, f"{k}_size_in_bytes")) for k in ("argument", "output", "temp", "alias")}
    if getattr(m, "peak_memory_in_bytes", None) is not None:
        out["peak"] = int(m.peak_memory_in_bytes)
    return out


_OP = re.compile(r"^\s*(?:ROOT )?%?(\S+) = (.*?) ([\w-]+)\((.*)$")
_NO_DATA = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast", "after-all", "partition-id",
            "replica-id"}


def _computations(hlo: str) -> tuple[list, dict[str, list]]:
    """The entry computation's ops and every other computation's, as ``(name, shape, opcode, rest)``."""
    entry, comps = [], {}
    for block in re.split(r"\n(?=\S)", hlo):
        head, *lines = block.splitlines() or [""]
        m = re.match(r"(ENTRY )?%?([\w.\-]+) ", head)
        if m:
            ops = [op.groups() for op in map(_OP.match, lines) if op]
            comps[m.group(2)] = ops
            entry = ops if m.group(1) else entry
    return entry, comps


def _fusion_reads(body: list) -> int:
    """Bytes a fusion reads: each operand whole, or only the slices taken of it (through bitcasts)."""
    total = 0
    for name, shape, opcode, _ in body:
        if opcode != "parameter":
            continue
        users, frontier = [], [name]
        while frontier:
            var = re.compile(r"%" + re.escape(frontier.pop()) + r"[,)\s]")
            for n, s, op, rest in body:
                if var.search(rest):
                    (frontier.append(n) if op == "bitcast" else users.append((s, op)))
        sliced = users and all(op in ("slice", "dynamic-slice") for _, op in users)
        total += sum(_shape_bytes(s) for s, _ in users) if sliced else _shape_bytes(shape)
    return total


def bytes_touched(hlo: str) -> dict[str, int]:
    """Bytes read plus written by the top-level ops of an optimized per-device program, per step (as
    XLA's cost analysis counts them), split into ``dot`` (dots and fusions around one) and ``other``:
    copies, slices, concatenates, element-wise fusions, collectives."""
    entry, comps = _computations(hlo)
    out = {"dot": 0, "other": 0}
    for _, shape, opcode, rest in entry:
        if opcode in _NO_DATA:
            continue
        if opcode == "fusion":
            body = comps[re.search(r"calls=%?([\w.\-]+)", rest).group(1)]
            is_dot = any(op in ("dot", "convolution") for _, _, op, _ in body)
            read = _fusion_reads(body)
        else:
            is_dot = opcode in ("dot", "convolution")
            operands = re.findall(r"%([\w.\-]+)", rest.split("), ")[0])
            shapes = {name: s for name, s, _, _ in entry}
            read = sum(_shape_bytes(shapes[o]) for o in operands if o in shapes)
        out["dot" if is_dot else "other"] += read + _shape_bytes(shape)
    return out
