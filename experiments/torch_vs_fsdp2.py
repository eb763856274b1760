"""ragged-fsdp's ``fully_shard`` against PyTorch FSDP2, side by side in one run on 4 gloo processes.

Same model, data, seed and optimizer (AdamW) for both, two models in one run: the project's llama (a bit
larger than llama-tiny, so that collectives and copies are not lost in the per-op overhead; both wrap
tok_embeddings, each block, [norm, output] and the root) and a HuggingFace ``LlamaForCausalLM`` of the
same shapes with untied embeddings (built in code, nothing downloaded; both wrap each decoder layer and
the root, the rule a user applies to their own model). ``reshard_after_forward=True``. Measured per rank:

- step time (forward, backward, optimizer), median over steps after a warm-up; the two runtimes
  alternate step by step in one process group so they see the same machine load;
- bytes copied outside collectives per step: a dispatch-mode meter counts the bytes written by copy ops
  (copy_, cat, clone, split_with_sizes_copy, chunk_cat, FSDP2's copy-in, ...) outside the collective
  calls, minus what the plain model's own forward/backward copies on the same batch;
- all-gather and reduce-scatter bytes (padding included): FSDP2's from the c10d ops the same meter sees,
  ours from its debug counter (on gloo ours moves them by one broadcast per shard and an all-to-all, which
  are not c10d all-gathers or reduce-scatters; the counter counts whole buffers, as FSDP2's c10d ops do);
- peak memory per rank: peak RSS minus RSS before building the model, each runtime in its own launch
  (glibc is told to mmap every allocation above 64 KiB, so freed tensors leave the RSS); on CUDA the
  peak of ``torch.cuda.max_memory_allocated`` above what was allocated before building;
- compiled: ``torch.compile`` (inductor) of the whole project llama on both, step times alternating as
  above after compiling, and the graphs and graph breaks dynamo made (rank 0);
- on CUDA only, the same device-memory peak and step time with ``offload_policy=CPUOffloadPolicy()`` on
  both (sharded parameters, gradients and AdamW state on the host). On CPU the row is skipped, saying
  so: offloading to the host from the host moves nothing, and RSS cannot tell device memory apart.

With ``--tp 2`` both models run on a ``(dp, tp) = (world / 2, 2)`` mesh, tensor parallelism first and
FSDP on ``mesh["dp"]`` after (torchtitan's order), on both runtimes: the project llama with
``apply_tensor_parallel`` (torchtitan's llama3 plan, sequence parallel included), the HF Llama with
``apply_hf_llama_tensor_parallel``; the TP ranks of a dp rank share its batch. Copies are then counted
above the TP-only model's own (TP's redistributions copy too, alike under both runtimes), and FSDP2's
copy-in/out (its ``fsdp::`` ops) get a row of their own; the collective rows stay FSDP's, on the dp
mesh. No compiled row with TP.

    python -m experiments.torch_vs_fsdp2     # writes experiments/results/torch_vs_fsdp2.{json,md}
    python -m experiments.torch_vs_fsdp2 --tp 2 --no-compiled   # experiments/results/torch_vs_fsdp2_tp2.*
    python -m experiments.torch_vs_fsdp2 --device cuda --world 1 --model llama3.2-1b --dtype bf16 \
        --batch 4 --seq 2048 --out gpu_torch_vs_fsdp2     # one GPU, NCCL
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from experiments._distributed import rendezvous, spawn_ranks
from ragged.models import LlamaConfig, flops_per_token, trained_llama, trained_model_names

# The run's settings; ``--world/--model/--batch/--seq/--device/--dtype`` replace them (in every worker).
WORLD = 4
TP = 1  # the tensor-parallel degree: > 1 runs on a (dp, tp) mesh (--tp)
CONFIG = LlamaConfig(vocab_size=8192, dim=256, n_layers=6, n_heads=8, n_kv_heads=2, head_dim=32, ffn_dim=704)
BATCH, SEQ = 4, 64  # per rank
DEVICE, DTYPE = "cpu", "fp32"
RESULTS = Path(__file__).parent / "results"
MODELS = ("llama", "hf_llama")
_COPY_OPS = {"copy_", "_to_copy", "clone", "cat", "stack", "split_with_sizes_copy", "_chunk_cat",
             "_foreach_copy_", "slice_scatter", "as_strided_scatter", "index_copy_", "index_copy"}
_OUR_COLLECTIVES = os.path.join("torch_backend", "_collectives.py")  # behind torch_backend.collectives
_COLLECTIVE_FNS = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_gather_single",
                   "reduce_scatter_single")


class Meter(TorchDispatchMode):
    """Counts bytes written by copy ops outside collective calls, and the bytes collectives move."""

    depth = 0  # > 0 while inside a torch.distributed collective call (its internal copies are its own)

    def __init__(self) -> None:
        super().__init__()
        self.copy_bytes = 0
        self.copy_bytes_by_op: Counter = Counter()  # the same bytes, per op name
        self.comm = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        ns, name = func._schema.name.split("::")
        if ns == "c10d":
            if name.startswith("_allgather_base"):
                self.comm["all_gather"] += _nbytes(args[0])
            elif name.startswith("_reduce_scatter_base"):
                self.comm["reduce_scatter"] += _nbytes(args[1])
            elif name.startswith("allreduce"):
                self.comm["all_reduce"] += _nbytes(args[0])
        elif Meter.depth == 0 and (ns == "fsdp" or name in _COPY_OPS) and not _issued_by_our_collectives():
            if name == "all_gather_copy_in":  # FSDP2's copy-in writes the all-gather input (out[0])
                nbytes = _nbytes(out[0])
            elif "out" in kwargs:
                nbytes = _nbytes(kwargs["out"])
            elif name.endswith("_"):
                nbytes = _nbytes(args[0])
            else:
                nbytes = _nbytes(out)
            self.copy_bytes += nbytes
            self.copy_bytes_by_op[f"{ns}::{name}"] += nbytes
        return out


def comm_bytes(meter: Meter, counter) -> dict:
    """The bytes of a metered step's collectives, by kind: FSDP2's from the c10d ops the meter saw, ours
    (``counter``: its debug counter, None for FSDP2) from the counter. On gloo ours moves its buffers by
    one broadcast per shard and an all-to-all, not c10d all-gathers or reduce-scatters; the counter counts
    the whole buffers, as FSDP2's c10d ops do."""
    if counter is None:
        return dict(meter.comm)
    return meter.comm | {k: counter.bytes[k] for k in ("all_gather", "reduce_scatter", "all_reduce")}


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


