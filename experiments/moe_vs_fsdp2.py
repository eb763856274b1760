"""Mixture-of-experts: ragged FSDP (with and without expert parallelism) vs FSDP2 and GSPMD, in three parts.

**Core** (numpy only, seconds): GPT-OSS-120B's decoder layer (128 fused experts, ``gate_up_proj`` of
``[128, 2880, 5760]``) planned by ``ragged`` and laid out as FSDP2's per-parameter ``Shard(0)``
(``ragged.bench.fsdp2``: each tensor's dim 0 padded to a multiple of the group), at 64 / 128 / 256 /
1024 devices: the all-gather buffer of one layer and the per-device memory of a training step
(``ragged.models.memory_plan``, the plan behind ``experiments.train --dry-run``, with ``sharding="fsdp2"``
for FSDP2). The paper's claim under test: at 256 GPUs FSDP2 runs out of memory on GPT-OSS-120B because
128 fused experts split evenly over 256 devices double its all-gather buffer (docs: PAPER_NOTES).

**Torch** (4 gloo processes, minutes): the GPT-OSS-style and DeepSeek-style tiny MoEs
(``ragged.models.MOE_CONFIGS`` ``gpt-oss-tiny``, ``deepseek-v3-tiny``; ``torch_backend.models.MoEDecoder``)
trained side by side, the variants alternating step by step in one process group: FSDP2 (its
``fully_shard`` on the embedding, each layer, ``[norm, output]`` and the root), ours (``parallelize``,
the same units) and ours with expert parallelism (``expert_parallel`` on ``(ep, fsdp) = (2, 2)``, then
``parallelize``). Per variant: median step time and its ratio to FSDP2, bytes copied outside collectives
(experiments/torch_vs_fsdp2.py's dispatch meter, minus the plain model's own copies), collective bytes
(all-to-all included), padding and the all-gather buffer of one MoE layer (ours: the units' ``Layout``s the
runtime used; FSDP2: its padded ``Shard(0)`` of the same tensors, the core's closed form).

**JAX** (8 host devices, minutes): gpt-oss-tiny and mixtral-tiny, ours (``parallelize_moe``: EP + ragged
FSDP) against GSPMD with an expert axis, on (ep, fsdp) = (2, 4) and (4, 2):
``experiments/_moe_vs_fsdp2_jax.py``, in an interpreter of its own (XLA reads its flags when jax is
imported, and the torch part's workers must not come from a process that imported jax: this one never
does), writing ``<out>_jax.{json,md}``.

    python -m experiments.moe_vs_fsdp2               # all: experiments/results/moe_vs_fsdp2{,_jax}.{json,md}
    python -m experiments.moe_vs_fsdp2 --part core   # the 256-GPU cliff only (no torch)
    python -m experiments.moe_vs_fsdp2 --part torch --warmup 1 --steps 1   # a smoke run
    python -m experiments.moe_vs_fsdp2 --part jax    # experiments/results/moe_vs_fsdp2_jax.{json,md}
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from ragged import Granularity, TensorSpec, granularity_for, plan_model
from ragged.bench import fsdp2
from ragged.models import MOE_CONFIGS, UnitShapes, memory_plan, plan_expert_parallel, trained_shapes

RESULTS = Path(__file__).parent / "results"
CLIFF_MODEL = "gpt-oss-120b"
CLIFF_DEVICES = (64, 128, 256, 1024)
CLIFF_EP = 8  # ours + expert parallelism: 16 of the 128 experts per EP rank (one 8-GPU node's worth of EP)
HBM_GIB = 80  # the paper's H800
COMPUTE_BYTES = 2  # bf16: the all-gather moves the compute dtype

# The torch part's settings (every spawned worker gets them).
WORLD, EP = 4, 2
TORCH_MODELS = ("gpt-oss-tiny", "deepseek-v3-tiny")
VARIANTS = ("fsdp2", "ours", "ours+ep")
BATCH, SEQ = 4, 32  # per rank


# ---- core part ---------------------------------------------------------------------------------------------

def moe_layer(model: str) -> UnitShapes:
    """The unit of ``model``'s first MoE decoder layer (the one its later MoE layers repeat)."""
    c = MOE_CONFIGS[model]
    return trained_shapes(model, c).units[1 + c.n_dense_layers]


