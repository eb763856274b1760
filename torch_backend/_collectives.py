"""Stateless whole-buffer collectives: one all-gather, reduce-scatter, all-reduce or all-to-all per call.

The DBuffer's local shard is the all-gather input and the reduce-scatter output as it is, so nothing here
packs or unpacks: each function is one ``torch.distributed`` call on a flat buffer (compare FSDP2's
copy-in / copy-out around the same calls). Every call is issued asynchronously and returns a
``Pending``; ``Pending.wait()`` finishes it or raises a ``CollectiveError`` that names the collective,
its label (what it moved: a unit, a Muon bucket, a redistribution) and the rank, so a dead or failing
peer never surfaces as an anonymous gloo/NCCL error.

On CUDA the caller issues inside ``side_stream(s)``: the collective runs after the current stream's
work, and ``wait()`` makes the (then) current stream wait on an event recorded after it: explicit
dependencies, no ``record_stream``.

On gloo, ``reduce_scatter`` is one ``all_to_all_single`` (chunk ``d`` of the buffer to rank ``d``) and a
local sum of the chunks received, in rank order: gloo's own ``reduce_scatter_tensor`` copies the buffer,
all-reduces all of it and copies this rank's slice out. ``all_gather`` is one broadcast per rank, each
from that rank's slice of the output, in place (all in flight at once): gloo's own
``all_gather_into_tensor`` gathers into a temporary of the whole buffer and copies it out. Each rank sends
its shard to every peer, ``(world - 1) / world`` of the buffer, as in a ring; the times of both pairs are in
``experiments/results/gloo_collectives.md``. They are gloo collectives, each in gloo's own sequence, so an
all-gather issued and never waited for (a prefetch whose forward never came) finishes in the background
like any other collective.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from torch_backend._debug import record_collective, record_wait

# torch 2.13 renames the flat-buffer collectives (same arguments) and deprecates the old names.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the message names it, what it moved and the rank."""


class Pending:
    """An issued collective. ``wait()`` finishes it (once) or raises ``CollectiveError``.

    ``then`` runs once the work is done, inside ``wait()`` (gloo's reduce-scatter: the local sum).
    """

    def __init__(self, work: dist.Work | None, what: str, event: torch.cuda.Event | None = None,
                 then: Callable[[], object] | None = None) -> None:
        self._work = work
        self._what = what
        self._event = event
        self._then = then

    @property
    def done(self) -> bool:
        """The collective has completed (a query: never blocks the host nor orders a stream)."""
        return ((self._work is None or self._work.is_completed())
                and (self._event is None or self._event.query()))

    def wait(self) -> None:
        work, self._work = self._work, None
        if work is not None:
            start = time.perf_counter()
            try:
                work.wait()
            except Exception as e:  # gloo/NCCL raise RuntimeError or DistBackendError subclasses
                raise CollectiveError(f"{self._what} failed: {e}") from e
            finally:
                record_wait(time.perf_counter() - start)
        then, self._then = self._then, None
        if then is not None:
            then()
        if self._event is not None:
            torch.cuda.current_stream().wait_event(self._event)
            self._event = None


@contextlib.contextmanager
def side_stream(stream: torch.cuda.Stream | None, after: torch.Event | None = None) -> Iterator[None]:
    """Run the block on ``stream`` after everything issued so far on the current stream (CPU: as is), or
    only after ``after`` when given (FSDP2's post-optimizer event).

    Buffers allocated inside belong to ``stream``'s pool; since every later entry waits for the current
    stream first, memory freed after use on the current stream is only reused once that use is done.
    """
    if stream is None:
        yield
        return
    if after is not None:
        stream.wait_event(after)
    else:
        stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        yield


def _issue(kind: str, label: str, group: dist.ProcessGroup, moved: torch.Tensor,
           call: Callable[[], dist.Work], then: Callable[[], object] | None = None) -> Pending:
    """Issue ``call`` now; on CUDA order the current stream after it and hand back an event instead.
    ``then`` (host tensors only) runs once the work is done."""
    what = (f"{kind} of {label!r} ({moved.numel()} x {moved.dtype} over {dist.get_world_size(group)} "
            f"ranks) on rank {dist.get_rank()}")
    record_collective(kind, label, moved)
    try:
        work = call()
        if not moved.is_cuda:
            return Pending(work, what, then=then)
        work.wait()  # NCCL: a stream-side wait, the CPU goes on
        return Pending(None, what, torch.cuda.current_stream().record_event())
    except Exception as e:
        raise CollectiveError(f"{what} failed: {e}") from e