def _issued_by_our_collectives() -> bool:
    """The op runs inside one of ``torch_backend.collectives``' calls (the gloo all-gather's copy of this
    rank's own shard into its slice of the gathered buffer: the part of an all-gather no peer sends, which
    gloo's own all-gather copies too, inside its C++)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.endswith(_OUR_COLLECTIVES):
            return True
        frame = frame.f_back
    return False


def _inside_collective(fn):
    def wrapped(*args, **kwargs):
        Meter.depth += 1
        try:
            return fn(*args, **kwargs)
        finally:
            Meter.depth -= 1

    return wrapped


def _mark_collectives() -> None:
    """Wrap torch.distributed's collective calls and ``Work.wait`` (gloo finishes a reduce-scatter with a
    copy into the output when it is waited on) so the meter leaves the copies inside them out."""
    for fn_name in _COLLECTIVE_FNS:
        fn = getattr(dist, fn_name, None)
        if fn is not None:
            setattr(dist, fn_name, _inside_collective(fn))
            setattr(dist.distributed_c10d, fn_name, _inside_collective(fn))
    dist.Work.wait = _inside_collective(dist.Work.wait)


def _mmap_big_allocations() -> None:
    """glibc maps every allocation above 64 KiB on its own (``mallopt(M_MMAP_THRESHOLD)``), so a freed
    tensor leaves the RSS at once and peak RSS measures the peak of live tensors. Memory launches only: it
    makes every large allocation page-fault afresh (about 1.5x the step time of either runtime on 2 cores),
    which no user's training process does."""
    import ctypes

    m_mmap_threshold = -3  # glibc's malloc.h
    if not ctypes.CDLL("libc.so.6").mallopt(m_mmap_threshold, 64 * 1024):
        raise RuntimeError("mallopt(M_MMAP_THRESHOLD) failed: peak RSS would not measure live tensors")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _plain(name: str) -> torch.nn.Module:
    """The unsharded model ``name`` on the run's device, initialised from seed 0."""
    if name == "llama":
        from torch_backend.models import Llama

        with torch.device(_device()):
            model = Llama(CONFIG)
        model.init_weights(0)
        return model
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(_device()):
        return LlamaForCausalLM(HFLlamaConfig(
            vocab_size=CONFIG.vocab_size, hidden_size=CONFIG.dim, intermediate_size=CONFIG.ffn_dim,
            num_hidden_layers=CONFIG.n_layers, num_attention_heads=CONFIG.n_heads,
            num_key_value_heads=CONFIG.n_kv_heads, head_dim=CONFIG.head_dim, max_position_embeddings=SEQ,
            tie_word_embeddings=False, attn_implementation="sdpa"))


