"""Which parameters Muon orthogonalizes, as which matrices, and where each matrix of a stack lies
(``matrix_holdings`` for one placed tensor, ``matrix_layout`` for a unit's buffer).

Muon orthogonalizes matrices: a 2-D weight is one, and a 3-D parameter ``[E, m, n]`` is a *stack* of ``E``
matrices ``p[e]`` (fused experts: ``gate_up_proj [E, dim, 2f]``, ``down_proj [E, f, dim]``, one matrix per
expert), each orthogonalized on its own, as when every expert is its own module. Everything else gets
AdamW: vectors, and biases whatever their shape (fused experts' ``[E, n]`` biases are ``E`` vectors, not a
matrix). Both stacks apply this one rule, so single-process Muon and Muon under expert parallelism (where
an EP rank holds rows ``[lo, hi)`` of each stack) orthogonalize the same matrices.
"""

from __future__ import annotations

import math
import re

from ragged._layout import Layout, TensorSlot
from ragged._redistribute import Holdings

Shape = tuple[int, ...]
_ROWS = re.compile(r"\[\d+:\d+\]$")  # a composed EP layout's row range: ``experts.gate_up_proj[0:4]``


def muon_matrices(name: str, shape: Shape) -> int:
    """How many matrices Muon orthogonalizes in the parameter ``name`` of ``shape`` (0: it gets AdamW).

    A 2-D weight is 1 matrix, a 3-D stack ``[E, m, n]`` is ``E`` matrices of ``(m, n)``; a name ending in
    ``bias`` (after a composed layout's ``[lo:hi]``) and every other shape are 0.
    """
    if _ROWS.sub("", name).endswith("bias") or len(shape) not in (2, 3):
        return 0
    return 1 if len(shape) == 2 else int(shape[0])


def matrix_holdings(holdings: Holdings, shape: Shape, index: int,
                    name: str = "tensor") -> tuple[Holdings, tuple[tuple[int, int], ...]]:
    """What each device holds of matrix ``index`` of the stack ``shape``, given what it holds of the stack.

    ``holdings`` are any devices' intervals of the stack's flat storage (a ``RaggedShard``'s ranges, a
    tensor-parallel box's runs, ``ragged.box_intervals``). Each device's intervals meet the matrix's interval
    ``[index m n, (index + 1) m n)``; shifted to the matrix's own flat ``(m, n)`` storage they are its
    holdings, and, since a device's local elements are its intervals in order, they are the local elements
    ``[lo, hi)`` of that device.

    Returns:
        The matrix's holdings and each device's ``(lo, hi)``, by device.

    Raises:
        IndexError: no matrix ``index`` in the stack (naming ``name``).
    """
    if not 0 <= index < shape[0]:
        raise IndexError(f"{name}: matrix {index} of a stack of {shape[0]} matrices {tuple(shape)}")
    size = math.prod(shape[1:])
    lo, hi = index * size, (index + 1) * size
    held, local = [], []
    for intervals in holdings:
        before = sum(min(b, lo) - a for a, b in intervals if a < lo)  # local elements ahead of the matrix
        mine = tuple((max(a, lo) - lo, min(b, hi) - lo) for a, b in intervals if a < hi and b > lo)
        held.append(mine)
        local.append((before, before + sum(b - a for a, b in mine)))
    return tuple(held), tuple(local)


def matrix_layout(layout: Layout) -> Layout:
    """The matrices of a unit as the tensors of a Layout of the same buffer (``muon_matrices``).

    A 2-D weight keeps its slot; matrix ``e`` of a stack ``name`` becomes the tensor ``name[e]`` of shape
    ``(m, n)`` over its interval of the stack (one-element blocks, align 1: a stack's granularity need not
    keep a matrix's edges on shard boundaries); every other tensor is left out. A backend then gathers and
    scatters each matrix by name with the same redistribution plans as a 2-D weight.
    """
    tensors = []
    for t in layout.tensors:
        count = muon_matrices(t.name, t.shape)
        if count and len(t.shape) == 2:
            tensors.append(t)
        elif count:
            size = math.prod(t.shape[1:])
            tensors += [TensorSlot(f"{t.name}[{e}]", tuple(t.shape[1:]), 1, t.offset + e * size)
                        for e in range(count)]
    return Layout(layout.world_size, layout.shard_size, tuple(tensors), 1, layout.name)
