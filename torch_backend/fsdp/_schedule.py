"""The order every rank gathers its units in, whatever its data: one schedule per root, no agreement.

An all-gather pairs with the same all-gather on every other rank of its group, so ranks must issue
their gathers in one order. A rank's calls may differ from another's (routing skips a unit's forward,
or gives it no gradient in backward), so the gathers follow a schedule, not the calls:

- forward: passes over ``order`` (the units, one entry each, the order learned from a step every rank
  ran alike; registration order before). A unit's forward gathers every entry from the cursor up to
  its own; entries passed over are gathered ahead (prefetch works the same way) and, if their forward
  never comes in this pass, stood in for: resharded as their forward would have, counted as trained.
  Each forward of the root, and a unit called again after other units ran, starts the next pass (a
  unit called again at once is still unsharded: it reshards at the next unit's forward); the pass in
  progress is completed when backward starts.
- backward: one pass over the units trained this step in reverse (first calls last). A unit's backward
  (or a recomputation in it) gathers every entry from the cursor up to its own; the entries left are
  gathered at the end of backward.
- reduce-scatters: the same reverse order, on a process group of their own (so when each is issued
  relative to the all-gathers does not matter); each is issued when its unit's backward is over here
  and every unit before it in that order has issued its own, or at the end of backward with zeros
  where no gradient came. Issued reduces are finished in that order too (HSDP's all-reduces over the
  replicas follow them), never waited for before the end of backward.

What no schedule can absorb, a unit called a data-dependent number of times on some ranks, shows at the
end of the step: every rank folds a fingerprint of what it gathered and reduced into the one landed-
gradient all-reduce, and all raise the same error before any gradient is given out (the same all-reduce
tells whether every rank called its units in one order: the schedule then learns it). Set
``RAGGED_FSDP_CHECK_EVENTS=1`` to check every all-gather before it is issued as well (a debug mode:
one blocking all-reduce each), which stops such a step at its first mismatched all-gather.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from torch_backend._collectives import all_reduce
from torch_backend._debug import record_host_sync

if TYPE_CHECKING:
    from torch_backend.fsdp._hooks import FSDPState
    from torch_backend.fsdp._unit import Unit

CHECK_EVENTS = os.environ.get("RAGGED_FSDP_CHECK_EVENTS", "0") != "0"
_GATHER, _REDUCE = 1, 2
_MOD = (1 << 61) - 1  # fingerprints are kept below 2**61 so that their negation fits an int64


class Schedule:
    """The gathers and reduce-scatters of one root's units, in an order that does not depend on data.

    The hooks say when a unit needs its parameters (``forward``, ``backward_gather``) and when its
    backward is over (``reduce_ready``); the schedule decides which collectives that issues.
    """

    def __init__(self, states: Sequence[FSDPState]) -> None:
        self.states = [s for s in states if s.unit is not None]
        self.order: list[FSDPState] = list(self.states)  # one forward pass
        self.post_optim_event: torch.Event | None = None  # set_post_optim_event: the next gather waits on it
        self.new_step()

    def new_step(self) -> None:
        self.pos = 0  # the pass's next entry
        self.ahead: dict[FSDPState, None] = {}  # taken in this pass, their forward not come yet (in order)
        self.done: list[FSDPState] = []  # their forward ended, not resharded yet
        self.trained: list[FSDPState] = []  # taken with grad this step, in the order taken
        self.observed: list[int] = []  # this rank's forward calls, to learn the order from
        self.backward: list[FSDPState] = []  # this step's backward gathers and reduce-scatters, in order
        self.bpos = 0
        self.met: set[FSDPState] = set()  # backward entries met by the cursor or by their own backward
        self.fingerprints = {_GATHER: 0, _REDUCE: 0}  # what this rank gathered, and reduced, in order
        self.to_reduce: list[FSDPState] = []  # this backward's reduce order, not issued yet
        self.reducing: list[Unit] = []  # issued, not finished (in reduce order)
        self.reduced: list[Unit] = []  # reduced this step: their gradients are given out at its end

    # ----- forward ---------------------------------------------------------------------------------
    def forward(self, state: FSDPState, targets: list[FSDPState] | None) -> None:
        """``state``'s forward starts: gather the schedule up to it (waits for its own), then prefetch
        ``targets`` (None: the next entry) by gathering the schedule up to them."""
        if len(self.observed) <= 4 * len(self.order):  # more is not a training step's order
            self.observed.append(self.states.index(state))
        again = state in self.done  # called again at once (a layer applied twice): still unsharded
        if again:
            self.done.remove(state)
        self.reshard_done()
        if not again and state not in self.ahead:
            j = self._next(state)
            if j is None:  # a second call: the next pass
                self.end_forward()
                j = self.order.index(state)
            self._take(j + 1)
        self.ahead.pop(state, None)
        state.unit.unshard()  # waits for its gather
        for t in targets if targets is not None else self.order[self.pos:self.pos + 1]:
            j = self._next(t) if t.unit is not None else None
            if j is not None:
                self._take(j + 1)

    def forward_done(self, state: FSDPState) -> None:
        """``state``'s forward ended: it reshards at the next unit's forward (or when the root's forward
        ends), so that a unit called again at once, on some ranks only, needs no gather the others lack."""
        self.done.append(state)

    def reshard_done(self) -> None:
        """Reshard the units whose forward ended (the next unit's forward, the end of the root's)."""
        for s in self.done:
            s.stand_in()
        self.done = []

    def _next(self, state: FSDPState) -> int | None:
        """The index of ``state``'s entry at or after the cursor (None: it had its turn in this pass)."""
        return next((i for i in range(self.pos, len(self.order)) if self.order[i] is state), None)

    def _take(self, stop: int) -> None:
        """Gather the pass's entries up to ``stop`` (every rank takes them in this order, whatever it
        calls): they are ahead of their forward until it comes or the pass ends. Taken with grad, a unit
        trains this step: the backward order is the order taken, reversed."""
        grad = torch.is_grad_enabled()
        for s in self.order[self.pos:stop]:
            self._gather(s, async_op=True)
            self.ahead[s] = None
            if grad and s not in self.trained:
                self.trained.append(s)
        self.pos = max(self.pos, stop)

    def end_forward(self) -> None:
        """Complete the pass in progress: gather the entries left, stand in for every forward that did
        not come (reshard as it would have)."""
        self.reshard_done()
        if self.pos == 0 and not self.ahead:
            return
        self._take(len(self.order))
        for s in self.ahead:
            s.stand_in()
        self.pos, self.ahead = 0, {}

    def _gather(self, state: FSDPState, async_op: bool = False) -> None:
        unit = state.unit
        after = None
        if unit.needs_gather:
            self._record(_GATHER, state)
            # The first all-gather after the optimizer step waits for its event only (the all-gather
            # stream runs in order, so every later one waits for it too).
            after, self.post_optim_event = self.post_optim_event, None
        unit.unshard(async_op=async_op, after=after)

    # ----- backward --------------------------------------------------------------------------------
    def begin_backward(self) -> None:
        """Complete the forward pass; the backward order is the trained units', reversed."""
        self.end_forward()
        self.backward = list(reversed(self.trained))
        self.bpos = 0
        self.met = set()

    def backward_gather(self, state: FSDPState, targets: list[FSDPState] | None) -> None:
        """``state`` needs its parameters in backward: gather the backward schedule up to it, then
        prefetch ``targets`` (None: the next entry) the same way.

        Each entry is met once, by the cursor or by its own backward, whichever comes first, and
        gathered then if it is sharded: what it is then is what it was when backward started (a unit
        reshards only once its own backward is over), the same on every rank. One kept unsharded (the
        root, whose backward often comes first) takes nothing and moves no cursor.
        """
        if state not in self.met:
            j = self._backward_next(state)
            if state.unshard_in_backward and state.unit.needs_gather:
                if j is None:  # not trained this step
                    self._gather(state)
                else:
                    self._gather_backward(j + 1)
            self.met.add(state)
        if state.unshard_in_backward:
            state.unit.unshard()
        for t in targets if targets is not None else self._unmet(1):
            j = self._backward_next(t)
            if j is not None:
                self._gather_backward(j + 1)

    def _backward_next(self, state: FSDPState) -> int | None:
        """The index of ``state``'s backward entry at or after the cursor (None: none left)."""
        return next((i for i in range(self.bpos, len(self.backward)) if self.backward[i] is state), None)

    def _unmet(self, n: int) -> list[FSDPState]:
        """The next ``n`` backward entries not met yet (the default prefetch)."""
        return [s for s in self.backward[self.bpos:] if s not in self.met][:n]

    def _gather_backward(self, stop: int) -> None:
        for s in self.backward[self.bpos:stop]:
            # Frozen units only where a gradient flows through them (on every rank, but for a frozen
            # unit some ranks skip and others do not: that would show at the end of the step).
            if s not in self.met and s.unshard_in_backward and (s.unit.trains or s.needs_backward):
                self._gather(s, async_op=True)
            self.met.add(s)
        self.bpos = max(self.bpos, stop)

    def end_backward(self) -> None:
        """Gather the backward entries no gradient reached here (another rank's may have), then reduce
        the units whose backward never ended here, in order."""
        self._gather_backward(len(self.backward))
        for s in self.to_reduce:
            s.backward_done = True
            self._reduce(s)
        self.to_reduce = []

    # ----- reduce-scatters -------------------------------------------------------------------------
    def begin_reduces(self) -> None:
        """The step's backward (not one that only builds a graph) reduces the training units in the
        backward order."""
        self.to_reduce = [s for s in self.backward if s.unit.trains]
        self.reduced = []

    def reduce_ready(self) -> None:
        """Issue the reduce-scatters of the units at the head of the order whose backward is over."""
        while self.to_reduce and self.to_reduce[0].backward_done:
            self._reduce(self.to_reduce.pop(0))

    def _reduce(self, state: FSDPState) -> None:
        # Reduces issued before are finished here if they have completed (their unsharded gradients
        # freed before the next reduce needs memory; HSDP's all-reduce issued once the reduce-scatter
        # is done, hidden behind backward). None is waited for before the end of backward: a peer may
        # issue it only then (a unit that got no gradient there) and need this rank's all-gathers first.
        self.reducing = advance_in_order(self.reducing)
        unit = state.unit
        if unit.will_reduce:
            self._record(_REDUCE, state)
        if unit.reduce_gradients():
            self.reducing.append(unit)
            self.reduced.append(unit)

    def finish_reduces(self) -> None:
        """Finish every issued reduce, in order."""
        for unit in self.reducing:
            unit.finish_reduce()
        self.reducing = []

    # ----- checks ----------------------------------------------------------------------------------
    def _record(self, kind: int, state: FSDPState) -> None:
        """Fold the collective about to be issued into the fingerprint of its kind (gathers and
        reduce-scatters apart: when one is issued relative to the other depends on each rank's timing,
        not on the schedule); in debug mode, first check every rank of an all-gather's group is at the
        same one (reduce-scatters are checked by the end of backward's fingerprint)."""
        code = (self.fingerprints[kind] * 1_000_003 + self.states.index(state) + 1) % _MOD
        if CHECK_EVENTS and kind == _GATHER:  # a reduce-scatter's check would wait mid-backward on a
            unit = state.unit                  # peer that issues it only at its end (see ``_reduce``)
            _check(unit.gather_group, code, f"all-gather of {unit.name!r}", unit.device)
        self.fingerprints[kind] = code

    def codes(self) -> tuple[int, int]:
        """(every collective this step issued, this rank's forward calls), each as one number: the first
        must be the same on every rank; where the second is too, the schedule may learn from it."""
        collectives = (self.fingerprints[_GATHER] * 7_919 + self.fingerprints[_REDUCE]) % _MOD
        calls = len(self.observed)
        for i in self.observed:
            calls = (calls * 1_000_003 + i + 1) % _MOD
        return collectives, calls

    def learn(self) -> None:
        """End of a step whose forward calls every rank made alike: when each unit was called once, the
        next steps follow that order (no gathers ahead of their turn); units not called keep their place
        last."""
        seen = [self.states[i] for i in self.observed]
        if seen and len(set(self.observed)) == len(seen):
            self.order = seen + [s for s in self.order if s not in seen]