def _build(name: str, kind: str, mesh, offload: bool = False):
    from torch.distributed.fsdp import CPUOffloadPolicy
    from torch.distributed.fsdp import MixedPrecisionPolicy as FSDP2Policy
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    from torch_backend import MixedPrecisionPolicy, fully_shard
    from torch_backend.models import parallelize

    model = _plain(name)
    if TP > 1:  # TP first, then FSDP on the data-parallel dim (torchtitan's order)
        _tensor_parallel(name, model, mesh)
        mesh = mesh["dp"]
    dtypes = (torch.bfloat16, torch.float32) if DTYPE == "bf16" else (None, None)
    ours = dict(mesh=mesh, mp_policy=MixedPrecisionPolicy(*dtypes))
    theirs = dict(mesh=mesh, mp_policy=FSDP2Policy(*dtypes))
    if offload:
        ours["offload_policy"] = theirs["offload_policy"] = CPUOffloadPolicy()
    if name == "llama" and kind == "ours":
        parallelize(model, **ours)
    elif name == "llama":
        fsdp2_fully_shard(model.tok_embeddings, **theirs)
        for layer in model.layers:
            fsdp2_fully_shard(layer, **theirs)
        fsdp2_fully_shard([model.norm, model.output], **theirs)
        fsdp2_fully_shard(model, **theirs)
    else:
        shard, kwargs = (fully_shard, ours) if kind == "ours" else (fsdp2_fully_shard, theirs)
        for layer in model.model.layers:
            shard(layer, **kwargs)
        shard(model, **kwargs)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _tensor_parallel(name: str, model: torch.nn.Module, mesh) -> torch.nn.Module:
    """Split ``model``'s weights over ``mesh["tp"]`` with its TP plan, the logits gathered as the results
    were measured (loss parallel changes ours and FSDP2 + TP alike)."""
    from torch_backend.models import apply_hf_llama_tensor_parallel, apply_tensor_parallel

    plan = apply_tensor_parallel if name == "llama" else apply_hf_llama_tensor_parallel
    return plan(model, mesh["tp"], loss_parallel=False)


