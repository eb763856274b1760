"""Run ``fully_shard``'s CUDA/NCCL paths on one GPU and print a table of what holds.

World size 1 on one GPU with NCCL: the all-gather and reduce-scatter run on their own CUDA streams with
events (no ``record_stream``), buffers are allocated and freed per unit, bf16 mixed precision casts once
per unit. Checked against plain single-GPU training of the same llama-tiny (same data, seed, AdamW):

    python -m experiments.gpu_check          # exits with status 2 and a message when CUDA is absent
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.distributed as dist

STEPS, BATCH, SEQ = 6, 8, 64


def _batch(step: int, vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=g).to(device)
    return tokens[:, :-1], tokens[:, 1:]


def _train(model, steps: int, device: torch.device, shard_clip: bool) -> tuple[list[float], list[float]]:
    from torch_backend import clip_grad_norm_
    from torch_backend.models import cross_entropy

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, times = [], []
    for step in range(steps):
        x, y = _batch(step, model.config.vocab_size, device)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = cross_entropy(model(x), y)
        loss.backward()
        if shard_clip:
            clip_grad_norm_(model, 1.0)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    return losses, times


def main() -> int:
    if not torch.cuda.is_available():
        print(f"gpu_check: CUDA is not available here (torch {torch.__version__}, CUDA build "
              f"{torch.version.cuda}); run it on a machine with an NVIDIA GPU.", file=sys.stderr)
        return 2
    from torch.distributed.device_mesh import init_device_mesh

    from torch_backend import MixedPrecisionPolicy, debug_counter, unsharded
    from torch_backend.fsdp import units
    from torch_backend.models import Llama, parallelize

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)  # one process: no port
    device = torch.device("cuda", 0)
    mesh = init_device_mesh("cuda", (1,))
    rows = []

    with torch.device(device):
        plain = Llama()
    plain.init_weights(0)
    ref_losses, ref_times = _train(plain, STEPS, device, shard_clip=False)

    for name, policy in (("fp32", None), ("bf16", MixedPrecisionPolicy(torch.bfloat16, torch.float32))):
        with torch.device("meta"):
            model = Llama()
        parallelize(model, mesh, mp_policy=policy)
        with unsharded(model):  # under bf16 the initial values are rounded to bf16 (see docs)
            model.init_weights(0)
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        with debug_counter() as counter:
            losses, times = _train(model, STEPS, device, shard_clip=True)
        after = torch.cuda.memory_allocated()
        us = units(model)
        streams = {u.ag_stream for u in us} | {u.rs_stream for u in us}
        rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
        tol = 1e-5 if name == "fp32" else 3e-2
        per_unit = {u.name for u in us}
        rows += [
            (f"{name}: losses vs plain GPU training", f"max rel {rel:.2e}", rel <= tol),
            (f"{name}: device of every local shard", str({u.master.shard.device for u in us}),
             all(u.master.shard.is_cuda for u in us)),
            (f"{name}: collectives on side streams", f"{len(streams)} streams, default excluded",
             None not in streams and torch.cuda.default_stream() not in streams and len(streams) == 2),
            (f"{name}: reduce-scatters per unit per step",
             str(sorted(set(counter.per_label("reduce_scatter").values()))),
             counter.per_label("reduce_scatter") == {u: STEPS for u in per_unit}),
            (f"{name}: bytes copied / cast outside collectives",
             f"{counter.copy_bytes} / {counter.cast_bytes}",
             counter.copy_bytes == 0 and (counter.cast_bytes > 0) == (policy is not None)),
            (f"{name}: unsharded buffers freed after the steps", f"{(after - before) / 2**20:.2f} MiB kept",
             not any(u.compute.full_allocated or u.grads.full_allocated for u in us)),
            (f"{name}: median step vs plain", f"{statistics.median(times[1:]) * 1e3:.1f} ms vs "
             f"{statistics.median(ref_times[1:]) * 1e3:.1f} ms; peak "
             f"{torch.cuda.max_memory_allocated() / 2**20:.1f} MiB", None),
        ]
    dist.destroy_process_group()
    width = max(len(r[0]) for r in rows)
    print(f"gpu_check on {torch.cuda.get_device_name(0)} (torch {torch.__version__})")
    for check, value, ok in rows:
        status = "info" if ok is None else ("ok" if ok else "FAIL")
        print(f"  {check:<{width}}  {status:<4}  {value}")
    return 0 if all(ok is not False for *_, ok in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