def layer_buffers(unit: UnitShapes, devices: int, granularity: str = "rows:1") -> dict:
    """One unit's shard and all-gather buffer (elements) on ``devices``: ours (the planner) and FSDP2."""
    ours = plan_model([unit], devices, granularity)[0]
    matrix = Granularity.parse(granularity)
    theirs = fsdp2([TensorSpec(n, s, granularity_for(s, matrix)) for n, s in unit.tensors], devices, 4)
    return {"numel": unit.numel,
            "ours": {"shard": ours.shard_size, "buffer": ours.total_numel, "padding": ours.padding_ratio},
            "fsdp2": {"shard": theirs.shard_size, "buffer": theirs.total_numel,
                      "padding": theirs.padding_ratio}}


def ep_layer_buffer(model: str, devices: int, ep: int, granularity: str = "rows:1") -> int:
    """The elements one device gathers for ``model``'s MoE layer under EP ``ep``: the layer's unit without
    its routed experts over ``devices``, and its EP rank's ``E / ep`` experts over ``devices / ep``."""
    c, unit = MOE_CONFIGS[model], moe_layer(model)
    rest = UnitShapes(unit.name, tuple((n, s) for n, s in unit.tensors if ".experts." not in n))
    experts = plan_expert_parallel(c, ep, devices // ep, granularity)[0].local
    return plan_model([rest], devices, granularity)[0].total_numel + experts.total_numel


def cliff(model: str = CLIFF_MODEL, devices: tuple[int, ...] = CLIFF_DEVICES, ep: int = CLIFF_EP
          ) -> list[dict]:
    """Per device count: one MoE layer's buffers, FSDP2's rows per device of the fused experts, and the
    per-device memory of a training step (the memory plan's defaults: bf16, AdamW, 2048 tokens) for FSDP2,
    ours and ours with expert parallelism ``ep`` (``ours_ep``)."""
    c, unit = MOE_CONFIGS[model], moe_layer(model)
    rows = []
    for m in devices:
        mem = {kind: memory_plan(model, c, m, sharding=kind) for kind in ("ragged", "fsdp2")}
        mem["ours_ep"] = memory_plan(model, c, m, ep=ep)
        row = {"devices": m, **layer_buffers(unit, m),
               "fsdp2_expert_rows_per_device": -(-c.n_experts // m),
               "fsdp2_devices_holding_only_padding": max(0, m - c.n_experts),
               "ours_ep": {"ep": ep, "buffer": ep_layer_buffer(model, m, ep)}}
        for kind, key in (("ragged", "ours"), ("fsdp2", "fsdp2"), ("ours_ep", "ours_ep")):
            row[key] |= {"unsharded_bytes": mem[kind].unsharded, "memory_bytes": mem[kind].total,
                         "memory_rows": dict(mem[kind].rows()), "fits": mem[kind].total <= HBM_GIB * 2**30}
        rows.append(row)
    return rows


def _cliff_markdown(rows: list[dict]) -> str:
    gib = lambda b: f"{b / 2**30:.1f}"  # noqa: E731
    buf = lambda x: gib(x["buffer"] * COMPUTE_BYTES)  # noqa: E731
    mem = lambda x: gib(x["memory_bytes"]) + ("" if x["fits"] else f" **> {HBM_GIB}**")  # noqa: E731
    c = MOE_CONFIGS[CLIFF_MODEL]
    lines = [f"## The 256-GPU cliff: {CLIFF_MODEL}, one MoE layer ({c.n_experts} fused experts, gate_up_proj "
             f"[{c.n_experts}, {c.dim}, {2 * c.expert_dim}]), from the core's planner and memory plan", "",
             "| devices | layer buffer, ours (GiB bf16) | FSDP2 (GiB bf16) | FSDP2 / ours | padding ours | "
             f"padding FSDP2 | FSDP2 expert rows / device | per-device memory ours (GiB) | FSDP2 (GiB) | "
             f"ours + EP {CLIFF_EP}: layer buffer (GiB bf16) | ours + EP {CLIFF_EP}: memory (GiB) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        o, f, e = r["ours"], r["fsdp2"], r["ours_ep"]
        lines.append(f"| {r['devices']} | {buf(o)} | {buf(f)} | {f['buffer'] / o['buffer']:.2f} | "
                     f"{o['padding']:.2%} | {f['padding']:.2%} | {r['fsdp2_expert_rows_per_device']} | "
                     f"{mem(o)} | {mem(f)} | {buf(e)} | {mem(e)} |")
    lines += ["", "Memory: `memory_plan` defaults (bf16 compute, fp32 master, AdamW, 1 x 2048 tokens per "
              "device, no activation checkpointing); FSDP2 counted alike with its padded shards and buffers "
              "(`sharding=\"fsdp2\"`). The unsharded term is the largest unit gathered twice (running and "
              "prefetched) plus its unsharded gradient in bf16 and fp32. Ours + EP: `memory_plan(ep="
              f"{CLIFF_EP})`, each MoE layer's experts planned per EP rank (`plan_expert_parallel`: "
              f"{c.n_experts // CLIFF_EP} experts over devices / {CLIFF_EP}); its layer buffer is the "
              "layer's unit without the experts plus one EP rank's experts, gathered together; its memory "
              "adds the all-to-all token buffers of one MoE layer."]
    by_m = {r["devices"]: r for r in rows}
    if 128 in by_m and 256 in by_m:
        a, b = by_m[128], by_m[256]
        doubled = b["fsdp2"]["buffer"] / a["fsdp2"]["buffer"]
        verdict = "reproduced" if doubled > 1.9 and not b["fsdp2"]["fits"] and b["ours"]["fits"] else \
            "not reproduced"
        idle = b["fsdp2_devices_holding_only_padding"]
        lines += ["", f"**The paper's claim is {verdict}.** From 128 to 256 devices FSDP2's layer buffer "
                  f"goes from {buf(a['fsdp2'])} to {buf(b['fsdp2'])} GiB (x{doubled:.2f}): every device "
                  f"still holds one whole expert slice of each fused tensor ({idle} of the 256 hold a "
                  "slice of padding), so its sharded state does not shrink either. Its "
                  f"per-device total becomes {gib(b['fsdp2']['memory_bytes'])} GiB against the H800's "
                  f"{HBM_GIB} ({'out of memory' if not b['fsdp2']['fits'] else 'fits'}); ours is "
                  f"{gib(b['ours']['memory_bytes'])} GiB (its layer buffer {buf(b['ours'])} GiB, padding "
                  f"{b['ours']['padding']:.2%}). The exact totals depend on the activation estimate and the "
                  "batch; the doubling of the buffer does not. At 64 and 128 devices FSDP2's even split is "
                  "exact (2 and 1 experts per device) and ours pads 0.01-0.02% more (each tensor contiguous "
                  "in one flat buffer); at 1024 ours pads 5.4% against FSDP2's 87%."]
        e = b["ours_ep"]
        lines += ["", f"With expert parallelism ({CLIFF_EP} EP ranks) a device gathers "
                  f"{c.n_experts // CLIFF_EP} experts of each MoE layer instead of {c.n_experts}: "
                  f"a layer buffer of {buf(e)} GiB at 256 devices and a per-device total of "
                  f"{gib(e['memory_bytes'])} GiB, for the same sharded state (the embedding or the "
                  "head, not a layer, is then the largest unit)."]
    return "\n".join(lines) + "\n"


# ---- torch part --------------------------------------------------------------------------------------------

def _torch_setup() -> dict:
    return dict(WORLD=WORLD, EP=EP, BATCH=BATCH, SEQ=SEQ)


def _build(name: str, variant: str, mesh, ep_mesh):
    import torch
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    from torch_backend.models import MoEDecoder, parallelize
    from torch_backend.models.expert_parallel import expert_parallel

    model = MoEDecoder(MOE_CONFIGS[name])
    model.init_weights(0)
    if variant == "fsdp2":
        for module in (model.tok_embeddings, *model.layers, [model.norm, model.output], model):
            fsdp2_fully_shard(module, mesh=mesh)
    else:
        if variant == "ours+ep":
            expert_parallel(model, ep_mesh)
        parallelize(model, mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _batch(name: str, step: int, rank: int):
    import torch

    g = torch.Generator().manual_seed(step * 100 + rank)
    tokens = torch.randint(0, MOE_CONFIGS[name].vocab_size, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _loss(name: str, model, x, y):
    from torch_backend.models import moe_loss

    return moe_loss(model(x), y, MOE_CONFIGS[name].aux_loss_coef)


def _step(name: str, model, opt, step: int, rank: int) -> float:
    loss = _loss(name, model, *_batch(name, step, rank))
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _layer_buffer(name: str, variant: str, model) -> dict:
    """One MoE layer's all-gather buffer and padding on this rank: ours from the units the runtime planned
    (the layer's, plus its experts' under EP), FSDP2 from its padded ``Shard(0)`` of the layer's tensors."""
    from torch_backend.models import MoEDecoder

    c = MOE_CONFIGS[name]
    layer = model.layers[c.n_dense_layers]
    if variant == "fsdp2":
        plain = MoEDecoder(c).layers[c.n_dense_layers]
        specs = [TensorSpec(n, tuple(p.shape)) for n, p in plain.named_parameters()]
        b = fsdp2(specs, WORLD, 4)
        return {"buffer_numel": b.total_numel, "used_numel": b.used_numel}
    units = layer._units(recurse=True)
    return {"buffer_numel": sum(u.layout.total_numel for u in units),
            "used_numel": sum(u.layout.used_numel for u in units)}


def _variant_meter():
    from experiments.torch_vs_fsdp2 import Meter, _issued_by_our_collectives, _nbytes

    class MoeMeter(Meter):
        """torch_vs_fsdp2's meter, also counting the bytes expert parallelism's all-to-alls send (not the
        all-to-all that carries ours' reduce-scatter on gloo: a reduce-scatter, counted as one)."""

        def __init__(self) -> None:
            super().__init__()
            self.comm["all_to_all"] = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func._schema.name.startswith("c10d::alltoall") and not _issued_by_our_collectives():
                self.comm["all_to_all"] += _nbytes(args[1])  # the input (the output is args[0])
            return super().__torch_dispatch__(func, types, args, kwargs)

    return MoeMeter()


def _timing(name: str, rank: int, warmup: int, steps: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from experiments.torch_vs_fsdp2 import comm_bytes
    from torch_backend import debug_counter
    from torch_backend.models import MoEDecoder

    mesh = init_device_mesh("cpu", (WORLD,))
    ep_mesh = init_device_mesh("cpu", (EP, WORLD // EP), mesh_dim_names=("ep", "fsdp"))
    runs = {v: _build(name, v, mesh, ep_mesh) for v in VARIANTS}
    out = {v: {"step_s": [], "losses": []} for v in runs}
    for step in range(warmup + steps):
        for v, (model, opt) in runs.items():  # alternate, so every variant sees the same load
            dist.barrier()
            t0 = time.perf_counter()
            out[v]["losses"].append(_step(name, model, opt, step, rank))
            if step >= warmup:
                out[v]["step_s"].append(time.perf_counter() - t0)
    plain = MoEDecoder(MOE_CONFIGS[name])
    plain.init_weights(0)
    x, y = _batch(name, warmup + steps, rank)
    meter = _variant_meter()
    with meter:
        _loss(name, plain, x, y).backward()
    intrinsic = meter.copy_bytes
    for v, (model, opt) in runs.items():
        meter = _variant_meter()
        with debug_counter() as counter, meter:
            _step(name, model, opt, warmup + steps, rank)
        out[v] |= {"copy_bytes": meter.copy_bytes - intrinsic,
                   "comm_bytes": comm_bytes(meter, None if v == "fsdp2" else counter),
                   "model_copy_bytes": intrinsic, "moe_layer": _layer_buffer(name, v, model)}
        if v != "fsdp2":
            out[v]["debug_counter_copy_bytes"] = counter.copy_bytes
    return out


def _worker(rank: int, workdir: str, name: str, warmup: int, steps: int, setup: dict) -> dict:
    import torch
    import torch.distributed as dist

    from experiments._distributed import rendezvous

    globals().update(setup)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=rendezvous(workdir), rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=300))
    import torch_backend  # noqa: F401  (before the meter wraps torch.distributed, as torch_vs_fsdp2 does)
    from experiments.torch_vs_fsdp2 import _mark_collectives

    _mark_collectives()
    return _timing(name, rank, warmup, steps)


def _launch(name: str, warmup: int, steps: int) -> list[dict]:
    from experiments._distributed import spawn_ranks

    return spawn_ranks(WORLD, _worker, name, warmup, steps, _torch_setup())


def _torch_summary(ranks: list[dict]) -> dict:
    out = {}
    for v in VARIANTS:
        r0 = ranks[0][v]
        layer = [r[v]["moe_layer"] for r in ranks]
        out[v] = {"median_step_s": statistics.median(r0["step_s"]),
                  "copy_bytes_per_step": max(r[v]["copy_bytes"] for r in ranks),
                  "comm_bytes_per_step": r0["comm_bytes"],
                  "moe_layer_buffer_numel": max(x["buffer_numel"] for x in layer),
                  "moe_layer_padding": 1 - min(x["used_numel"] / x["buffer_numel"] for x in layer),
                  "losses": r0["losses"]}
        if "debug_counter_copy_bytes" in r0:
            out[v]["debug_counter_copy_bytes"] = r0["debug_counter_copy_bytes"]
        out[v]["step_time_ratio_over_fsdp2"] = out[v]["median_step_s"] / statistics.median(
            ranks[0]["fsdp2"]["step_s"])
        out[v]["max_loss_difference_from_fsdp2"] = max(
            abs(a - b) for a, b in zip(r0["losses"], ranks[0]["fsdp2"]["losses"]))
    out["model_copy_bytes_subtracted"] = ranks[0]["ours"]["model_copy_bytes"]
    return out


def _torch_markdown(s: dict) -> str:
    rows = [("median step time", lambda r: f"{r['median_step_s'] * 1e3:.1f} ms"),
            ("step time / FSDP2", lambda r: f"{r['step_time_ratio_over_fsdp2']:.3f}"),
            ("bytes copied outside collectives / step", lambda r: f"{r['copy_bytes_per_step']:,}"),
            ("all-gather bytes / step", lambda r: f"{r['comm_bytes_per_step']['all_gather']:,}"),
            ("reduce-scatter bytes / step", lambda r: f"{r['comm_bytes_per_step']['reduce_scatter']:,}"),
            ("all-to-all bytes sent / step", lambda r: f"{r['comm_bytes_per_step']['all_to_all']:,}"),
            ("MoE layer all-gather buffer (fp32 elements)", lambda r: f"{r['moe_layer_buffer_numel']:,}"),
            ("MoE layer padding", lambda r: f"{r['moe_layer_padding']:.2%}"),
            ("largest loss difference from FSDP2 (rank 0)",
             lambda r: f"{r['max_loss_difference_from_fsdp2']:.1e}")]
    text = [f"## Torch, {s['world']} gloo processes (CPU), fp32, AdamW, {s['batch_per_rank'][0]} x "
            f"{s['batch_per_rank'][1]} tokens per rank, {s['steps']} timed steps after {s['warmup']}", "",
            f"ours+ep: `expert_parallel` on (ep, fsdp) = ({s['ep']}, {s['world'] // s['ep']}), then "
            "`parallelize`; the MoE layer's buffer is then its layer unit plus its experts unit (E/ep "
            "experts over the fsdp ranks). Rank 0's times; copies and buffers the largest over ranks. "
            "Copies: torch_vs_fsdp2's meter (copy ops outside collective calls) minus the plain model's own; "
            "expert parallelism's token gather and `index_add` are its dispatch, not copies, and are not "
            "counted. Load average (1, 5, 15 min) before "
            + ", ".join(f"{x:.1f}" for x in s["load_average"]["before"]) + ", after "
            + ", ".join(f"{x:.1f}" for x in s["load_average"]["after"])
            + f" on {os.cpu_count()} CPUs: above the CPU count the step times are noisy."]
    for name in TORCH_MODELS:
        m = s[name]
        text += ["", f"### {name}", "", "| metric | " + " | ".join(VARIANTS) + " |",
                 "|---|" + "---|" * len(VARIANTS),
                 *[f"| {label} | " + " | ".join(fmt(m[v]) for v in VARIANTS) + " |" for label, fmt in rows]]
    return "\n".join(text) + "\n"


# ---- JAX part ----------------------------------------------------------------------------------------------

def _jax_part(out: Path) -> None:
    """experiments/_moe_vs_fsdp2_jax.py in a fresh interpreter, writing ``<out>_jax.{json,md}``."""
    stem = out.resolve().with_name(out.name + "_jax")
    cmd = [sys.executable, "-m", "experiments._moe_vs_fsdp2_jax", "--out", str(stem)]
    subprocess.run(cmd, cwd=Path(__file__).parent.parent, check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("all", "core", "torch", "jax"), default="all")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default="moe_vs_fsdp2",
                        help="results file stem, under experiments/results unless it is a path")
    args = parser.parse_args()
    out = Path(args.out) if "/" in args.out else RESULTS / args.out
    if args.part == "jax":  # its own files only: moe_vs_fsdp2.{json,md} keep the core and torch parts
        _jax_part(out)
        return
    t0 = time.perf_counter()
    summary: dict = {}
    text = ("# Mixture-of-experts: ragged FSDP (+ EP) vs PyTorch FSDP2 (`python -m experiments.moe_vs_fsdp2 "
            f"--part {args.part}`)\n\n")
    if args.part in ("all", "core"):
        summary["cliff"] = cliff()
        text += _cliff_markdown(summary["cliff"])
    if args.part in ("all", "torch"):
        import torch

        os.environ.setdefault("OMP_NUM_THREADS", "1")
        load_before = os.getloadavg()
        summary["torch"] = {"world": WORLD, "ep": EP, "batch_per_rank": [BATCH, SEQ], "warmup": args.warmup,
                            "steps": args.steps, "torch": torch.__version__,
                            **{name: _torch_summary(_launch(name, args.warmup, args.steps))
                               for name in TORCH_MODELS}}
        summary["torch"]["load_average"] = {"before": load_before, "after": os.getloadavg()}
        text += "\n" + _torch_markdown(summary["torch"])
    summary["wall_s"] = time.perf_counter() - t0
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_name(out.name + ".json").write_text(json.dumps(summary, indent=1))
    out.with_name(out.name + ".md").write_text(text)
    print(text)
    print(f"({summary['wall_s']:.0f} s)")
    if args.part == "all":
        _jax_part(out)


if __name__ == "__main__":
    main()