def _batch_rank(mesh) -> int:
    """Whose rows this rank trains on: its own, or under TP its dp rank's (its TP ranks share them)."""
    return mesh.get_local_rank("dp") if TP > 1 else dist.get_rank()


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 100 + rank)
    tokens = torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ + 1), generator=g).to(_device())
    return tokens[:, :-1], tokens[:, 1:]


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if DEVICE == "cuda" else torch.device("cpu")


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _loss(model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    from torch_backend.models import cross_entropy

    out = model(x)
    return cross_entropy(getattr(out, "logits", out), y)  # HuggingFace models return an output object


def _step(model, opt, step: int, rank: int) -> tuple[float, float]:
    """One training step; returns (loss, seconds of forward+backward)."""
    x, y = _batch(step, rank)
    t0 = time.perf_counter()
    loss = _loss(model, x, y)
    loss.backward()
    _sync()
    fwd_bwd = time.perf_counter() - t0
    opt.step()
    opt.zero_grad()
    return loss.item(), fwd_bwd


def _metered(fn) -> Meter:
    meter = Meter()
    with meter:
        fn()
    return meter


def _timing(name: str, mesh, warmup: int, steps: int) -> dict:
    from torch_backend import debug_counter

    runs = {kind: _build(name, kind, mesh) for kind in ("fsdp2", "ours")}
    rows = _batch_rank(mesh)
    out = {kind: {"step_s": [], "fwd_bwd_s": [], "losses": []} for kind in runs}
    for step in range(warmup + steps):
        for kind, (model, opt) in runs.items():  # alternate, so both see the same load
            dist.barrier()
            t0 = time.perf_counter()
            loss, fwd_bwd = _step(model, opt, step, rows)
            elapsed = time.perf_counter() - t0
            out[kind]["losses"].append(loss)
            if step >= warmup:
                out[kind]["step_s"].append(elapsed)
                out[kind]["fwd_bwd_s"].append(fwd_bwd)
    # Copies and communication of one more step each (the meter slows ops down, so it is not timed).
    plain = _tensor_parallel(name, _plain(name), mesh) if TP > 1 else _plain(name)
    x, y = _batch(warmup + steps, rows)
    model_meter = _metered(lambda: _loss(plain, x, y).backward())
    intrinsic = model_meter.copy_bytes
    for kind, (model, opt) in runs.items():
        with debug_counter() as counter:
            meter = _metered(lambda m=model, o=opt: _step(m, o, warmup + steps, rows))
        counter = counter if kind == "ours" else None
        by_op = {op: n - model_meter.copy_bytes_by_op[op] for op, n in meter.copy_bytes_by_op.items()}
        out[kind] |= {"copy_bytes": meter.copy_bytes - intrinsic, "comm_bytes": comm_bytes(meter, counter),
                      "copy_bytes_by_op": {op: n for op, n in by_op.items() if n},
                      "model_copy_bytes": intrinsic}
        if counter is not None:
            calls = {f"{k}:{u}": n for (k, u), n in counter.calls.items()}
            out[kind]["debug_counter"] = {"collectives": calls, "bytes": dict(counter.bytes),
                                          "copy_bytes": counter.copy_bytes}
    return out


def _compiled(rank: int, mesh, warmup: int, steps: int) -> dict:
    """Both runtimes on the project llama under ``torch.compile``: median step times and graph counts."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    out = {}
    runs = {}
    for kind in ("fsdp2", "ours"):
        torch._dynamo.reset()
        counters.clear()
        model, opt = _build("llama", kind, mesh)
        compiled = torch.compile(model)
        t0 = time.perf_counter()
        _step(compiled, opt, 0, rank)  # compiles forward and backward
        out[kind] = {"compile_step_s": time.perf_counter() - t0, "step_s": [], "losses": [],
                     "graphs": counters["stats"]["unique_graphs"],
                     "graph_breaks": sum(counters["graph_break"].values())}
        runs[kind] = (compiled, opt)
    for step in range(1, warmup + steps):
        for kind, (model, opt) in runs.items():
            dist.barrier()
            t0 = time.perf_counter()
            loss, _ = _step(model, opt, step, rank)
            if step >= warmup:
                out[kind]["step_s"].append(time.perf_counter() - t0)
            out[kind]["losses"].append(loss)
    return out


def _memory(name: str, kind: str, mesh, steps: int, offload: bool = False) -> dict:
    rows = _batch_rank(mesh)
    if name != "llama":
        _plain(name)  # imports (transformers) before the baseline, so the memory counts the model only
    base = torch.cuda.memory_allocated() if DEVICE == "cuda" else _rss_bytes()
    model, opt = _build(name, kind, mesh, offload)
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        _step(model, opt, step, rows)
        times.append(time.perf_counter() - t0)
    if DEVICE == "cuda":
        return {"peak_rss_above_baseline": torch.cuda.max_memory_allocated() - base,
                "median_step_s": statistics.median(times[1:])}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"peak_rss_above_baseline": peak - base}


def _configure(setup: dict) -> None:
    """Replace the module's settings (the parent's arguments, handed to every spawned worker)."""
    globals().update(setup)


def _worker(rank: int, workdir: str, name: str, mode: str, kind: str, warmup: int, steps: int,
            setup: dict) -> dict:
    _configure(setup)
    torch.set_num_threads(1)
    if DEVICE == "cuda":
        torch.cuda.set_device(rank)
    elif mode == "memory":
        _mmap_big_allocations()
    dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo", init_method=rendezvous(workdir),
                            rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=120))
    from torch.distributed.device_mesh import init_device_mesh

    import torch_backend  # noqa: F401  (imported before _mark_collectives wraps torch.distributed, as in the recorded runs)

    _mark_collectives()
    mesh = (init_device_mesh(DEVICE, (WORLD // TP, TP), mesh_dim_names=("dp", "tp")) if TP > 1
            else init_device_mesh(DEVICE, (WORLD,)))
    if mode == "timing":
        result = _timing(name, mesh, warmup, steps)
    elif mode == "compiled":
        result = _compiled(rank, mesh, warmup, steps)
    else:
        result = _memory(name, kind, mesh, warmup + steps, offload=mode == "offload")
    return result


def _launch(name: str, mode: str, kind: str, warmup: int, steps: int) -> list[dict]:
    setup = dict(WORLD=WORLD, TP=TP, CONFIG=CONFIG, BATCH=BATCH, SEQ=SEQ, DEVICE=DEVICE, DTYPE=DTYPE)
    return spawn_ranks(WORLD, _worker, name, mode, kind, warmup, steps, setup, device=DEVICE)


def _summary(timing: list[dict], memory: dict[str, list[dict]]) -> dict:
    out = {"world": WORLD, "tp": TP, "config": CONFIG.__dict__, "batch_per_rank": [BATCH, SEQ],
           "torch": torch.__version__, "device": DEVICE, "dtype": DTYPE,
           "device_name": torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu",
           "tokens_per_step": WORLD // TP * BATCH * SEQ, "flops_per_token": flops_per_token(CONFIG, SEQ)}
    for kind in ("fsdp2", "ours"):
        r0 = timing[0][kind]
        out[kind] = {
            "median_step_s": statistics.median(r0["step_s"]),
            "median_fwd_bwd_s": statistics.median(r0["fwd_bwd_s"]),
            "copy_bytes_per_step": max(t[kind]["copy_bytes"] for t in timing),
            "copy_bytes_by_op": r0["copy_bytes_by_op"],
            "all_gather_bytes_per_step": r0["comm_bytes"]["all_gather"],
            "reduce_scatter_bytes_per_step": r0["comm_bytes"]["reduce_scatter"],
            "all_reduce_bytes_per_step": r0["comm_bytes"]["all_reduce"],
            "peak_memory_bytes_per_rank": [m["peak_rss_above_baseline"] for m in memory[kind]],
            "losses": r0["losses"],
        }
    out["ours"]["debug_counter"] = timing[0]["ours"]["debug_counter"]
    out["model_copy_bytes_subtracted"] = timing[0]["ours"]["model_copy_bytes"]
    out["step_time_ratio_ours_over_fsdp2"] = out["ours"]["median_step_s"] / out["fsdp2"]["median_step_s"]
    out["fwd_bwd_ratio_ours_over_fsdp2"] = out["ours"]["median_fwd_bwd_s"] / out["fsdp2"]["median_fwd_bwd_s"]
    pairs = zip(out["ours"]["losses"], out["fsdp2"]["losses"])
    out["max_loss_difference"] = max(abs(a - b) for a, b in pairs)
    return out


def _offload(warmup: int) -> dict:
    """CPU offload on both runtimes: device-memory peak and step time per rank (CUDA only)."""
    if DEVICE != "cuda":
        return {"skipped": "CPU offload is measured on CUDA only: on a CPU run the host is the device, "
                           "so nothing moves and RSS cannot separate device from host memory"}
    runs = {kind: _launch("llama", "offload", kind, warmup, 3) for kind in ("fsdp2", "ours")}
    return {kind: {"peak_device_bytes_per_rank": [r["peak_rss_above_baseline"] for r in res],
                   "median_step_s": res[0]["median_step_s"]} for kind, res in runs.items()}


def _compiled_summary(warmup: int, steps: int) -> dict:
    r0 = _launch("llama", "compiled", "both", warmup, steps)[0]
    out = {kind: {"median_step_s": statistics.median(r0[kind]["step_s"]), "graphs": r0[kind]["graphs"],
                  "graph_breaks": r0[kind]["graph_breaks"], "first_step_s": r0[kind]["compile_step_s"],
                  "losses": r0[kind]["losses"]} for kind in ("fsdp2", "ours")}
    out["step_time_ratio_ours_over_fsdp2"] = out["ours"]["median_step_s"] / out["fsdp2"]["median_step_s"]
    pairs = zip(out["ours"]["losses"], out["fsdp2"]["losses"])
    out["max_loss_difference"] = max(abs(a - b) for a, b in pairs)
    return out


def _compiled_table(s: dict) -> str:
    c = s.get("compiled")
    if c is None:
        return ""
    rows = [("median step time", lambda r: f"{r['median_step_s'] * 1e3:.1f} ms"),
            ("first step (compiling)", lambda r: f"{r['first_step_s']:.1f} s"),
            ("graphs compiled (unique)", lambda r: str(r["graphs"])),
            ("graph breaks", lambda r: str(r["graph_breaks"]))]
    return ("\n## `torch.compile(model)` (inductor), the project llama\n\n| metric | FSDP2 | ours |\n"
            "|---|---|---|\n" + "".join(f"| {n} | {f(c['fsdp2'])} | {f(c['ours'])} |\n" for n, f in rows)
            + f"\nStep time ratio (ours / FSDP2): **{c['step_time_ratio_ours_over_fsdp2']:.3f}**; largest "
            f"loss difference {c['max_loss_difference']:.2e}. The hooks of both run eagerly, outside the "
            "graphs.\n")


def _offload_table(s: dict) -> str:
    o = s.get("offload")
    if o is None:
        return ""
    if "skipped" in o:
        return f"\n## CPU offload (`CPUOffloadPolicy()` on both)\n\nSkipped: {o['skipped']}.\n"
    kinds = ("fsdp2", "ours")
    peaks = [", ".join(f"{b / 2**20:.2f} MiB" for b in o[k]["peak_device_bytes_per_rank"]) for k in kinds]
    steps = [f"{o[k]['median_step_s'] * 1e3:.1f} ms" for k in kinds]
    return ("\n## CPU offload (`CPUOffloadPolicy()` on both)\n\n| metric | FSDP2 | ours |\n|---|---|---|\n"
            f"| peak device memory per rank | {' | '.join(peaks)} |\n"
            f"| median step time | {' | '.join(steps)} |\n")


def _markdown(s: dict) -> str:
    tp = s["tp"] > 1
    text = _table(s, "project llama; " + ("torchtitan's llama3 TP plan (`apply_tensor_parallel`, sequence "
                                          "parallel), then " if tp else "")
                  + "wraps tok_embeddings, each block, [norm, output], root")
    text += _compiled_table(s) + _offload_table(s)
    if "hf_llama" in s:
        text += ("\n## HuggingFace LlamaForCausalLM (untied), the same shapes\n\n"
                 + _table(s["hf_llama"], "transformers LlamaForCausalLM (tie_word_embeddings=False, sdpa); "
                          + ("torchtitan-style TP plan (`apply_hf_llama_tensor_parallel`, no sequence "
                             "parallel), then " if tp else "")
                          + "wraps each decoder layer and the root", heading=False))
    if "load_average" in s:
        load = {k: ", ".join(f"{x:.1f}" for x in v) for k, v in s["load_average"].items() if k != "cpus"}
        text += (f"\nMachine load (1, 5, 15-minute load averages) at the start: {load['start']}, at the end: "
                 f"{load['end']}, on {s['load_average']['cpus']} CPUs. The two runtimes alternate step by "
                 "step, so both see the same load, but a loaded machine makes the step times and their ratio "
                 "noisy.\n")
    return text


def _fsdp_copy_bytes(r: dict) -> int:
    """Bytes FSDP2's own copy ops wrote in the metered step (copy-in, copy-out, the gradients' ``chunk_cat``):
    the ``fsdp::`` ops of the meter's per-op count (rank 0)."""
    return sum(n for op, n in r["copy_bytes_by_op"].items() if op.startswith("fsdp::"))


