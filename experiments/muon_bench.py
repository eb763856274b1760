"""Distributed Muon against the workarounds users run today and single-process Muon, side by side in one run.

Torch half (``--world-size`` gloo processes, or NCCL with ``--device cuda``): the matrices of a small
llama (``CONFIG``, one unit per layer) are optimized by

- ours, sequential: ``Muon(overlap=False)`` on RaggedShard DTensors (one gather + one scatter per matrix);
- ours, overlapped: ``Muon()`` (NS-device buckets, asynchronous all_to_all overlapping Newton-Schulz);
- the FSDP2 workaround: real ``torch.distributed.fsdp.fully_shard`` (Shard(0) DTensors); every rank
  ``full_tensor()``s every momentum, runs Newton-Schulz on every matrix and slices its rows back;
- single-process Muon on the full tensors (rank 0; the reference for equality).

JAX half (``--jax-devices`` devices of the same platform, in a process of its own because XLA reads its
flags when jax is imported): ``experiments/_muon_bench_jax.py``, ours sequential / overlapped on the FSDP
unit shards in ``shard_map``, the GSPMD workaround (each momentum replicated, Newton-Schulz on every device,
rows sliced back) and single-device Muon; results in ``<out>_jax.{md,json}``.

Each round runs one optimizer step of every variant in turn (same gradients), so machine load hits all
alike; step times are medians over rounds and the ratio is the median of per-round ratios. Bytes are those
each rank receives from other ranks per step (a dispatch meter on the c10d ops). Peak memory on CUDA is
``max_memory_allocated`` during the step; on CPU the whole matrices a rank holds at once (computed).
``--ns-dtype bfloat16`` runs Newton-Schulz in bf16 and reports its error against fp32.

    python -m experiments.muon_bench                                   # 4 gloo processes + 8 JAX host devices
    python -m experiments.muon_bench --device cuda --world-size 1      # one GPU, both stacks
    python -m experiments.muon_bench --stack jax                       # the JAX half only
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

import ragged
import ragged.muon
from experiments._distributed import leave_and_exit, rendezvous
from experiments._muon_case import CONFIG, LR, MOMENTUM, layouts, matrices

RESULTS = Path(__file__).parent / "results"
VARIANTS = ("ours_sequential", "ours_overlapped", "fsdp2_full_tensor", "single_process")


class ReceivedBytes(TorchDispatchMode):
    """Bytes this rank receives from other ranks in c10d collectives (all-gather, all-to-all)."""

    def __init__(self, world: int) -> None:
        super().__init__()
        self.world, self.bytes = world, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func)
        if "all_gather" in name:
            self.bytes += args[0].numel() * args[0].element_size() * (self.world - 1)
        elif "alltoall" in name:
            self.bytes += args[0].numel() * args[0].element_size()
        return out


def _workaround_step(params: list, state: dict, lr: float, mu: float, ns_dtype: torch.dtype) -> None:
    """What FSDP2 users write: full_tensor() of every momentum, Newton-Schulz everywhere, rows sliced back."""
    from torch.distributed.tensor import DTensor

    from torch_backend.optim import newton_schulz

    for p in params:
        grad = p.grad.to_local()
        buf = state.setdefault(p, torch.zeros_like(grad))
        buf.lerp_(grad, 1 - mu)
        update = torch.lerp(grad, buf, mu)
        full = DTensor.from_local(update, p.device_mesh, p.placements, shape=p.shape,
                                  stride=p.stride()).full_tensor()
        ortho = newton_schulz(full, dtype=ns_dtype)
        mine = torch.chunk(ortho, p.device_mesh.size(), dim=0)[p.device_mesh.get_local_rank()]
        local = p.detach().to_local()
        local.add_(mine.reshape(local.shape), alpha=-lr * ragged.muon.muon_scale(tuple(p.shape)))


def _worker(rank: int, world: int, workdir: str, args: argparse.Namespace, out: dict) -> None:
    torch.set_num_threads(args.threads)
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=rendezvous(workdir), rank=rank,
                            world_size=world)
    from torch.distributed import tensor as dtensor
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    from torch_backend import RaggedShard  # (the first RaggedShard installs the DTensor patches)
    from torch_backend.optim import Muon

    device = torch.device(args.device, rank if cuda else 0) if cuda else torch.device("cpu")
    mesh = init_device_mesh(args.device, (world,))
    mats = matrices()
    gen = torch.Generator().manual_seed(0)
    fulls = {n: torch.randn(s, generator=gen).to(device) for n, s in mats}
    grads = [{n: torch.randn(s, generator=gen).to(device) for n, s in mats} for _ in range(args.rounds + 1)]
    where = {t.name: [RaggedShard.from_core(lay.placement(t.name))]
             for lay in layouts(world) for t in lay.tensors}
    kw = dict(lr=LR, momentum=MOMENTUM, ns_dtype=getattr(torch, args.ns_dtype))
    runs = {}
    for overlap, key in ((False, "ours_sequential"), (True, "ours_overlapped")):
        live = {n: torch.nn.Parameter(dtensor.distribute_tensor(t.clone(), mesh, where[n]))
                for n, t in fulls.items()}
        runs[key] = (live, Muon(list(live.items()), overlap=overlap, in_flight=args.in_flight, **kw),
                     lambda n, g: dtensor.distribute_tensor(g, mesh, where[n]))
    linears = torch.nn.ModuleDict({n.replace(".", "_"): torch.nn.Linear(s[1], s[0], bias=False, device=device)
                                   for n, s in mats})
    for (n, _), lin in zip(mats, linears.values()):
        lin.weight.data.copy_(fulls[n])
    for lin in linears.values():
        fsdp2_fully_shard(lin, mesh=mesh)  # per-parameter Shard(0) DTensors
    fsdp_live = {n: lin.weight for (n, _), lin in zip(mats, linears.values())}
    fsdp_state: dict = {}
    single = {n: torch.nn.Parameter(t.clone()) for n, t in fulls.items()}
    single_opt = Muon(list(single.items()), **kw)

    def step(key: str, k: int) -> int:
        meter = ReceivedBytes(world)
        with meter:
            if key in ("ours_sequential", "ours_overlapped"):
                live, opt, place = runs[key]
                for n, p in live.items():
                    p.grad = place(n, grads[k][n])
                opt.step()
            elif key == "fsdp2_full_tensor":
                for n, p in fsdp_live.items():
                    p.grad = dtensor.distribute_tensor(grads[k][n], mesh, [dtensor.Shard(0)])
                _workaround_step(list(fsdp_live.values()), fsdp_state, kw["lr"], kw["momentum"],
                                 kw["ns_dtype"])
            elif rank == 0:
                for n, p in single.items():
                    p.grad = grads[k][n]
                single_opt.step()
        return meter.bytes

    times = {v: [] for v in VARIANTS}
    nbytes, peak = {}, {}
    for k in range(args.rounds + 1):  # round 0 warms up
        for key in VARIANTS:
            dist.barrier()
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            nbytes[key] = step(key, k)
            if cuda:
                torch.cuda.synchronize()
                peak[key] = torch.cuda.max_memory_allocated()
            dist.barrier()
            if k:
                times[key].append(time.perf_counter() - t0)
    result = {"times_s": times, "received_bytes_per_step": nbytes, "peak_cuda_bytes": peak}
    want = {n: p.detach() for n, p in single.items()}
    diffs = {}
    for key in ("ours_sequential", "ours_overlapped"):
        got = {n: p.full_tensor() for n, p in runs[key][0].items()}
        diffs[key] = max(((got[n] - want[n]).abs().max() / want[n].abs().max()).item() for n in want)
    got_fsdp = {n: p.full_tensor() for n, p in fsdp_live.items()}
    diffs["fsdp2_full_tensor"] = max(((got_fsdp[n] - want[n]).abs().max() / want[n].abs().max()).item()
                                     for n in want)
    seq, ovl = runs["ours_sequential"][0], runs["ours_overlapped"][0]
    diffs["overlapped_equals_sequential_bitwise"] = all(torch.equal(seq[n].to_local(), ovl[n].to_local())
                                                        for n in seq)
    result["max_rel_diff_vs_single_process"] = diffs
    from torch_backend.optim import newton_schulz

    fp32 = {n: newton_schulz(g) for n, g in grads[0].items()}
    result["ns_rel_err_vs_fp32"] = max(((newton_schulz(g, dtype=kw["ns_dtype"]) - fp32[n]).norm()
                                        / fp32[n].norm()).item() for n, g in grads[0].items())
    live, ovl_opt, _ = runs["ours_overlapped"]  # the same assignment in both of ours
    result["ns_flops_per_rank"] = ovl_opt.newton_schulz_load().tolist()
    result["split_matrices"] = sum(len(ovl_opt.ns_devices(p)) > 1 for p in live.values())
    out[rank] = result


def _run(rank: int, world: int, workdir: str, args: argparse.Namespace, queue) -> None:
    out: dict = {}
    try:
        _worker(rank, world, workdir, args, out)
    finally:  # a failed rank answers too, so the launcher never waits on it
        queue.put((rank, out.get(rank)))
        queue.close()
        queue.join_thread()  # the answer is in the pipe before the process ends
    leave_and_exit()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--stack", default="both", choices=("both", "torch", "jax"))
    ap.add_argument("--jax-devices", type=int, default=None,
                    help="devices of the JAX half (default: 8 host devices on CPU, --world-size on CUDA)")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process (CPU)")
    ap.add_argument("--in-flight", type=int, default=2)
    ap.add_argument("--ns-dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--out", default=str(RESULTS / "muon_bench"))
    args = ap.parse_args()
    if args.stack in ("both", "torch"):
        run_torch(args)
    if args.stack in ("both", "jax"):
        devices = args.jax_devices or (8 if args.device == "cpu" else args.world_size)
        platform = "gpu" if args.device == "cuda" else "cpu"
        cmd = [sys.executable, "-m", "experiments._muon_bench_jax", "--devices", str(devices), "--platform",
               platform, "--rounds", str(args.rounds), "--in-flight", str(args.in_flight), "--ns-dtype",
               args.ns_dtype, "--out", args.out + "_jax"]
        if subprocess.run(cmd, cwd=Path(__file__).parent.parent).returncode:
            raise SystemExit(f"the JAX half failed: {' '.join(cmd)}")


def run_torch(args: argparse.Namespace) -> None:
    """The torch half: ``--world-size`` processes (spawned: never forked after jax)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as workdir:
        procs = [ctx.Process(target=_run, args=(r, args.world_size, workdir, args, queue))
                 for r in range(args.world_size)]
        for p in procs:
            p.start()
        results = dict(queue.get(timeout=900) for _ in procs)
        for p in procs:
            p.join()
    if any(r is None for r in results.values()):
        raise SystemExit(f"ranks {[k for k, r in results.items() if r is None]} failed (see their traceback)")
    summary = summarize(results, args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps({"summary": summary, "per_rank": results}, indent=1))
    Path(args.out + ".md").write_text(render(summary))
    print(render(summary))