def _gloo_carries(tensor: torch.Tensor, group: dist.ProcessGroup) -> bool:
    """gloo moves ``tensor`` over ``group``: a host tensor on a gloo group, on a per-device one whose CPU
    backend is gloo (``"cpu:gloo,cuda:nccl"``), or on one made without a backend (gloo is the CPU default)."""
    backend = dist.get_backend(group)
    return tensor.device.type == "cpu" and (backend in ("gloo", "undefined") or "cpu:gloo" in backend)


def _check_even(kind: str, label: str, group: dist.ProcessGroup, full: torch.Tensor, shard: torch.Tensor
                ) -> int:
    """The group's size, once ``full`` is checked to hold one ``shard`` per rank (before anything is sent:
    the peers would wait for it)."""
    world = dist.get_world_size(group)
    if full.numel() != world * shard.numel():
        raise ValueError(f"{kind} of {label!r}: a buffer of {full.numel()} elements does not split into "
                         f"{world} shards of {shard.numel()}")
    return world


class _AllOf:
    """Several issued works finished as one (the gloo all-gather's broadcasts)."""

    def __init__(self, works: list[dist.Work]) -> None:
        self._works = works

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def wait(self) -> None:
        errors = []
        for w in self._works:
            try:
                w.wait()
            except Exception as e:  # one timed out: gloo closes the pairs, so the others fail at once
                errors.append(str(e))
        if errors:  # every distinct cause, the timeout among them, whichever work reported first
            raise RuntimeError("; ".join(dict.fromkeys(errors)))


def _gloo_all_gather(full: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup, world: int) -> _AllOf:
    """Copy ``shard`` into its slice of ``full``, then broadcast every rank's slice from that rank, in
    place: each rank's shard lands straight in the others' buffers."""
    group = group if group is not None else dist.group.WORLD
    rank, n, flat = dist.get_rank(group), shard.numel(), full.view(-1)
    flat[rank * n:(rank + 1) * n].copy_(shard.reshape(-1))
    return _AllOf([dist.broadcast(flat[r * n:(r + 1) * n], dist.get_global_rank(group, r), group=group,
                                  async_op=True) for r in range(world)])


def all_gather(full: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup, *, label: str) -> Pending:
    """Gather every rank's ``shard`` into ``full`` (``world * shard.numel()`` elements, rank-major)."""
    world = _check_even("all_gather", label, group, full, shard)
    if _gloo_carries(full, group) and full.is_contiguous() and shard.is_contiguous():
        return _issue("all_gather", label, group, full, lambda: _gloo_all_gather(full, shard, group, world))
    return _issue("all_gather", label, group, full,
                  lambda: all_gather_flat(full, shard, group=group, async_op=True))


def reduce_scatter(shard: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup, *,
                   label: str) -> Pending:
    """Sum ``full`` over ranks and write this rank's slice into ``shard``."""
    world = _check_even("reduce_scatter", label, group, full, shard)
    if not _gloo_carries(full, group):
        return _issue("reduce_scatter", label, group, full, lambda: reduce_scatter_flat(
            shard, full, op=dist.ReduceOp.SUM, group=group, async_op=True))
    chunks = torch.empty((world, shard.numel()), dtype=full.dtype, device=full.device)
    return _issue("reduce_scatter", label, group, full,
                  lambda: dist.all_to_all_single(chunks.view(-1), full, group=group, async_op=True),
                  then=lambda: torch.sum(chunks, 0, out=shard))


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup, *, label: str,
               op: dist.ReduceOp = dist.ReduceOp.SUM) -> Pending:
    """Reduce ``tensor`` in place over ``group`` (sum by default; HSDP: across replicas, after the
    reduce-scatter)."""
    return _issue("all_reduce", label, group, tensor,
                  lambda: dist.all_reduce(tensor, op=op, group=group, async_op=True))


def all_to_all(out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int],
               group: dist.ProcessGroup, *, label: str) -> Pending:
    """Send ``inp``'s ``in_splits[d]`` elements to rank ``d``; receive ``out_splits[s]`` from rank ``s``
    into ``out`` (rank-major). ``label`` names what moves (a unit, a redistribution, a Muon bucket)."""
    return _issue("all_to_all", label, group, out,
                  lambda: dist.all_to_all_single(out, inp, out_splits, in_splits, group=group, async_op=True))
