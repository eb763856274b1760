"""Measure one decoder layer here and write the calibration file ``ragged simulate --calibration`` takes.

What docs/simulate.md's calibration reads, for ``layers.0`` of a preset on ``--world`` ranks of this
machine: the all-gather of the layer's planned shard (the core's ``plan_model``, compute dtype) and the
reduce-scatter of its gradient (fp32), on the launch's own process group (NCCL on GPU, gloo on CPU), and
the layer's forward and backward on ``--batch x --seq-len`` tokens with its weights whole (a plain
``TransformerBlock``; FSDP's hooks are timed by the collectives above). Each time is the median of
``--repeat`` runs after ``--warmup``, between CUDA events on GPU, wall clock after a barrier on CPU.
At one rank the collectives move nothing, so only forward and backward are written.

    python -m experiments.calibrate_layer --model llama3.2-1b --world 1 --device cuda --dtype bf16 \
        --batch 4 --seq-len 2048 --out experiments/results/gpu_calibration.json
    ragged simulate --model llama3.2-1b --gpus 8 --hardware h200 \
        --calibration experiments/results/gpu_calibration.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from experiments._distributed import rendezvous, spawn_ranks
from ragged import plan_model
from ragged.models import model_units, trained_llama
from ragged.simulate import PROFILES, Calibration

UNIT = "layers.0"
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# What torch.cuda.get_device_name() says, to the hardware profile it is (the first match wins).
GPU_PROFILES = (("H200", "h200"), ("H800", "h800"), ("H100", "h100"), ("B200", "b200"), ("A100", "a100"))
# torch 2.13 renames the flat-buffer collectives the runtime uses (same arguments); 2.11 has the old names.
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def hardware_of(device: str) -> str:
    """The profile of this machine's GPU; raises on CPU or an unknown GPU (pass ``--hardware``)."""
    name = torch.cuda.get_device_name() if device == "cuda" else "the CPU"
    for marker, profile in GPU_PROFILES:
        if marker in name:
            return profile
    raise SystemExit(f"calibrate_layer: no hardware profile for {name}; pass --hardware "
                     f"({', '.join(PROFILES)}) to say which profile these times calibrate")


def _timer(device: str) -> Callable[[Callable[[], object]], float]:
    """``time(fn)``: fn's seconds on this device (CUDA events around it on GPU)."""
    def time_it(fn: Callable[[], object]) -> float:
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    return time_it


def _median(time_it, fn: Callable[[], object], warmup: int, repeat: int) -> float:
    for _ in range(warmup):
        time_it(fn)
    return statistics.median(time_it(fn) for _ in range(repeat))


def measure(rank: int, args: argparse.Namespace) -> dict[str, float]:
    """Milliseconds of each piece of ``layers.0`` on this rank."""
    from torch_backend.models.llama import TransformerBlock

    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    dtype = DTYPES[args.dtype]
    c, _ = trained_llama(args.model)
    time_it = _timer(args.device)
    out = {}
    if args.world > 1:
        layouts = plan_model(model_units(args.model), args.world)
        shard = next(lay for lay in layouts if lay.name == UNIT).shard_size
        piece = torch.ones(shard, dtype=dtype, device=device)
        gathered = torch.empty(args.world * shard, dtype=dtype, device=device)
        grads = torch.ones(args.world * shard, dtype=torch.float32, device=device)
        reduced = torch.empty(shard, dtype=torch.float32, device=device)
        out["all_gather"] = _median(time_it, lambda: ALL_GATHER(gathered, piece),
                                    args.warmup, args.repeat)
        out["reduce_scatter"] = _median(time_it, lambda: REDUCE_SCATTER(reduced, grads),
                                        args.warmup, args.repeat)
    torch.manual_seed(0)
    block = TransformerBlock(c).to(device=device, dtype=dtype)
    x = torch.randn(args.batch, args.seq_len, c.dim, device=device, dtype=dtype, requires_grad=True)
    out["forward"] = _median(time_it, lambda: block(x), args.warmup, args.repeat)

    def backward_once() -> float:  # a fresh graph each time; only its backward is timed
        y = block(x)
        grad = torch.ones_like(y)
        return time_it(lambda: y.backward(grad))

    runs = [backward_once() for _ in range(args.warmup + args.repeat)]
    out["backward"] = statistics.median(runs[args.warmup:])
    return {k: 1e3 * v for k, v in out.items()}


def _worker(rank: int, workdir: str, args: argparse.Namespace) -> dict[str, float]:
    torch.set_num_threads(max(1, torch.get_num_threads() // args.world))
    if args.device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", init_method=rendezvous(workdir),
                            rank=rank, world_size=args.world, timeout=datetime.timedelta(seconds=120))
    return measure(rank, args)


def calibration(args: argparse.Namespace) -> dict:
    """Launch ``--world`` ranks, measure, and return the calibration file's content (rank 0's times),
    checked by the simulator's own ``Calibration``."""
    times = spawn_ranks(args.world, _worker, args, device=args.device)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    return Calibration(
        source=f"experiments.calibrate_layer on {args.world} x {device}, {datetime.date.today().isoformat()}",
        hardware=args.hardware or hardware_of(args.device), model=args.model, method="ours", gpus=args.world,
        unit=UNIT, measured_ms={k: round(v, 4) for k, v in times[0].items()}, batch_per_device=args.batch,
        seq_len=args.seq_len, dtype=args.dtype).to_dict()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama3.2-1b", help="a preset ragged simulate knows")
    p.add_argument("--world", type=int, default=1, help="ranks (GPUs) to measure the collectives over")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--dtype", default="bf16", choices=tuple(DTYPES))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--hardware", help="the profile these times calibrate (default: from the GPU's name)")
    p.add_argument("--out", required=True, help="the calibration JSON to write")
    args = p.parse_args(argv)
    if args.hardware is None:
        hardware_of(args.device)  # fail before launching anything
    data = calibration(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(data, indent=1) + "\n")
    print(json.dumps(data["measured_ms"]))


if __name__ == "__main__":
    main()
