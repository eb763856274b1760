"""The device check: ragged-fsdp's CUDA paths on one GPU, in stages, each stage's results written as it goes.

    bash experiments/gpu_check.sh RESULTS_DIR          # every stage, 330 s of budgets in all (STAGES)
    python3 -m experiments.gpu_check STAGE --out DIR   # one stage (PYTHONPATH=. from the repository)

Runs as it is on a GPU image with torch >= 2.11 and jax >= 0.11 with its CUDA plugin: nothing to install.
Each stage runs in its own process (JAX and torch never share the GPU's memory) and appends one JSON
object per check to ``DIR/checks.jsonl`` the moment it is known (``stage``, ``check``, ``value``, ``ok``:
true, false, or null for a measurement), so a stage killed at its budget keeps what it had. The shell
script adds ``DIR/summary.txt`` (one line per stage) and ``DIR/log.txt``; the calibrate stage writes
``DIR/calibration.json``: four files in all. Without a GPU every stage refuses at once (exit 2).

Stages (STAGES: name -> budget in seconds):
  imports    torch sees CUDA, JAX's default backend is gpu, the three packages import.
  fsdp       fully_shard at world size 1 on NCCL: llama-tiny against plain single-GPU training (fp32 and
             bf16), collectives on side streams, no copies; then llama3-8b-shaped layers in bf16: step
             time, MFU and peak memory, against FSDP2 at world size 1 on the same model.
  muon       the overlapped Muon exchange on a side stream: two processes on the one GPU over gloo
             (NCCL refuses two ranks on one device; at world size 1 nothing is exchanged), overlapped
             against sequential bit for bit, and against single-process Muon on the GPU.
  adam8bit   8-bit Adam on the GPU gives the CPU's bits (parameters and quantized state).
  jax        the shard_map step on the GPU: llama-tiny trained from torch's initial weights, losses
             against plain torch training on the CPU.
  calibrate  experiments.calibrate_layer on llama3.2-1b's layer: the calibration file of ragged simulate.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

STAGES = {"imports": 30, "fsdp": 110, "muon": 60, "adam8bit": 25, "jax": 60, "calibrate": 45}
CHECKS = "checks.jsonl"

# llama3-8b's layer shapes with two layers and a 32k vocabulary: the layers dominate as in the model.
TOKENS_8B = {"batch": 2, "seq_len": 4096}


class Report:
    """Appends one stage's checks to ``out/checks.jsonl``, each as soon as it is known."""

    def __init__(self, out: Path, stage: str) -> None:
        self.path, self.stage, self.failed = out / CHECKS, stage, 0
        out.mkdir(parents=True, exist_ok=True)

    def __call__(self, check: str, value: object, ok: bool | None = None) -> None:
        row = {"stage": self.stage, "check": check, "value": value, "ok": ok}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        self.failed += ok is False
        print(f"  {'info' if ok is None else 'ok' if ok else 'FAIL':<4}  {check}: {value}", flush=True)


def summary_line(out: Path, stage: str, rc: int, seconds: int) -> str:
    """One line for ``stage`` from its rows in ``checks.jsonl`` and how its process ended."""
    lines = (out / CHECKS).read_text().splitlines() if (out / CHECKS).exists() else []
    rows = [r for r in map(json.loads, lines) if r["stage"] == stage]
    failed = [r["check"] for r in rows if r["ok"] is False]
    status = {0: "ok", 1: "FAIL", 2: "no GPU", 124: "TIMEOUT", 137: "KILLED"}.get(rc, f"ERROR (exit {rc})")
    line = f"{stage:<9} {status:<8} {seconds:>3}s of {STAGES[stage]}s, {len(rows)} checks"
    if failed:
        line += f", failed: {'; '.join(failed)}"
    measured = [f"{r['check']} = {r['value']}" for r in rows if r["ok"] is None]
    return line + (f"; {measured[-1]}" if measured else "")


