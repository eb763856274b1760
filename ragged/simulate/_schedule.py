"""One training step as two in-order streams, compute and communication, with dependencies between them.

FSDP's step, as FSDP2 and ours run it (``reshard_after_forward=True``, prefetch of one unit):

- forward, unit ``i`` in model order: all-gather ``i`` (comm) then forward ``i`` (compute). The
  all-gather of ``i`` may start once the forward of ``i - 2`` has ended: two unsharded units at a time
  (the one running and the one prefetched), as the memory plan counts;
- backward, units in reverse: all-gather ``i`` again (not the last unit, which stays gathered from its
  forward, as FSDP2 leaves the root and torchtitan the last layer unresharded), backward ``i``, then
  reduce-scatter ``i`` (and the HSDP all-reduce) once its gradient exists. The comm stream runs the
  prefetched all-gather of ``i - 1`` before the reduce-scatter of ``i``, as FSDP2 issues them; the
  all-gather of ``i`` waits for the backward of ``i + 2``;
- the optimizer step runs after the last reduction.

All collectives share one communication stream: all-gather and reduce-scatter on separate NCCL streams
would share the same links, so serialising them is the bandwidth-faithful approximation. A copy that
FSDP2 runs on the compute stream (copy-out after an all-gather) delays compute; its copies around the
reduce-scatter run on the communication stream. HBM contention between streams is not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ragged import RaggedError

COMPUTE, COMM = "compute", "comm"


@dataclass
class Op:
    """One interval of work on one stream; ``deps`` are indices of ops that must end first."""

    stream: str
    kind: str
    unit: str
    phase: str
    seconds: float
    deps: list[int] = field(default_factory=list)
    start: float = 0.0

    @property
    def end(self) -> float:
        return self.start + self.seconds


@dataclass(frozen=True)
class UnitTimes:
    """Seconds of each piece of one unit's step (zero where a method has no such piece)."""

    name: str
    all_gather: float
    reduce_scatter: float
    all_reduce: float
    ag_copy_in: float
    ag_copy_out: float
    rs_copy_in: float
    rs_copy_out: float
    forward: float
    backward: float


def build_step(units: list[UnitTimes], optimizer: float) -> list[Op]:
    """The ops of one step in issue order (see the module docstring); start times are not set yet."""
    ops: list[Op] = []

    def add(stream: str, kind: str, u: UnitTimes, phase: str, seconds: float, deps: list[int]) -> int:
        ops.append(Op(stream, kind, u.name, phase, seconds, deps))
        return len(ops) - 1

    k = len(units)
    fwd: list[int] = []
    for i, u in enumerate(units):
        free = [fwd[i - 2]] if i >= 2 else []
        ci = add(COMM, "copy_in", u, "forward", u.ag_copy_in, free)
        ag = add(COMM, "all_gather", u, "forward", u.all_gather, [ci])
        co = add(COMPUTE, "copy_out", u, "forward", u.ag_copy_out, [ag])
        fwd.append(add(COMPUTE, "forward", u, "forward", u.forward, [co]))
    bwd: dict[int, int] = {}
    gathered: dict[int, int] = {}

    def gather(i: int) -> None:
        free = [bwd[i + 2]] if i + 2 < k else [fwd[-1]]
        ci = add(COMM, "copy_in", units[i], "backward", units[i].ag_copy_in, free)
        gathered[i] = add(COMM, "all_gather", units[i], "backward", units[i].all_gather, [ci])

    reductions: list[int] = []
    for i in range(k - 1, -1, -1):
        u = units[i]
        if i == k - 1:  # still gathered from its forward
            bwd[i] = add(COMPUTE, "backward", u, "backward", u.backward, [fwd[-1]])
        else:
            co = add(COMPUTE, "copy_out", u, "backward", u.ag_copy_out, [gathered[i]])
            bwd[i] = add(COMPUTE, "backward", u, "backward", u.backward, [co])
        if i >= 1:
            gather(i - 1)  # prefetched before this unit's reduce-scatter
        ci = add(COMM, "copy_in", u, "backward", u.rs_copy_in, [bwd[i]])
        rs = add(COMM, "reduce_scatter", u, "backward", u.reduce_scatter, [ci])
        ar = add(COMM, "all_reduce", u, "backward", u.all_reduce, [rs])
        reductions.append(add(COMM, "copy_out", u, "backward", u.rs_copy_out, [ar]))
    add(COMPUTE, "optimizer", UnitTimes("step", *[0.0] * 9), "optimizer", optimizer, reductions)
    return ops


def schedule(ops: list[Op]) -> float:
    """Set every op's start (each stream in issue order, each op after its deps); returns the step time.

    Raises:
        RaggedError: the dependencies cannot be met in stream order (a bug in ``build_step``).
    """
    queues = {COMPUTE: [i for i, o in enumerate(ops) if o.stream == COMPUTE],
              COMM: [i for i, o in enumerate(ops) if o.stream == COMM]}
    heads = dict.fromkeys(queues, 0)
    free = dict.fromkeys(queues, 0.0)
    done: set[int] = set()
    while len(done) < len(ops):
        progressed = False
        for stream, queue in queues.items():
            while heads[stream] < len(queue):
                op = ops[queue[heads[stream]]]
                if not all(d in done for d in op.deps):
                    break
                op.start = max([free[stream], *(ops[d].end for d in op.deps)])
                free[stream] = op.end
                done.add(queue[heads[stream]])
                heads[stream] += 1
                progressed = True
        if not progressed:
            raise RaggedError("simulate: the step's streams wait on each other (deadlock in the schedule)")
    return max(o.end for o in ops)
