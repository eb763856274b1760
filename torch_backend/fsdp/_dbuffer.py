"""DBuffer: one FSDP unit's flat buffer in one dtype, laid out by a core ``ragged.Layout``.

The global buffer has ``world_size * shard_size`` elements. Each rank keeps its shard (``shard_size``
elements, persistent); the unsharded buffer (``full``) exists only while a unit is unsharded and its
storage is allocated and freed in place, so views made once stay valid. Every tensor of the unit is a
view: its local piece into ``shard`` (1-D) and its whole value into ``full`` (its own shape). Offsets and
pieces are read from the Layout, never recomputed, so a collective on the whole buffer moves every
tensor at once and nothing needs to be packed or unpacked.

Group operations (zero, scale, add, copy, norm) run once over the shard, not once per tensor; padding
between tensors stays zero, so it never changes a norm or a sum.
"""

from __future__ import annotations

import torch

from ragged import Layout
from torch_backend._debug import record_copy


class DBuffer:
    """A unit's flat buffer: a persistent local ``shard`` and an on-demand unsharded ``full``.

    Args:
        layout: the unit's planned layout (offsets, shard size, pieces).
        rank: this device's index on the sharding mesh dim.
        dtype: element type of both buffers.
        device: where both buffers live (taken from the mesh by the caller).
        with_shard: False for a buffer only ever used unsharded (gradients before their reduce): its
            ``shard`` is then empty and holds no memory.
        pin_memory: pin the shard (host buffers of CPU offload, copied to and from an accelerator).
    """

    layout: Layout
    rank: int
    shard: torch.Tensor  # 1D [shard_size] (or [0] without a shard), persistent
    full: torch.Tensor  # 1D [world_size * shard_size], storage allocated only while unsharded

    def __init__(self, layout: Layout, rank: int, dtype: torch.dtype, device: torch.device,
                 with_shard: bool = True, pin_memory: bool = False) -> None:
        self.layout = layout
        self.rank = rank
        self.shard = torch.zeros(layout.shard_size if with_shard else 0, dtype=dtype, device=device,
                                 pin_memory=pin_memory)
        self.full = torch.empty(layout.total_numel, dtype=dtype, device=device)
        self._pieces = {p.name: p for p in layout.local_pieces(rank)}
        self._full_views = {t.name: self.full[t.offset:t.end].view(t.shape) for t in layout.tensors}
        self.free_full()

    def relabel(self, layout: Layout) -> None:
        """Adopt ``layout``: the same slots under new names (offsets are checked, never moved)."""
        old = self.layout
        if [(t.offset, t.shape) for t in old.tensors] != [(t.offset, t.shape) for t in layout.tensors] \
                or old.shard_size != layout.shard_size:
            raise ValueError(f"DBuffer.relabel: layout {layout.name!r} moves tensors of {old.name!r}")
        rename = {o.name: n.name for o, n in zip(old.tensors, layout.tensors)}
        self.layout = layout
        self._pieces = {rename[k]: p for k, p in self._pieces.items()}
        self._full_views = {rename[k]: v for k, v in self._full_views.items()}

    @property
    def dtype(self) -> torch.dtype:
        return self.shard.dtype

    # ----- views ----------------------------------------------------------------------------------
    def shard_view(self, name: str) -> torch.Tensor:
        """Tensor ``name``'s local piece: a 1-D view into ``shard`` (empty when this rank holds none)."""
        piece = self._pieces.get(name)
        if piece is None:
            self.layout.slot(name)  # raises KeyError naming the tensor when it is not in the layout
            return self.shard[:0]
        return self.shard[piece.local_offset:piece.local_offset + piece.stop - piece.start]

    def full_view(self, name: str) -> torch.Tensor:
        """Tensor ``name`` in the unsharded buffer, in its own shape (valid while ``full`` is allocated)."""
        return self._full_views[name]

    def local_range(self, name: str) -> tuple[int, int]:
        """``[start, stop)`` of tensor ``name``'s flat storage held here (``(0, 0)`` when none)."""
        piece = self._pieces.get(name)
        return (piece.start, piece.stop) if piece else (0, 0)

    # ----- storage on demand ----------------------------------------------------------------------
    @property
    def full_allocated(self) -> bool:
        return _allocated(self.full)

    def alloc_full(self) -> None:
        """Give ``full`` its storage back (on the current stream); views made before stay valid."""
        _alloc(self.full)

    def free_full(self) -> None:
        """Release ``full``'s storage; every view into it keeps its metadata."""
        _free(self.full)

    @property
    def shard_allocated(self) -> bool:
        return _allocated(self.shard)

    def alloc_shard(self) -> None:
        """Give ``shard`` its storage back (uninitialised) after ``free_shard``."""
        _alloc(self.shard)

    def free_shard(self) -> None:
        """Release ``shard``'s storage (the sharded gradients between zero_grad and the next reduce)."""
        _free(self.shard)

    # ----- group operations over the shard --------------------------------------------------------
    def zero_(self) -> None:
        self.shard.zero_()

    def scale_(self, factor: float | torch.Tensor) -> None:
        self.shard.mul_(factor)

    def add_(self, other: torch.Tensor) -> None:
        """Add a flat shard (``shard_size`` elements) into this one."""
        self.shard.add_(other)

    def copy_(self, other: torch.Tensor, non_blocking: bool = False) -> None:
        """Copy (or cast, or move across devices) a flat shard of ``shard_size`` elements into this one."""
        record_copy(self.shard, other)
        self.shard.copy_(other, non_blocking=non_blocking)

    def norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """The ``norm_type`` vector norm of every tensor of the unit held here, in one kernel (in fp32, or in
        the buffer's dtype if wider)."""
        return torch.linalg.vector_norm(self.shard, norm_type, dtype=norm_dtype(self.dtype))


def norm_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a norm of ``dtype`` values is summed in: fp32 for bf16/fp16/fp32, float64 for float64."""
    return torch.promote_types(dtype, torch.float32)


def _allocated(t: torch.Tensor) -> bool:
    return t.untyped_storage().size() > 0


def _alloc(t: torch.Tensor) -> None:
    if not _allocated(t):
        t.untyped_storage().resize_(t.numel() * t.element_size())


def _free(t: torch.Tensor) -> None:
    if _allocated(t):
        t.untyped_storage().resize_(0)
