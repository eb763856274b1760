"""The root's per-step bookkeeping: when a step begins and ends, and what the end of backward does.

The root is the outermost unit, found at the first forward. Its ``RootContext`` holds the ``Schedule``
of every unit under it (fsdp/_schedule.py: which collective comes next), queues the end-of-backward
callback that finishes the reduces and gives out the gradients, and resets a step that raised.

One all-reduce per mesh at the end of backward tells every rank which parameters got a gradient on some
rank (those get their ``.grad`` everywhere; one no rank used keeps None, as in single-process training)
and checks every rank issued the same collectives. A step is every forward since the last backward
ended, and that backward: several forwards may precede it.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from torch_backend._collectives import all_reduce
from torch_backend._debug import record_host_sync
from torch_backend._torch_internals import queue_backward_callback
from torch_backend.fsdp._schedule import MISMATCH, Schedule
from torch_backend.fsdp._unit import Unit

if TYPE_CHECKING:
    from torch_backend.fsdp._hooks import FSDPState


def _check_one_unit_per_parameter(tops: tuple[nn.Module, ...], states: list[FSDPState]) -> None:
    """FSDP2's rule: a tied parameter belongs to one unit, the lowest one containing all of its uses.

    Two units that took the same parameter (its uses sit in sibling units, or below and above a unit
    boundary) would each train their own copy and silently untie it.
    """
    fqns = {id(m): name for top in tops for name, m in top.named_modules(remove_duplicate=False)}
    owner: dict[int, str] = {}
    for s in states:
        if s.unit is None:
            continue
        for ref, orig in zip(s.unit.refs, s.unit.original_uids):
            fqn = f"{fqns.get(id(ref.module), '?')}.{ref.attr}".lstrip(".")
            if orig in owner:
                first = owner[orig]
                a, b = first.rsplit(".", 1)[0], fqn.rsplit(".", 1)[0]
                raise ValueError(
                    f"fully_shard: parameter {fqn!r} is the same tensor as {first!r}, which another unit "
                    f"already manages; tied parameters belong to one unit: shard the modules that use it "
                    f"together, e.g. fully_shard([model.{a}, model.{b}]), or leave them to a common parent")
            owner[orig] = fqn


# Per default process group: {shard ranks: the reduce-scatters' group}, made once for every model.
_REDUCE_GROUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def reduce_scatter_groups(shard_groups: list[dist.ProcessGroup]) -> dict[tuple[int, ...], dist.ProcessGroup]:
    """A process group of their own for the reduce-scatters of each set of shard ranks.

    A rank issues each reduce-scatter when its unit's backward is over, which may come before or after
    another rank's next all-gather; on separate groups the two orders never meet. Every rank calls
    ``new_group`` for every set any rank needs, in one order (one ``all_gather_object`` tells them
    the sets; under expert parallelism each rank knows only its own), so the groups get the global
    counter's names, never a name an earlier group of the same ranks had (``use_local_synchronization``
    hashes the ranks: a second model's group would meet the first one's rendezvous keys).
    """
    made = _REDUCE_GROUPS.setdefault(dist.group.WORLD, {})
    mine = sorted({tuple(dist.get_process_group_ranks(g)) for g in shard_groups})
    if all(ranks in made for ranks in mine):  # every rank runs the same models: all agree on this
        return made
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    for ranks in sorted(set().union(*map(tuple, everyone)) - set(made)):
        made[ranks] = dist.new_group(list(ranks))
    return made


class RootContext:
    """Bookkeeping shared by every unit under the root: the schedule, the step, CUDA streams."""

    def __init__(self, state: FSDPState, states: list[FSDPState]) -> None:
        self.state = state
        self.states = states
        _check_one_unit_per_parameter(state.modules, self.states)
        self.schedule = Schedule(self.states)
        self.step_open = False  # a forward ran since the last backward ended
        self.in_backward = False
        # A backward with create_graph=True ran this step (double backward): the step's backward then also
        # runs the graph it built, whose gradients may land after a unit's inputs are done, so every unit
        # stays unsharded and is reduced at the end of that backward, in the usual order.
        self.defer_reduces = False
        units = [s.unit for s in self.states if s.unit is not None]
        device = units[0].device if units else None
        cuda = device is not None and device.type == "cuda"
        streams = (torch.cuda.Stream(device), torch.cuda.Stream(device)) if cuda else (None, None)
        groups = reduce_scatter_groups([u.shard_group for u in units])
        for unit in units:
            if unit.reduce_group is unit.shard_group:
                unit.reduce_group = groups[tuple(dist.get_process_group_ranks(unit.shard_group))]
        for s in self.states:
            s.root = self
            if s.unit is not None:
                s.unit.ag_stream, s.unit.rs_stream = streams

    def begin_forward(self) -> None:
        """The root's forward starts: the first of a step begins the step; a later one joins it and
        starts the schedule's next pass (on every rank alike, whichever units the last one called)."""
        if self.in_backward:
            return
        if self.step_open:
            self.schedule.end_forward()
            return
        self.step_open = True
        for s in self.states:
            if s.unit is not None:
                s.unit.release_unused_gradients()  # zero_grad(set_to_none=True) ran since the last step

    def begin_graph_backward(self) -> None:
        """A backward that builds a graph (``autograd.grad(..., create_graph=True)``) starts.

        It only unshards (its graph keeps the unsharded parameters): no reduce, no reshard, no gradient
        given out; the units stay unsharded until the end of the step's backward.
        """
        if not self.in_backward:
            self.in_backward = True
            self.defer_reduces = True
            self.schedule.begin_backward()
            queue_backward_callback(self._end_graph_backward)

    def _end_graph_backward(self) -> None:
        self.in_backward = False
        self.schedule.end_backward()
        for s in self.states:  # the step's backward runs every unit's pre-backward again
            s.backward_started = False

    def begin_backward(self) -> None:
        if not self.in_backward:
            self.in_backward = True
            self.schedule.begin_backward()
            self.schedule.begin_reduces()
            queue_backward_callback(self.end_backward)

    def end_backward(self) -> None:
        """The end-of-backward callback: reduce the units left in order, finish, give out the gradients,
        reshard every unit but those told to stay unsharded (``set_reshard_after_backward(False)``)."""
        schedule = self.schedule
        schedule.end_backward()
        schedule.finish_reduces()
        offloaded = next((u.device for u in schedule.reduced if u.offload and u.device.type != "cpu"), None)
        if offloaded is not None:  # the asynchronous copies of the gradients to pinned host memory
            torch.get_device_module(offloaded).current_stream(offloaded).synchronize()
            record_host_sync("offloaded gradients")
        try:
            self._give_gradients()
        except RuntimeError:
            self.reset()
            raise
        for s in self.states:
            if s.unit is not None and s.unit.reshard_after_backward:
                s.unit.reshard()
        self._forget_step()

    def _give_gradients(self) -> None:
        """One MAX all-reduce per mesh of the reduced units' landed masks and of the schedule's codes,
        then the ``.grad`` views (or, where the ranks' collectives differed, the same error on all)."""
        reduced = self.schedule.reduced
        by_groups: dict[tuple, list[Unit]] = {}
        for unit in reduced:
            by_groups.setdefault((unit.shard_group, unit.replicate_group), []).append(unit)
        collectives, calls = self.schedule.codes()
        same_calls = True
        masks = []
        for (shard_group, replicate_group), units in by_groups.items():
            sizes = [len(u.refs) for u in units]
            seen = torch.zeros(sum(sizes) + 4, dtype=torch.int64, device=units[0].device)
            for u, part in zip(units, seen.split(sizes + [4])):  # each unit writes its view: no concatenation
                u.landed_mask(part)
            for i, code in enumerate((collectives, -collectives, calls, -calls), start=len(seen) - 4):
                seen[i].fill_(code)  # a fill: ``seen[i] = code`` would copy from a host scalar tensor
            for group in (shard_group, replicate_group):
                if group is not None:
                    all_reduce(seen, group, label="landed gradients", op=dist.ReduceOp.MAX).wait()
            record_host_sync("landed gradients")
            values = seen.tolist()  # the step's one read of the device per mesh
            high, low, calls_high, calls_low = values[-4:]
            if high != -low:
                raise RuntimeError("fully_shard: at the end of backward, the ranks' collectives of this step "
                                   f"differ; no gradient was given out. {MISMATCH}")
            same_calls = same_calls and calls_high == -calls_low
            masks.append((units, values[:-4], sizes))
        if masks and same_calls:
            self.schedule.learn()
        for units, used, sizes in masks:
            start = 0
            for u, n in zip(units, sizes):
                u.end_backward(used[start:start + n])
                start += n
        for s in self.states:
            if s.unit is not None and s.unit not in reduced:
                s.unit.end_backward(None)

    def reset(self) -> None:
        """``reset_iter_state``: after a forward or backward raised, forget the step and reshard.

        Waits for issued collectives (their errors are dropped: the step is discarded anyway), drops
        every gradient of the failed step, including unsynced accumulation and HSDP partial sums.
        """
        for s in self.states:
            if s.unit is not None:
                s.unit.discard_step()
            s.modules_left = 0
        self._forget_step()

    def _forget_step(self) -> None:
        """The step is over (its backward ended, or it raised): the next forward begins a new one."""
        for s in self.states:
            s.clear_backward()
        self.in_backward = self.defer_reduces = self.step_open = False
        self.schedule.new_step()
