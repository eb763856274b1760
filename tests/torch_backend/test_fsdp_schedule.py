"""``fsdp/_schedule.py`` on its own: the collectives it issues do not depend on which units a rank calls.

Fake units record what would be gathered; "ranks" are call sequences that skip different units (a
routed expert sharded as its own unit), apply one twice at once, run two forwards, or give different
units a gradient in backward. Every rank must issue the same all-gathers in the same order and get the
same backward and reduce order, against a brute-force statement of the rule: each forward pass gathers
every unit once in schedule order.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from torch_backend.fsdp._schedule import Schedule

N = 5  # units; unit 0 is the root's (kept unsharded after forward)


class FakeUnit:
    def __init__(self, name: str, log: list, reduces: list) -> None:
        self.name, self.log, self.reduces = name, log, reduces
        self.unsharded = False
        self.trains = True
        self.will_reduce = True

    @property
    def needs_gather(self) -> bool:
        return not self.unsharded

    def unshard(self, async_op: bool = False, after=None) -> None:
        if not self.unsharded:
            self.log.append((self.name, after))
            self.unsharded = True

    def reshard(self) -> None:
        self.unsharded = False

    def reduce_gradients(self) -> bool:
        self.reduces.append(self.name)
        return False  # nothing left to finish


class FakeState:
    def __init__(self, i: int, log: list, reduces: list | None = None) -> None:
        self.unit = FakeUnit(f"u{i}", log, reduces if reduces is not None else [])
        self.is_root = i == 0
        self.unshard_in_backward = True
        self.needs_backward = True
        self.backward_done = False

    def stand_in(self) -> None:  # reshard_after_forward: every unit but the root
        if not self.is_root:
            self.unit.reshard()


def one_rank(calls: list[list[int]], backward: list[int], event=None) -> tuple[list, list, list]:
    """Run forwards calling ``calls`` (one list per forward), then a backward reaching ``backward``;
    return the gathers issued, the backward order and the reduce-scatters issued."""
    log: list = []
    reduces: list = []
    states = [FakeState(i, log, reduces) for i in range(N)]
    schedule = Schedule(states)
    schedule.post_optim_event = event
    for forward in calls:
        schedule.end_forward()  # what the root's forward does to a pass in progress
        for i in forward:
            schedule.forward(states[i], None)
            schedule.forward_done(states[i])
    schedule.begin_backward()
    schedule.begin_reduces()
    for i in backward:
        schedule.backward_gather(states[i], None)
        states[i].unit.reshard()  # its backward is over
        states[i].backward_done = True
        schedule.reduce_ready()
    schedule.end_backward()
    return log, [s.unit.name for s in schedule.backward], reduces


def routed_calls(skips: list[bool], twice: list[bool]) -> list[int]:
    """One forward: the root, then every other unit unless skipped, some applied twice at once."""
    calls = [0]
    for i in range(1, N):
        if not skips[i - 1]:
            calls += [i, i] if twice[i - 1] else [i]
    return calls


flags = st.lists(st.booleans(), min_size=N - 1, max_size=N - 1)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(ranks=st.lists(st.tuples(flags, flags, st.permutations(range(N))), min_size=2, max_size=4),
       forwards=st.integers(1, 2))
def test_every_rank_issues_the_same_gathers_whatever_it_calls(ranks, forwards):
    results = [one_rank([routed_calls(skips, twice)] * forwards, list(order))
               for skips, twice, order in ranks]
    gathers, backward, reduces = results[0]
    for other in results[1:]:
        assert other == results[0]
    # Brute force: each forward pass gathers every unit once, in order; the root stays unsharded, so
    # a second pass gathers the others only; backward regathers every unit but the root.
    forward_gathers = [f"u{i}" for i in range(N)] + [f"u{i}" for i in range(1, N)] * (forwards - 1)
    assert [name for name, _ in gathers] == forward_gathers + [f"u{i}" for i in reversed(range(1, N))]
    assert backward == reduces == [f"u{i}" for i in reversed(range(N))]


def test_the_post_optimizer_event_orders_the_first_gather_the_step_issues():
    """Even when the first unit called is not the first gathered (a skipped unit ahead of it), the
    step's first all-gather, and only it, waits for the event (the all-gather stream runs in order)."""
    event = object()
    gathers, _, _ = one_rank([[2]], [], event)
    assert [after for _, after in gathers] == [event] + [None] * (len(gathers) - 1)
    assert gathers[0][0] == "u0"


def test_a_step_every_rank_ran_alike_teaches_the_call_order():
    """Units called in another order than registered: the first step gathers ahead of their turn;
    once learned, each unit is gathered when its forward comes, and none early."""
    log: list = []
    states = [FakeState(i, log) for i in range(N)]
    schedule = Schedule(states)
    calls = [0, 3, 1, 4, 2]
    for i in calls:
        schedule.forward(states[i], [])  # no prefetch: gathers come from the schedule alone
        schedule.forward_done(states[i])
    assert [name for name, _ in log] == ["u0", "u1", "u2", "u3", "u4"]  # taken in registration order
    schedule.learn()
    schedule.new_step()
    for s in states:
        s.unit.reshard()
    log.clear()
    for i in calls:
        schedule.forward(states[i], [])
        assert log[-1][0] == f"u{i}"  # gathered at its own forward
        schedule.forward_done(states[i])


class ReducingUnit:
    """A unit whose reduce-scatter completes when the test says; advancing it issues HSDP's all-reduce
    (logged), which completes at once."""

    def __init__(self, index: int, issued: list) -> None:
        self.index, self.issued = index, issued
        self.reduce_scatter_done = False
        self.reduce_scatter_running = True

    def try_finish_reduce(self) -> bool:
        if self.reduce_scatter_running:
            if not self.reduce_scatter_done:
                return False
            self.reduce_scatter_running = False
            self.issued.append(self.index)
        return True


@settings(max_examples=60, deadline=None, derandomize=True)
@given(completions=st.permutations(range(N)), checks=st.lists(st.integers(0, N), min_size=N, max_size=N))
def test_replica_all_reduces_are_issued_in_reduce_order_whatever_completes_first(completions, checks):
    """A rank's reduce-scatters complete in any order (``completions``, with ``checks[i]`` later reduces
    checking in between); the all-reduces over the replicas must still be issued in reduce order, as on
    every other rank, or two units' all-reduces would pair across the replicas."""
    from torch_backend.fsdp._schedule import advance_in_order

    issued: list = []
    units = [ReducingUnit(i, issued) for i in range(N)]
    reducing = list(units)
    for done, n in zip(completions, checks):
        units[done].reduce_scatter_done = True
        for _ in range(n):
            reducing = advance_in_order(reducing)
    for unit in reducing:  # the end of backward finishes the rest in order
        assert unit.try_finish_reduce()
    assert issued == list(range(N))