def _table(s: dict, model: str, heading: bool = True) -> str:
    mib = lambda b: f"{b / 2**20:.2f} MiB"  # noqa: E731
    tp = s["tp"] > 1
    rows = [
        ("median step time (fwd+bwd+AdamW)", lambda r: f"{r['median_step_s'] * 1e3:.1f} ms"),
        ("median forward+backward", lambda r: f"{r['median_fwd_bwd_s'] * 1e3:.1f} ms"),
        ("bytes copied outside collectives / step", lambda r: f"{r['copy_bytes_per_step']:,}"),
        *([("of which FSDP2's copy-in/out (`fsdp::` ops)", lambda r: f"{_fsdp_copy_bytes(r):,}")]
          if tp else []),
        ("all-gather bytes / step (padding incl.)", lambda r: f"{r['all_gather_bytes_per_step']:,}"),
        ("reduce-scatter bytes / step (padding incl.)", lambda r: f"{r['reduce_scatter_bytes_per_step']:,}"),
        ("peak memory per rank (RSS above baseline)",
         lambda r: ", ".join(mib(b) for b in r["peak_memory_bytes_per_rank"])),
    ]
    c = s["config"]
    mesh = f"mesh (dp {s['world'] // s['tp']}, tp {s['tp']}), " if tp else ""
    lines = [
        *([f"# ragged-fsdp `fully_shard` vs PyTorch FSDP2{' + TP' if tp else ''} ({s['world']} "
            f"{'NCCL' if s['device'] == 'cuda' else 'gloo'} processes, {mesh}{s['device_name']}, "
            f"{s['dtype']})", ""] if heading else []),
        f"torch {s['torch']}; {model}; vocab {c['vocab_size']}, dim {c['dim']}, {c['n_layers']} layers, "
        f"{c['n_heads']} heads ({c['n_kv_heads']} kv), ffn {c['ffn_dim']}; batch {s['batch_per_rank'][0]} x "
        f"{s['batch_per_rank'][1]} tokens per {'dp ' if tp else ''}rank; reshard_after_forward=True; AdamW.",
        "",
        "| metric | FSDP2 | ours |",
        "|---|---|---|",
        *[f"| {name} | {fmt(s['fsdp2'])} | {fmt(s['ours'])} |" for name, fmt in rows],
        "",
        f"Step time ratio (ours / FSDP2): **{s['step_time_ratio_ours_over_fsdp2']:.3f}** "
        f"(forward+backward only: {s['fwd_bwd_ratio_ours_over_fsdp2']:.3f}). "
        f"Largest loss difference between the two runs: {s['max_loss_difference']:.2e}.",
        "",
        f"Copy bytes are counted by a dispatch-mode meter (copy ops outside collective calls) minus the "
        f"{s['model_copy_bytes_subtracted']:,} bytes the {'TP-only' if tp else 'plain'} model itself copies "
        "in one forward+backward. "
        "Ours lands gradients by autograd's in-place accumulation into a zeroed gradient buffer (a fill "
        "and an add, no copy); FSDP2 steals each gradient and copies it into the reduce-scatter input.",
        *(["", "With TP, FSDP2's copies beyond its `fsdp::` ops are DTensor redistributions of gradients "
           "whose placement is not the parameter's (the vocabulary-split embedding's gradient comes back "
           "replicated; FSDP2 redistributes it, which slices and clones this rank's rows). Ours makes the "
           "same redistribution inside the in-place add that lands that gradient: a DTensor op, whose local "
           "copies the dispatch-mode meter does not see (torch.profiler shows the same `aten::clone` in "
           "both)."] if tp else []),
        "",
        "Debug counter of ours for the metered step: "
        f"`{json.dumps(s['ours']['debug_counter']['bytes'])}`, copy bytes "
        f"{s['ours']['debug_counter']['copy_bytes']}.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--world", type=int, default=WORLD)
    parser.add_argument("--tp", type=int, default=TP,
                        help="tensor-parallel degree: > 1 runs TP then FSDP on a (world / tp, tp) mesh")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--model", choices=trained_model_names(), help="default: the llama above")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="compute dtype")
    parser.add_argument("--batch", type=int, default=BATCH, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=SEQ)
    parser.add_argument("--models", default=",".join(MODELS),
                        help="comma-separated subset of: " + ", ".join(MODELS))
    parser.add_argument("--no-compiled", dest="compiled", action="store_false",
                        help="skip the torch.compile rows (inductor compiles for minutes on CPU)")
    parser.add_argument("--out", help="results file stem, under experiments/results unless it is a path "
                                      "(default: torch_vs_fsdp2, with --tp N: torch_vs_fsdp2_tpN)")
    args = parser.parse_args()
    if "llama" not in args.models.split(",") or not set(args.models.split(",")) <= set(MODELS):
        parser.error(f"--models must include llama and name only {MODELS}, got {args.models!r}")
    if args.tp < 1 or args.world % args.tp or args.seq % args.tp:
        parser.error(f"--tp {args.tp} must divide --world {args.world} and --seq {args.seq} (sequence "
                     "parallel splits the sequence)")
    if args.tp > 1 and args.compiled:
        parser.error("--tp > 1 has no compiled rows: pass --no-compiled")
    config = trained_llama(args.model)[0] if args.model else CONFIG
    _configure(dict(WORLD=args.world, TP=args.tp, CONFIG=config, BATCH=args.batch, SEQ=args.seq,
                    DEVICE=args.device, DTYPE=args.dtype))
    load_start = os.getloadavg()
    t0 = time.perf_counter()
    summaries = {}
    for name in args.models.split(","):
        timing = _launch(name, "timing", "both", args.warmup, args.steps)
        memory = {kind: _launch(name, "memory", kind, args.warmup, 3) for kind in ("fsdp2", "ours")}
        summaries[name] = _summary(timing, memory)
    if args.compiled:
        summaries["llama"]["compiled"] = _compiled_summary(args.warmup, args.steps)
    summaries["llama"]["offload"] = _offload(args.warmup)
    summary = summaries["llama"] | {name: summaries[name] for name in summaries if name != "llama"}
    summary["wall_s"] = time.perf_counter() - t0
    summary["load_average"] = {"start": load_start, "end": os.getloadavg(), "cpus": os.cpu_count()}
    stem = args.out or ("torch_vs_fsdp2" + (f"_tp{args.tp}" if args.tp > 1 else ""))
    out = Path(stem) if "/" in stem else RESULTS / stem
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_name(out.name + ".json").write_text(json.dumps(summary, indent=1))
    out.with_name(out.name + ".md").write_text(_markdown(summary))
    print(_markdown(summary))
    print(f"({summary['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