def summarize(results: dict, args: argparse.Namespace) -> dict:
    """Per variant: median step time over ranks' slowest (a step ends when the slowest rank ends)."""
    rounds = len(results[0]["times_s"][VARIANTS[0]])
    slowest = {v: [max(results[r]["times_s"][v][k] for r in results) for k in range(rounds)]
               for v in VARIANTS}
    median = {v: statistics.median(t) for v, t in slowest.items()}
    ratio = {v: statistics.median(a / b for a, b in zip(slowest[v], slowest["fsdp2_full_tensor"]))
             for v in VARIANTS}
    mats = matrices()
    biggest = max(4 * s[0] * s[1] for _, s in mats)
    held = {"ours_sequential": biggest, "ours_overlapped": (2 * args.in_flight + 1) * biggest,
            "fsdp2_full_tensor": 2 * biggest, "single_process": sum(4 * s[0] * s[1] for _, s in mats)}
    return {"world_size": args.world_size, "device": args.device, "ns_dtype": args.ns_dtype,
            "rounds": rounds, "threads": args.threads, "in_flight": args.in_flight,
            "config": CONFIG.__dict__, "matrices": len(mats),
            "median_step_s": median, "median_ratio_vs_fsdp2_full_tensor": ratio,
            "received_bytes_per_step_rank_max": {v: max(results[r]["received_bytes_per_step"][v]
                                                        for r in results) for v in VARIANTS},
            "peak_cuda_bytes_rank_max": {v: max(results[r]["peak_cuda_bytes"].get(v, 0) for r in results)
                                         for v in VARIANTS},
            "whole_matrix_bytes_held_at_once_bound": held,
            "max_rel_diff_vs_single_process": results[0]["max_rel_diff_vs_single_process"],
            "ns_rel_err_vs_fp32": results[0]["ns_rel_err_vs_fp32"],
            "ns_flops_per_rank": results[0]["ns_flops_per_rank"],
            "split_matrices": results[0]["split_matrices"]}


