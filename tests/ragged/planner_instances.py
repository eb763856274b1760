"""Hypothesis strategies for planning instances shared by the planner's property tests."""

from __future__ import annotations

import math

from hypothesis import strategies as st


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0] if n else [1]


@st.composite
def tensor_request(draw: st.DrawFn, name: str, scale: int = 1) -> tuple[str, tuple[int, ...], str]:
    """One ``(name, shape, granularity)``: zero-size, one-element, 1-D to 3-D tensors with a
    granularity that divides them, from element-wise up to ``whole`` (huge blocks)."""
    ndim = draw(st.sampled_from([1, 1, 2, 2, 2, 3]))
    if ndim == 1:
        shape = (draw(st.sampled_from([0, 1, 1, 2, 3, 5, 7, 8, 12, 16, 30, 48])) * scale,)
    elif ndim == 2:
        shape = (draw(st.integers(0, 12)) * scale, draw(st.sampled_from([1, 2, 3, 4, 5, 8])))
    else:
        shape = (draw(st.integers(0, 4)), draw(st.integers(1, 4)) * scale, draw(st.integers(1, 4)))
    numel = math.prod(shape)
    rows = numel // shape[-1] if shape[-1] else 0
    options = ["element", "whole"]
    options += [f"rows:{d}" for d in _divisors(rows)]
    options += [str(d) for d in _divisors(numel)]
    options += [f"tiles:{r}x{c}" for r in _divisors(rows)[:3] for c in _divisors(shape[-1])[:3]]
    return name, shape, draw(st.sampled_from(options))


@st.composite
def instance(draw: st.DrawFn, max_tensors: int = 8, max_world: int = 9, scale: int = 1) -> tuple:
    """``(tensors, world_size, align)`` with odd and even world sizes and align 1, 2, 4 or 8."""
    n = draw(st.integers(0, max_tensors))
    tensors = [draw(tensor_request(f"t{i}", scale)) for i in range(n)]
    world = draw(st.integers(1, max_world))
    align = draw(st.sampled_from([1, 2, 4, 8]))
    return tensors, world, align
