"""A debug counter of what the runtime moves: collectives issued, bytes they move, bytes copied, waits.

``with debug_counter() as c:`` makes ``c`` record every collective and every copy or cast the runtime
issues while the block runs (nested counters all record). Tests read it to prove one all-gather and one
reduce-scatter per unit per step and zero bytes copied outside collectives; benchmarks report it.
Bytes are the size of the whole buffer a collective writes (all-gather, all-reduce) or reads
(reduce-scatter), padding included.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

_ACTIVE: list[DebugCounter] = []  # the counters recording now (innermost last)


@dataclass
class DebugCounter:
    """Tallies of one recording window.

    Attributes:
        issued: the collectives issued, as ``(kind, label)`` pairs (a unit's name, or what else moved) in
            the order they were issued; ``calls`` counts them.
        bytes: bytes moved by collectives, keyed by kind (``all_gather``, ``reduce_scatter``, ``all_reduce``).
        copy_bytes: bytes the runtime copied outside collectives (same dtype).
        cast_bytes: bytes the runtime wrote while changing dtype (mixed precision only).
        wait_seconds: host seconds blocked finishing collectives (``Pending.wait``): the communication
            that computation did not hide (on CUDA the host does not block, so there a lower bound).
        host_syncs: the runtime's reads of device values on the host (each drains the device's queue on
            CUDA), by what they read: a small collective's result or a mask.
    """

    issued: list = field(default_factory=list)
    bytes: Counter = field(default_factory=Counter)
    copy_bytes: int = 0
    cast_bytes: int = 0
    wait_seconds: float = 0.0
    host_syncs: Counter = field(default_factory=Counter)

    @property
    def calls(self) -> Counter:
        """Collectives issued, counted by ``(kind, label)``."""
        return Counter(self.issued)

    def per_label(self, kind: str) -> dict[str, int]:
        """Collectives of ``kind`` issued, per label (a unit's name, ``"clip_grad_norm_"``, ...)."""
        return {label: n for (k, label), n in self.calls.items() if k == kind}


@contextmanager
def debug_counter() -> Iterator[DebugCounter]:
    """Record what the runtime issues inside the block into a fresh ``DebugCounter``."""
    counter = DebugCounter()
    _ACTIVE.append(counter)
    try:
        yield counter
    finally:
        _ACTIVE.remove(counter)


def record_collective(kind: str, label: str, tensor: torch.Tensor) -> None:
    for c in _ACTIVE:
        c.issued.append((kind, label))
        c.bytes[kind] += tensor.numel() * tensor.element_size()


def record_host_sync(label: str) -> None:
    for c in _ACTIVE:
        c.host_syncs[label] += 1


def record_wait(seconds: float) -> None:
    for c in _ACTIVE:
        c.wait_seconds += seconds


def record_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    nbytes = dst.numel() * dst.element_size()
    for c in _ACTIVE:
        if dst.dtype == src.dtype:
            c.copy_bytes += nbytes
        else:
            c.cast_bytes += nbytes