def model_flops_per_token(config, seq_len: int) -> float:
    """Training FLOPs per token of a llama (PaLM's appendix B): 6 per weight of every matmul (the head
    included, the embedding lookup not) and 12 L dim T for attention's two matmuls, forward and backward
    (the standard count, although causal attention computes about half of it)."""
    c = config
    attention = c.dim * (2 * c.n_heads + 2 * c.n_kv_heads) * c.head_dim
    layer = attention + 3 * c.dim * c.ffn_dim
    matmul_weights = c.n_layers * layer + c.dim * c.vocab_size
    return 6 * matmul_weights + 12 * c.n_layers * c.dim * seq_len


def require_gpu() -> None:
    import torch

    if not torch.cuda.is_available():
        print(f"gpu_check: torch {torch.__version__} sees no CUDA device here; this check runs on a machine "
              "with an NVIDIA GPU (nothing measured, nothing written)", file=sys.stderr)
        sys.exit(2)


# ----- imports ------------------------------------------------------------------------------------------
def stage_imports(report: Report) -> None:
    import torch

    report("torch sees CUDA", f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
           f"{torch.cuda.get_device_name(0)}", torch.cuda.is_available())
    import jax

    report("JAX's default backend is gpu", f"jax {jax.__version__}: {jax.default_backend()}, {jax.devices()}",
           jax.default_backend() == "gpu")
    for package in ("ragged", "torch_backend", "jax_backend"):
        module = __import__(package)
        report(f"import {package}", module.__file__, True)


# ----- fsdp ---------------------------------------------------------------------------------------------
def _llama_batch(step: int, vocab: int, batch: int, seq: int, device):
    import torch

    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g).to(device)
    return tokens[:, :-1], tokens[:, 1:]


def _train(model, steps: int, batch: int, seq: int, *, sync: Callable[[], None], clip=None
           ) -> tuple[list[float], list[float]]:
    """``steps`` AdamW steps; the losses and each step's wall time (``sync`` before reading the clock)."""
    import torch

    from torch_backend.models import cross_entropy

    device = next(model.parameters()).device
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, times = [], []
    for step in range(steps):
        x, y = _llama_batch(step, model.config.vocab_size, batch, seq, device)
        sync()
        start = time.perf_counter()
        loss = cross_entropy(model(x), y)
        loss.backward()
        if clip is not None:
            clip(model)
        opt.step()
        opt.zero_grad()
        sync()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    return losses, times


def _tiny_against_plain(report: Report, mesh, device) -> None:
    """llama-tiny under fully_shard against the same training without it, fp32 and bf16."""
    import torch

    from torch_backend import MixedPrecisionPolicy, clip_grad_norm_, debug_counter, unsharded
    from torch_backend.fsdp import units
    from torch_backend.models import Llama, parallelize

    steps, batch, seq = 6, 8, 64
    with torch.device(device):
        plain = Llama()
    plain.init_weights(0)
    want, _ = _train(plain, steps, batch, seq, sync=torch.cuda.synchronize,
                     clip=lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0))
    for name, policy in (("fp32", None), ("bf16", MixedPrecisionPolicy(torch.bfloat16, torch.float32))):
        with torch.device("meta"):
            model = Llama()
        parallelize(model, mesh, mp_policy=policy)
        with unsharded(model):  # under bf16 the initial values are rounded to bf16 (docs/fully_shard.md)
            model.init_weights(0)
        with debug_counter() as counter:
            got, _ = _train(model, steps, batch, seq, sync=torch.cuda.synchronize,
                            clip=lambda m: clip_grad_norm_(m, 1.0))
        us = units(model)
        rel = max(abs(a - b) / abs(b) for a, b in zip(got, want))
        # fp32: the same kernels in another order of sums; bf16: compute rounded to 8 bits of mantissa
        report(f"llama-tiny {name}: losses vs plain GPU training", f"max rel {rel:.2e}",
               rel <= (1e-5 if policy is None else 3e-2))
        report(f"llama-tiny {name}: every local shard on the GPU",
               sorted({str(u.master.shard.device) for u in us}), all(u.master.shard.is_cuda for u in us))
        streams = {u.ag_stream for u in us} | {u.rs_stream for u in us}
        report(f"llama-tiny {name}: collectives on two side streams", len(streams),
               None not in streams and torch.cuda.default_stream() not in streams and len(streams) == 2)
        report(f"llama-tiny {name}: bytes copied / cast outside collectives",
               [counter.copy_bytes, counter.cast_bytes],
               counter.copy_bytes == 0 and (counter.cast_bytes > 0) == (policy is not None))
        report(f"llama-tiny {name}: unsharded buffers freed", "",
               not any(u.compute.full_allocated or u.grads.full_allocated for u in us))


