"""gloo's flat-buffer reduce-scatter and all-gather against those of ``torch_backend.collectives``.

torch's ``reduce_scatter_tensor`` on gloo clones the whole buffer, all-reduces all of it and copies this
rank's slice out; ``torch_backend.collectives.reduce_scatter`` sends chunk ``d`` to rank ``d`` with one
``all_to_all_single`` and sums the chunks it receives. torch's ``all_gather_into_tensor`` on gloo gathers
into a temporary of the whole buffer and copies it out; ``torch_backend.collectives.all_gather`` is one
broadcast per rank from that rank's slice of the output, in place. All are timed here on the same
buffers, in alternation (each round runs every collective once after a barrier), with ``all_reduce`` of
the same buffer for scale, at the sizes of the units of ``experiments.torch_vs_fsdp2``'s llama (a block,
the embedding); each gathered buffer is allocated afresh, as a unit's is at every unshard. The results
must agree: both all-gathers bit for bit, both reduce-scatters in float64 within the rounding of a
``world``-term sum.

    python -m experiments.gloo_collectives   # writes experiments/results/gloo_collectives.{json,md}
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from experiments._distributed import rendezvous, spawn_ranks
from torch_backend.collectives import all_gather, reduce_scatter

RESULTS = Path(__file__).parent / "results"
SIZES = (705_536, 2_098_176)  # elements of a block and of the embedding unit, 4 ranks (torch_vs_fsdp2)


def _ops(n: int, world: int, full: torch.Tensor) -> dict:
    """The collectives timed, over buffers of ``n`` elements made once."""
    shard, reduced = torch.empty(n // world), full.clone()
    return {
        "torch reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(shard, full),
        "ours reduce_scatter (all_to_all + sum)": lambda: reduce_scatter(shard, full, None, label="b").wait(),
        "torch all_reduce": lambda: dist.all_reduce(reduced),
        "torch all_gather_into_tensor": lambda: dist.all_gather_into_tensor(torch.empty(n), shard),
        "ours all_gather (broadcasts)": lambda: all_gather(torch.empty(n), shard, None, label="g").wait(),
    }


def _agreement(n: int, world: int, full: torch.Tensor) -> dict:
    """Both reduce-scatters of ``full`` in float64: their largest difference and the rounding bound of a
    ``world``-term sum (eps * world * the sum of the terms' magnitudes)."""
    exact = full.double()
    theirs, ours = (torch.empty(n // world, dtype=torch.float64) for _ in range(2))
    dist.reduce_scatter_tensor(theirs, exact)
    reduce_scatter(ours, exact, None, label="check").wait()
    magnitude = exact.abs()
    dist.all_reduce(magnitude)
    gathered = [torch.empty(n, dtype=torch.float64) for _ in range(2)]
    dist.all_gather_into_tensor(gathered[0], theirs)
    all_gather(gathered[1], theirs, None, label="check").wait()
    return {"max_abs_diff": (ours - theirs).abs().max().item(),
            "bound": torch.finfo(torch.float64).eps * world * magnitude.max().item(),
            "gathers_equal": torch.equal(*gathered)}


def _worker(rank: int, workdir: str, world: int, rounds: int) -> dict:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=rendezvous(workdir), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    out = {}
    for n in SIZES:
        full = torch.randn(n, generator=torch.Generator().manual_seed(rank))
        ops = _ops(n, world, full)
        times = {k: [] for k in ops}
        for r in range(rounds):
            for k, op in ops.items():
                dist.barrier()
                t0 = time.perf_counter()
                op()
                if r:  # the first round is warm-up
                    times[k].append(time.perf_counter() - t0)
        medians = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        out[n] = {"median_ms": medians} | _agreement(n, world, full)
    dist.destroy_process_group()
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--rounds", type=int, default=21)
    p.add_argument("--out", default=str(RESULTS / "gloo_collectives"))
    args = p.parse_args(argv)
    load = os.getloadavg()
    ranks = spawn_ranks(args.world, _worker, args.world, args.rounds)
    result = {"world": args.world, "rounds": args.rounds, "torch": torch.__version__,
              "load_before": load, "load_after": os.getloadavg(), "cpus": os.cpu_count(), "rank0": ranks[0]}
    for r in ranks:
        for n, row in r.items():
            assert row["max_abs_diff"] <= row["bound"] and row["gathers_equal"], (n, row)
    lines = [f"# gloo reduce-scatter and all-gather: torch's against ours ({args.world} processes, fp32, "
             f"median of {args.rounds - 1} alternating rounds, rank 0)", "",
             f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average {load[0]:.1f} before and "
             f"{result['load_after'][0]:.1f} after. Results agree in float64 on every rank (the "
             "reduce-scatters within the rounding of a sum of world terms, the all-gathers bit for bit).", "",
             "| elements | " + " | ".join(ranks[0][SIZES[0]]["median_ms"]) + " |",
             "|---|" + "---|" * len(ranks[0][SIZES[0]]["median_ms"])]
    for n, row in ranks[0].items():
        lines.append(f"| {n:,} | " + " | ".join(f"{v:.1f} ms" for v in row["median_ms"].values()) + " |")
    for n, row in ranks[0].items():
        ms = row["median_ms"]
        theirs = ms["torch reduce_scatter_tensor"]
        ratio = ms["ours reduce_scatter (all_to_all + sum)"] / theirs
        over_all_reduce = theirs / ms["torch all_reduce"]
        gather = ms["ours all_gather (broadcasts)"] / ms["torch all_gather_into_tensor"]
        lines.append(f"\n{n:,} elements: ours / torch's reduce-scatter **{ratio:.2f}**, all-gather "
                     f"**{gather:.2f}**; torch's reduce-scatter / its all-reduce of the same buffer "
                     f"{over_all_reduce:.2f}.")
    Path(f"{args.out}.json").write_text(json.dumps(result, indent=1) + "\n")
    Path(f"{args.out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
