"""Lifetimes of buffers a CUDA side stream reads, checked on CPU with the collective replaced.

On CUDA, ``start_all_to_all`` packs its input on a side stream after it returns; the caching allocator
hands a freed buffer to the next allocation of the stream that made it, at once. So the input must stay
referenced until the current stream waits for the side stream, which is what ``finish`` does first:
``weakref`` shows when the last reference goes.
"""

from __future__ import annotations

import gc
import weakref

import torch

import ragged
from torch_backend.placement import _redistribute


class _Exchange:
    """A stand-in for an issued ``all_to_all``: on ``wait`` the peer's elements arrive (here: 100 + i)."""

    def __init__(self, out: torch.Tensor, alive: weakref.ref, seen: list) -> None:
        self.out, self.alive, self.seen = out, alive, seen

    def wait(self) -> None:
        self.seen.append(self.alive() is not None)  # what the side stream may still read at this point
        self.out.copy_(100 + torch.arange(self.out.numel(), dtype=self.out.dtype))


def test_an_exchange_holds_its_input_until_the_current_stream_waits_for_it(monkeypatch):
    seen: list[bool] = []
    flat = torch.arange(8.0)  # a temporary, as Muon's torch.cat(updates) and Newton-Schulz output are
    alive = weakref.ref(flat)
    monkeypatch.setattr(_redistribute, "all_to_all",
                        lambda out, inp, out_splits, in_splits, group, label: _Exchange(out, alive, seen))
    plan = [ragged.Transfer(src=0, dst=0, src_offset=0, dst_offset=0, length=2),  # stays: copied now
            ragged.Transfer(src=0, dst=1, src_offset=2, dst_offset=0, length=6),  # sent from flat
            ragged.Transfer(src=1, dst=0, src_offset=0, dst_offset=2, length=3)]  # received
    finish = _redistribute.start_all_to_all(flat, plan, 5, group=None, rank=0, world=2, what="test")
    del flat
    gc.collect()
    assert alive() is not None, "the input was freed while the side stream may still read it"
    out = finish()
    gc.collect()
    assert seen == [True]
    assert alive() is None, "the finisher keeps the input after the wait"
    assert out.tolist() == [0.0, 1.0, 100.0, 101.0, 102.0]