def _eight_b_layers(kind: str, mesh, device, config=None):
    """Two llama3-8b-shaped layers (32k vocabulary; or ``config``) built on ``device`` with torch's default
    init, then sharded by ours or FSDP2 (as torchtitan wraps a llama), bf16 compute, fp32 master weights."""
    import torch
    from torch.distributed import fsdp

    from ragged.models import LlamaConfig
    from torch_backend import MixedPrecisionPolicy
    from torch_backend.models import Llama, parallelize

    with torch.device(device):
        model = Llama(config or LlamaConfig(32768, 4096, 2, 32, 8, 128, 14336))
    if kind == "ours":
        return parallelize(model, mesh, mp_policy=MixedPrecisionPolicy(torch.bfloat16, torch.float32))
    mp = fsdp.MixedPrecisionPolicy(torch.bfloat16, torch.float32)
    for block in (model.tok_embeddings, *model.layers, [model.norm, model.output]):
        fsdp.fully_shard(block, mesh=mesh, mp_policy=mp)
    return fsdp.fully_shard(model, mesh=mesh, mp_policy=mp)


def _eight_b_against_fsdp2(report: Report, mesh, device) -> None:
    import torch

    from experiments.calibrate_layer import hardware_of
    from ragged.simulate import PROFILES

    batch, seq = TOKENS_8B["batch"], TOKENS_8B["seq_len"]
    measured = {}
    for kind in ("ours", "fsdp2"):
        model = _eight_b_layers(kind, mesh, device)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        _, times = _train(model, 6, batch, seq, sync=torch.cuda.synchronize)
        step = statistics.median(times[2:])
        measured[kind] = (step, torch.cuda.max_memory_allocated())
        flops = model_flops_per_token(model.config, seq) * batch * seq
        mfu = flops / step / PROFILES[hardware_of("cuda")].peak_flops
        report(f"llama3-8b layers bf16, {kind}: median step, MFU, peak memory",
               f"{step * 1e3:.1f} ms, {mfu:.1%}, {measured[kind][1] / 2**30:.2f} GiB")
        del model
        torch.cuda.empty_cache()
    (ours_t, ours_m), (theirs_t, theirs_m) = measured["ours"], measured["fsdp2"]
    report("llama3-8b layers bf16: ours / FSDP2 step time, peak memory",
           f"{ours_t / theirs_t:.3f}, {ours_m / theirs_m:.3f}")


def stage_fsdp(report: Report) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)  # one process: no port
    try:
        mesh = init_device_mesh("cuda", (1,))
        device = torch.device("cuda", 0)
        _tiny_against_plain(report, mesh, device)
        _eight_b_against_fsdp2(report, mesh, device)
    finally:
        dist.destroy_process_group()


# ----- muon ---------------------------------------------------------------------------------------------
MUON_SHAPES = {f"m{i}": s for i, s in enumerate([(512, 1536), (1536, 512), (1024, 1024), (768, 2048),
                                                 (2048, 768), (512, 512), (1024, 256), (256, 1024)])}


def _muon_inputs(shapes: dict, steps: int = 3):
    """Seeded matrices and gradients (CPU), the same in every process."""
    import torch

    g = torch.Generator().manual_seed(0)
    params = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    grads = [{n: torch.randn(s, generator=g) for n, s in shapes.items()} for _ in range(steps)]
    return params, grads


def _muon_train(params: dict, grads: list, place: Callable, overlap: bool) -> dict:
    """Muon steps over ``place``d copies of ``params``; each parameter's local values afterwards."""
    import torch

    from torch_backend.optim import Muon

    live = {n: torch.nn.Parameter(place(n, t)) for n, t in params.items()}
    opt = Muon(list(live.items()), lr=0.02, weight_decay=0.01, overlap=overlap, in_flight=2)
    for step in grads:
        for n, p in live.items():
            p.grad = place(n, step[n])
        opt.step()
    return {n: (p.to_local() if hasattr(p, "to_local") else p).detach().cpu() for n, p in live.items()}


