"""Baseline shardings of one FSDP unit, measured the way ``Layout`` is, for side-by-side comparison.

Each baseline takes the same ``TensorSpec``s (name, shape, block) as ``plan`` and reports the
elements each device holds (padding included), the padding, and how many blocks its shard
boundaries cut (a cut block must be reassembled by communication before a block-wise optimizer,
a quantizer or Newton-Schulz can touch it; ``plan`` never cuts one).

- ``fsdp1``: PyTorch FSDP1's FlatParameter. Tensors are concatenated in model order (each offset
  aligned to the collective alignment, as ``use_orig_params=True`` does) and the flat buffer is cut
  element-wise into ``m`` equal shards of ``ceil(total / m)``.
- ``fsdp2``: PyTorch FSDP2's per-parameter ``Shard(0)``. Each tensor's dim 0 is padded to a multiple
  of ``m``; every device holds ``ceil(dim0 / m)`` rows of every tensor.
- ``zero3``: DeepSpeed ZeRO-3. Each tensor is flattened and padded to a multiple of ``m``; every
  device holds ``ceil(numel / m)`` elements of every tensor.
- ``megatron``: Megatron-FSDP style. The buffer is a grid of chunks of ``c = lcm(align, blocks)``
  elements (Megatron-FSDP's ``chunk_size_factor``, the LCM of the row sizes). Tensors of at least
  one chunk start on the grid in model order; smaller ones go first-fit into the gaps those leave at
  the end of their last chunk, else after them without crossing a grid point mid-block. The buffer
  is cut into ``m`` equal shards of a whole number of chunks, so no block is cut. (Megatron-FSDP
  also pairs the remainders of two large tensors in one chunk; this model leaves that out.)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ragged._errors import PlanningError
from ragged._layout import PaddedBuffer, TensorSpec, ceil_to

BASELINES = ("fsdp1", "fsdp2", "zero3", "megatron")


@dataclass(frozen=True)
class BaselineLayout(PaddedBuffer):
    """One baseline's sharding of one unit, reduced to what the comparison needs.

    ``shard_size`` is the number of elements every device holds, padding included (every baseline
    uses equal shards, so one all-gather of ``m * shard_size`` elements unshards the unit). Like
    ``Layout.shard_size`` it is a multiple of the collective alignment ``align``.
    """

    method: str
    world_size: int
    shard_size: int
    used_numel: int
    split_blocks: int

    @property
    def keeps_blocks_whole(self) -> bool:
        return self.split_blocks == 0

    def allgather_bytes(self, itemsize: int) -> int:
        """Bytes one device receives when the unit is all-gathered (padding included)."""
        return allgather_bytes(self.shard_size, self.world_size, itemsize)


def allgather_bytes(shard_size: int, world_size: int, itemsize: int) -> int:
    """Bytes one device receives in an all-gather of ``world_size`` shards of ``shard_size``.

    Every device receives the ``world_size - 1`` shards it does not hold; padding travels too.
    """
    return (world_size - 1) * shard_size * itemsize


def count_split_blocks(offset: int, numel: int, block: int, step: int, n_cuts: int) -> int:
    """Blocks of a tensor at ``[offset, offset + numel)`` cut by boundaries at ``step * k``.

    Boundaries are ``k * step`` for ``k = 1 .. n_cuts``; a block ``[offset + j*block, offset +
    (j+1)*block)`` is split when one of them falls strictly inside it. Each block counts once.
    """
    if numel == 0 or block == 1 or step < 1:
        return 0
    k_lo = offset // step + 1  # the first boundary strictly after the tensor's start
    k_hi = min(n_cuts, (offset + numel - 1) // step)  # the last one strictly before its end
    if k_lo > k_hi:
        return 0
    pos = np.arange(k_lo, k_hi + 1, dtype=np.int64) * step - offset  # boundary positions in the tensor
    cut = pos[pos % block != 0] // block
    return int(np.unique(cut).size)


def fsdp1(specs: Sequence[TensorSpec], world_size: int, align: int) -> BaselineLayout:
    """FSDP1: aligned flat concatenation, cut element-wise into ``world_size`` equal shards."""
    offsets, cur = [], 0
    for s in specs:
        cur = ceil_to(cur, align)
        offsets.append(cur)
        cur += s.numel
    shard = ceil_to(max(1, -(-cur // world_size)), align)
    return BaselineLayout("fsdp1", world_size, shard, _used(specs), _flat_split(specs, offsets, shard,
                                                                                world_size))


def fsdp2(specs: Sequence[TensorSpec], world_size: int, align: int) -> BaselineLayout:
    """FSDP2: per-tensor ``Shard(0)``, dim 0 padded to a multiple of ``world_size``."""
    shard, split = 0, 0
    for s in specs:
        if s.numel == 0:
            continue
        rows = s.shape[0] if s.shape else 1  # a 0-d tensor is sharded as one row
        row_numel = s.numel // rows
        chunk = -(-rows // world_size) * row_numel  # torch.chunk's rows per device, padded
        shard += chunk
        split += count_split_blocks(0, s.numel, s.block, chunk, world_size - 1)
    return BaselineLayout("fsdp2", world_size, ceil_to(max(shard, 1), align), _used(specs), split)


def zero3(specs: Sequence[TensorSpec], world_size: int, align: int) -> BaselineLayout:
    """DeepSpeed ZeRO-3: per-tensor flat partitions, each tensor padded to a multiple of ``world_size``."""
    shard, split = 0, 0
    for s in specs:
        chunk = -(-s.numel // world_size)
        shard += chunk
        split += count_split_blocks(0, s.numel, s.block, chunk, world_size - 1)
    return BaselineLayout("zero3", world_size, ceil_to(max(shard, 1), align), _used(specs), split)


def megatron(specs: Sequence[TensorSpec], world_size: int, align: int) -> BaselineLayout:
    """Megatron-FSDP style: tensors on a grid of ``lcm(align, blocks)`` chunks, shards of whole chunks."""
    offsets, chunk, end = megatron_offsets(specs, align)
    shard = max(1, -(-end // (world_size * chunk))) * chunk
    return BaselineLayout("megatron", world_size, shard, _used(specs), _flat_split(specs, offsets, shard,
                                                                                   world_size))


def megatron_offsets(specs: Sequence[TensorSpec], align: int) -> tuple[list[int], int, int]:
    """The Megatron-style buffer: each tensor's offset, the chunk size and the buffer's used end."""
    chunk = math.lcm(align, *(s.block for s in specs if s.numel))
    offsets: dict[int, int] = {}
    gaps: list[list[int]] = []  # [start, stop) free tails of the last chunk of a large tensor
    cur = 0
    for i, s in enumerate(specs):
        if s.numel >= chunk:
            offsets[i] = cur
            end = cur + s.numel
            cur = ceil_to(end, chunk)
            if end < cur:
                gaps.append([end, cur])
    for i, s in enumerate(specs):
        if 0 < s.numel < chunk:
            offsets[i] = _first_fit(gaps, s.numel, align)
            if offsets[i] < 0:
                offsets[i] = _next_whole(cur, s.numel, s.block, chunk, align)
                cur = offsets[i] + s.numel
        elif s.numel == 0:
            offsets[i] = 0
    return [offsets[i] for i in range(len(specs))], chunk, cur


def _first_fit(gaps: list[list[int]], numel: int, align: int) -> int:
    """Take ``numel`` aligned elements from the first gap that has room; -1 when none has."""
    for gap in gaps:
        start = ceil_to(gap[0], align)
        if start + numel <= gap[1]:
            gap[0] = start + numel
            return start
    return -1


def _next_whole(cur: int, numel: int, block: int, chunk: int, align: int) -> int:
    """The aligned offset at or after ``cur`` whose grid crossings all fall on block edges."""
    start = ceil_to(cur, align)
    grid = ceil_to(start + 1, chunk)  # the first grid point strictly after the start
    if grid < start + numel and (grid - start) % block:
        return grid  # a numel < chunk tensor starting on the grid crosses no other grid point
    return start


def _flat_split(specs: Sequence[TensorSpec], offsets: Sequence[int], shard: int, world_size: int) -> int:
    """Blocks cut by the boundaries of ``world_size`` equal shards of one flat buffer."""
    return sum(count_split_blocks(o, s.numel, s.block, shard, world_size - 1) for o, s in zip(offsets, specs))


def _used(specs: Sequence[TensorSpec]) -> int:
    return sum(s.numel for s in specs)


def baseline_layouts(specs: Sequence[TensorSpec], world_size: int, *, align: int = 4
                     ) -> tuple[BaselineLayout, ...]:
    """Every baseline's sharding of one unit, in the order of ``BASELINES``.

    Args:
        specs: the unit's tensors (``TensorSpec``s, in model order), as given to ``plan``.
        world_size: the number of devices ``m``.
        align: the collectives' alignment in elements, as ``plan``'s ``align``: every shard is a multiple of
            it (so each device's part of the all-gather output is aligned, as in ours), FSDP1
            offsets and Megatron chunks honour it too.

    Returns:
        ``(fsdp1, fsdp2, zero3, megatron)`` ``BaselineLayout``s.

    Raises:
        PlanningError: ``world_size`` or ``align`` is not an int >= 1.

    Example:
        >>> from ragged import TensorSpec
        >>> experts = TensorSpec("experts", (128, 64, 32), "rows:1")
        >>> [b.padding_ratio for b in baseline_layouts([experts], 256)][1]  # FSDP2 doubles the buffer
        0.5
    """
    for label, value in (("world_size", world_size), ("align", align)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlanningError(f"baseline_layouts: {label} must be an int >= 1, got {value!r}")
    specs = list(specs)
    return (fsdp1(specs, world_size, align), fsdp2(specs, world_size, align),
            zero3(specs, world_size, align), megatron(specs, world_size, align))