def advance_in_order(reducing: list[Unit]) -> list[Unit]:
    """Finish the issued reduces that have completed, in reduce order; returns those left.

    Past the first unit whose reduce-scatter is still running nothing advances: advancing issues HSDP's
    all-reduce over the replicas, and those must be issued in one order on every rank. A later unit's
    reduce-scatter may complete first on one rank and not on another; advancing it past an earlier one
    would pair the two units' all-reduces across the replicas (silently, where their sizes match).
    """
    left, blocked = [], False
    for unit in reducing:
        if blocked or not unit.try_finish_reduce():
            left.append(unit)
            blocked = blocked or unit.reduce_scatter_running
    return left


def _check(group: dist.ProcessGroup, code: int, what: str, device: torch.device) -> None:
    """Debug mode: raise on every rank of ``group`` unless every one has the same ``code`` (the history
    of its collectives of this kind, the next one included)."""
    seen = torch.tensor([code, -code], dtype=torch.int64, device=device)
    all_reduce(seen, group, label="check", op=dist.ReduceOp.MAX).wait()
    record_host_sync("check")
    high, low = seen.tolist()
    if high != -low:
        raise RuntimeError(f"fully_shard: the ranks disagree on the collective they issue next (this rank: "
                           f"the {what}). {MISMATCH}")


MISMATCH = (
    "Their data took them through different collectives: a unit ran forward a different number of times "
    "on some ranks, or one rank ran a forward or backward the others did not. fully_shard gathers and "
    "reduces in one schedule whatever the routing (a unit skipped on some ranks still takes part, with "
    "zeros), but the number of calls must be the same on every rank: call a unit the same number of "
    "times everywhere (a loop bound every rank shares), or shard a data-dependent loop's body together "
    "with its parent. RAGGED_FSDP_CHECK_EVENTS=1 stops at the first mismatched all-gather.")