def _muon_rank(rank: int, workdir: str, device: str, shapes: dict) -> dict:
    """One of two processes on the one GPU (``device`` cuda), over gloo: overlapped and sequential Muon
    on RaggedShard parameters; returns both results' local values and this rank's flat ranges."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import ragged
    from experiments._distributed import rendezvous
    from torch_backend import RaggedShard
    from torch_backend.placement import make_dtensor

    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=rendezvous(workdir), rank=rank, world_size=2,
                            timeout=timedelta(seconds=40))
    mesh = init_device_mesh(device, (2,))
    layout = ragged.plan([ragged.TensorSpec(n, s, "rows:1") for n, s in shapes.items()], 2)
    ranges = {n: layout.placement(n).ranges(s)[rank] for n, s in shapes.items()}

    def place(name: str, full: torch.Tensor):
        lo, hi = ranges[name]
        local = full.reshape(-1)[lo:hi].clone().to(device)
        return make_dtensor(local, mesh, [RaggedShard.from_core(layout.placement(name))], full.shape)

    params, grads = _muon_inputs(shapes)
    # numpy arrays: pickled by value (a tensor would be sent as a handle to this process's memory)
    return {"overlapped": {n: t.numpy() for n, t in _muon_train(params, grads, place, True).items()},
            "sequential": {n: t.numpy() for n, t in _muon_train(params, grads, place, False).items()},
            "ranges": ranges}


def stage_muon(report: Report, device: str = "cuda", shapes: dict = MUON_SHAPES) -> None:
    """``shapes``: the matrices (the GPU's; the CPU test runs the same code on smaller ones)."""
    import torch

    from experiments._distributed import spawn_ranks

    ranks = spawn_ranks(2, _muon_rank, device, shapes, device=device)
    params, grads = _muon_inputs(shapes)
    single = _muon_train(params, grads, lambda n, t: t.clone().to(device), overlap=True)  # local NS
    for rank, arrays in enumerate(ranks):
        got = {k: {n: torch.from_numpy(a) for n, a in arrays[k].items()}
               for k in ("overlapped", "sequential")} | {"ranges": arrays["ranges"]}
        same = all(torch.equal(got["overlapped"][n], got["sequential"][n]) for n in shapes)
        report(f"rank {rank}: overlapped = sequential, bit for bit", same, same)
        worst, close = 0.0, True
        for n in shapes:
            lo, hi = got["ranges"][n]
            want = single[n].reshape(-1)[lo:hi]
            worst = max([worst, *(got["overlapped"][n] - want).abs().tolist()])
            # the same Newton-Schulz on the same matrix after another exchange: fp32 rounding apart
            close &= torch.allclose(got["overlapped"][n], want, rtol=1e-5, atol=1e-6)
        report(f"rank {rank}: against single-process Muon on this device", f"max abs {worst:.2e}", close)


# ----- adam8bit -----------------------------------------------------------------------------------------
def _adam8bit_train(device: str, steps: int = 3) -> dict:
    import torch

    from torch_backend.optim import Adam8bit

    g = torch.Generator().manual_seed(0)
    shapes = {"w": (256, 384), "v": (4096,)}
    live = {n: torch.nn.Parameter(torch.randn(s, generator=g).to(device)) for n, s in shapes.items()}
    grads = [{n: torch.randn(s, generator=g).to(device) for n, s in shapes.items()} for _ in range(steps)]
    opt = Adam8bit(list(live.items()), lr=1e-2, weight_decay=0.1)
    for step in grads:
        for n, p in live.items():
            p.grad = step[n]
        opt.step()
    out = {n: p.detach().cpu() for n, p in live.items()}
    for n, p in live.items():
        out |= {f"{n}.{k}": v.cpu() for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)}
    return out