def render(s: dict) -> str:
    flops = s["ns_flops_per_rank"]
    lines = [f"# Distributed Muon vs the FSDP2 full_tensor workaround ({s['world_size']} x {s['device']}, "
             f"Newton-Schulz in {s['ns_dtype']}, {s['matrices']} matrices, {s['rounds']} interleaved rounds)",
             "", "| variant | median step (ms) | ratio vs workaround (median of rounds) "
             "| bytes received per step (max rank) | peak CUDA bytes | max rel. diff vs single process |",
             "|---|---|---|---|---|---|"]
    for v in VARIANTS:
        lines.append(f"| {v} | {1e3 * s['median_step_s'][v]:.1f} "
                     f"| {s['median_ratio_vs_fsdp2_full_tensor'][v]:.3f} "
                     f"| {s['received_bytes_per_step_rank_max'][v]} "
                     f"| {s['peak_cuda_bytes_rank_max'][v] or '-'} | "
                     f"{s['max_rel_diff_vs_single_process'].get(v, 0):.2e} |")
    lines += ["", f"Overlapped equals sequential bit for bit: "
              f"{s['max_rel_diff_vs_single_process']['overlapped_equals_sequential_bitwise']}. "
              f"Newton-Schulz in {s['ns_dtype']} vs fp32 (relative Frobenius error, max over the matrices, "
              f"round-0 gradients): {s['ns_rel_err_vs_fp32']:.2e}.",
              f"Whole-matrix bytes a rank holds at once (bound, computed): "
              f"{s['whole_matrix_bytes_held_at_once_bound']}.",
              f"Newton-Schulz FLOPs per rank of ours (`Muon.newton_schulz_load()`): {flops}, max/mean "
              f"{max(flops) / statistics.mean(flops):.3f}; matrices split over a group: "
              f"{s['split_matrices']}.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
