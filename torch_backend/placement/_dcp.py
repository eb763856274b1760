"""torch.distributed.checkpoint metadata for RaggedShard DTensors.

DCP describes every saved piece as a regular box (``offsets``, ``sizes``) of the global tensor. A
ragged local tensor is a flat range of its box's row-major storage, which is not one box, so it is
split into at most ``2 * ndim - 1`` regular boxes: a partial run of the innermost dim, full runs
of larger and larger dims, then the mirror image down to the end. Every such box is a contiguous
piece of the flat local tensor, so saving and loading read and write views of the local storage.
Without this split DCP would take the flat local for the whole box and silently corrupt the file.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType


class Chunk(NamedTuple):
    """One regular box of a ragged local tensor: global offsets, sizes and where it starts in the local."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    local_start: int


def flat_range_boxes(
    shape: tuple[int, ...], start: int, stop: int
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Split the flat row-major range ``[start, stop)`` of ``shape`` into regular boxes, in order.

    Args:
        shape: the tensor (box) shape.
        start: first flat index.
        stop: one past the last flat index.

    Returns:
        ``(offsets, sizes)`` of each box; their flat ranges tile ``[start, stop)`` in order.

    Example:
        >>> flat_range_boxes((3, 4), 2, 11)
        [((0, 2), (1, 2)), ((1, 0), (1, 4)), ((2, 0), (1, 3))]
    """
    shape = tuple(shape)
    if start >= stop:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    first, last = start // inner, (stop - 1) // inner
    if first == last or (start % inner == 0 and stop % inner == 0):
        if start % inner == 0 and stop % inner == 0:
            return [((first, *(0,) * (len(shape) - 1)), (last - first + 1, *shape[1:]))]
        return [
            ((first, *o), (1, *s))
            for o, s in flat_range_boxes(shape[1:], start % inner, (stop - 1) % inner + 1)
        ]
    boxes = []
    head_end = (first + 1) * inner if start % inner else start
    if start % inner:
        boxes += flat_range_boxes(shape, start, head_end)
    tail_start = last * inner if stop % inner else stop
    if tail_start > head_end:
        boxes += flat_range_boxes(shape, head_end, tail_start)
    if stop % inner:
        boxes += flat_range_boxes(shape, tail_start, stop)
    return boxes


def chunks(box_shape: tuple[int, ...], box_offset: tuple[int, ...], start: int, stop: int) -> list[Chunk]:
    """The regular global boxes of a ragged local ``[start, stop)`` of a box at ``box_offset``."""
    out, pos = [], 0
    for offsets, sizes in flat_range_boxes(box_shape, start, stop):
        out.append(Chunk(tuple(o + b for o, b in zip(offsets, box_offset)), sizes, pos))
        pos += math.prod(sizes)
    return out


def chunk_view(local: torch.Tensor, chunk: Chunk) -> torch.Tensor:
    """The view of the flat local tensor that holds ``chunk`` (shares storage, so loads write through)."""
    n = math.prod(chunk.sizes)
    return local.view(-1)[chunk.local_start : chunk.local_start + n].view(chunk.sizes)


def write_items(
    fqn: str, local: torch.Tensor, global_shape: torch.Size, pieces: list[Chunk]
) -> list[WriteItem]:
    """One DCP WriteItem per regular box of the ragged local tensor."""
    return [
        WriteItem(
            index=MetadataIndex(fqn, torch.Size(c.offsets)),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes)),
                properties=TensorProperties.create_from_tensor(local),
                size=torch.Size(global_shape),
            ),
        )
        for c in pieces
    ]


def chunk_list(pieces: list[Chunk]) -> list[ChunkStorageMetadata]:
    return [ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes)) for c in pieces]


def find(local: torch.Tensor, pieces: list[Chunk], index: MetadataIndex, fqn: str) -> torch.Tensor:
    """The local view whose global offsets are ``index.offset``."""
    for c in pieces:
        if torch.Size(c.offsets) == index.offset:
            return chunk_view(local, c)
    raise ValueError(f"{fqn}: no ragged chunk at offset {tuple(index.offset)} on this rank")