def stage_adam8bit(report: Report) -> None:
    import torch

    cpu, gpu = _adam8bit_train("cpu"), _adam8bit_train("cuda")
    differ = [k for k in cpu if not torch.equal(cpu[k], gpu[k])]
    report("8-bit Adam: GPU bits = CPU bits (parameters, codes, scales)",
           f"{len(cpu) - len(differ)} of {len(cpu)} tensors equal, differ: {differ}",
           not differ and set(cpu) == set(gpu))


# ----- jax ----------------------------------------------------------------------------------------------
def stage_jax(report: Report) -> None:
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")  # fp32 matmuls, as torch's reference
    import optax
    from flax import nnx

    from experiments import demo
    from jax_backend import load_neutral_params, make_mesh
    from jax_backend.models import Llama as JaxLlama
    from jax_backend.models import cross_entropy, parallelize
    from torch_backend import save_neutral_checkpoint
    from torch_backend.models import Llama

    report("JAX's default backend is gpu", jax.default_backend(), jax.default_backend() == "gpu")
    steps = 10
    with tempfile.TemporaryDirectory() as tmp:
        init = Path(tmp) / "init"
        model = Llama()
        model.init_weights(demo.SEED)
        save_neutral_checkpoint(init, model)
        want = demo.torch_reference(Llama(), steps, init, Path(tmp) / "torch_final")  # CPU, fp32
        mesh = make_mesh((1,), ("fsdp",))
        fsdp = parallelize(JaxLlama(rngs=nnx.Rngs(demo.SEED)), mesh)
        opt = optax.adamw(demo.LR, weight_decay=demo.WEIGHT_DECAY)
        buffers = fsdp.shard_params(load_neutral_params(init))
        report("unit buffers on the GPU", sorted({str(d) for b in buffers.values() for d in b.devices()}),
               all(d.platform == "gpu" for b in buffers.values() for d in b.devices()))
        state = fsdp.init(opt, buffers)
        step_fn = fsdp.train_step(opt, cross_entropy)
        got, times = [], []
        for step in range(steps):
            x, y = demo.batch(step)
            start = time.perf_counter()
            buffers, state, loss = step_fn(buffers, state, x, y)
            got.append(float(loss))  # waits for the step
            times.append(time.perf_counter() - start)
    rel = max(abs(a - b) / abs(b) for a, b in zip(got, want))
    # fp32 on both; another summation order per kernel, which AdamW amplifies a little over 10 steps
    report("shard_map llama-tiny on the GPU: losses vs torch on the CPU", f"max rel {rel:.2e}", rel <= 1e-4)
    report("shard_map llama-tiny: first step (compile), median step",
           f"{times[0]:.1f} s, {statistics.median(times[1:]) * 1e3:.1f} ms")


# ----- calibrate ----------------------------------------------------------------------------------------
def stage_calibrate(report: Report) -> None:
    from experiments import calibrate_layer

    out = report.path.parent / "calibration.json"
    calibrate_layer.main(["--model", "llama3.2-1b", "--world", "1", "--device", "cuda", "--dtype", "bf16",
                          "--batch", "4", "--seq-len", "2048", "--warmup", "2", "--repeat", "5",
                          "--out", str(out)])
    written = json.loads(out.read_text())
    report("calibration file for ragged simulate", f"{out.name}: {sorted(written)}", True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("stage", choices=(*STAGES, "plan", "summary"),
                   help="a stage; plan: print 'stage budget' lines; summary: one line of a finished stage")
    p.add_argument("--out", type=Path, help="the results folder")
    p.add_argument("--of", nargs=3, metavar=("STAGE", "RC", "SECONDS"), help="for summary")
    args = p.parse_args(argv)
    if args.stage == "plan":
        print("\n".join(f"{name} {budget}" for name, budget in STAGES.items()))
        return 0
    if args.stage == "summary":
        stage, rc, seconds = args.of
        print(summary_line(args.out, stage, int(rc), int(seconds)))
        return 0
    if args.out is None:
        p.error("--out is required")
    require_gpu()
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX takes only what it uses
    report = Report(args.out, args.stage)
    print(f"== {args.stage} (budget {STAGES[args.stage]} s)", flush=True)
    globals()[f"stage_{args.stage}"](report)
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
