"""``torch_backend.collectives`` on gloo (the all-gather, and the reduce-scatter by an all-to-all and a
local sum) against numpy.

Each rank's buffer is drawn from a generator seeded by its rank, so every rank can rebuild all of them:
the gather must equal their concatenation bit for bit (flat and as a 2-D block, Muon's use); the
reduce-scatter their float64 numpy sum within the rounding of a ``world``-term sum (eps * world * the
sum of the terms' magnitudes), as torch's own gloo reduce-scatter does, a lower precision within its own
eps; gathers in flight at once on a sub-group (one never waited for) each fill their own buffer. Sizes
that do not split into equal shards are refused on every rank before anything is sent.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests.torch_backend._dist import launch, run_cases
from torch_backend import debug_counter
from torch_backend.collectives import all_gather, reduce_scatter

SHARD = 1_001  # odd: chunk boundaries fall anywhere


def _buffer(rank: int, n: int) -> np.ndarray:
    return np.random.default_rng(rank).standard_normal(n)


def _case(rank: int, world: int, dtype: torch.dtype) -> None:
    full = torch.from_numpy(_buffer(rank, world * SHARD)).to(dtype)
    shard = torch.empty(SHARD, dtype=dtype)
    with debug_counter() as counter:
        reduce_scatter(shard, full, dist.group.WORLD, label="case").wait()
    terms = np.stack([torch.from_numpy(_buffer(r, world * SHARD)).to(dtype).double().numpy()
                      for r in range(world)])
    mine = slice(rank * SHARD, (rank + 1) * SHARD)
    want = terms[:, mine].sum(0)
    eps = torch.finfo(dtype).eps
    bound = eps * world * np.abs(terms[:, mine]).sum(0)
    err = np.abs(shard.double().numpy() - want)
    assert (err <= bound).all(), f"{dtype}: worst error {err.max()} over bound {bound[err.argmax()]}"
    assert counter.calls[("reduce_scatter", "case")] == 1
    if dtype == torch.float64:  # torch's gloo reduce-scatter: the same bound from the same reference
        theirs = torch.empty(SHARD, dtype=dtype)
        dist.reduce_scatter_tensor(theirs, full)
        assert (np.abs(theirs.numpy() - want) <= bound).all()


def _gather(rank: int, world: int, dtype: torch.dtype, rows: int) -> None:
    shards = [torch.from_numpy(_buffer(r, rows * SHARD)).to(dtype).view(rows, SHARD)
              for r in range(world)]
    full = torch.full((world * rows, SHARD), float("nan"), dtype=dtype)
    with debug_counter() as counter:
        all_gather(full, shards[rank], dist.group.WORLD, label="case").wait()
    assert torch.equal(full, torch.cat(shards)), f"{dtype}: gathered buffer differs"
    assert counter.calls[("all_gather", "case")] == 1 and counter.copy_bytes == 0


def _gathers_in_flight(rank: int, world: int) -> None:
    """On a sub-group: a gather issued and never waited for (a prefetch whose forward never came), then two
    in flight at once, finished in the reverse order: each buffer holds exactly its own gather."""
    members = list(range(1, world)) if world > 2 else [0, 1]
    group = dist.new_group(members)  # every rank makes it, in the same order
    if rank not in members:
        return
    me, size = members.index(rank), len(members)
    shards = {n: [torch.from_numpy(_buffer(100 * n + r, n)) for r in range(size)]
              for n in (SHARD, 2 * SHARD, 3 * SHARD)}
    fulls = {n: torch.full((size * n,), float("nan"), dtype=torch.float64) for n in shards}
    abandoned = all_gather(fulls[3 * SHARD], shards[3 * SHARD][me], group, label="abandoned")  # noqa: F841
    first = all_gather(fulls[SHARD], shards[SHARD][me], group, label="first")
    second = all_gather(fulls[2 * SHARD], shards[2 * SHARD][me], group, label="second")
    second.wait()
    first.wait()
    for n in (SHARD, 2 * SHARD):
        assert torch.equal(fulls[n], torch.cat(shards[n])), f"the gather of {n} per rank differs"


def _uneven(rank: int, world: int) -> None:
    shard, full = torch.empty(SHARD), torch.empty(world * SHARD + 1)
    for name, call in (("reduce_scatter", lambda: reduce_scatter(shard, full, dist.group.WORLD, label="u")),
                       ("all_gather", lambda: all_gather(full, shard, dist.group.WORLD, label="u"))):
        try:
            call()
        except ValueError as e:
            assert name in str(e) and str(world * SHARD + 1) in str(e), e
        else:
            raise AssertionError(f"{name}: no error")
    dist.barrier()  # every rank got here: nothing was sent


def checks(rank: int, world: int) -> dict:
    cases = {str(dtype): (lambda d=dtype: _case(rank, world, d)) for dtype in
             (torch.float64, torch.float32, torch.bfloat16)}
    for dtype in (torch.float32, torch.bfloat16):
        for rows in (1, 3):
            cases[f"gather {dtype} x{rows}"] = lambda d=dtype, r=rows: _gather(rank, world, d, r)
    cases["in flight"] = lambda: _gathers_in_flight(rank, world)
    cases["uneven"] = lambda: _uneven(rank, world)
    return run_cases(cases)


@pytest.mark.parametrize("world", [2, 3])
def test_gloo_collectives_match_numpy(world):
    results = launch(str(Path(__file__)), "checks", world)
    for rank, res in enumerate(results):
        assert "<worker>" not in res, res["<worker>"]
        failed = {k: v["traceback"] for k, v in res.items() if isinstance(v, dict)}
        assert not failed, f"rank {rank}: {failed}"
