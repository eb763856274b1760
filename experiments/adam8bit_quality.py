"""8-bit Adam against fp32 AdamW and torchao's AdamW8bit on a real-text character language model.

A 1.7M-parameter llama (``torch_backend.models.Llama``: dim 192, 4 layers, 6 query / 3 kv heads, FFN 512,
every matrix 32x32-tiled) learns the next byte of Python's own standard library source (a fixed list of
modules shipped with the interpreter, nothing downloaded): the last 10% of the text is held out for
validation. Every optimizer starts from the same initial weights and sees the same batches, with the
same schedule (linear warmup, then cosine to 10% of the peak), betas (0.9, 0.95) and weight decay 0.1:

- ``fp32``: ``torch.optim.AdamW`` (fp32 moments, the reference);
- ``ours``: ``torch_backend.optim.Adam8bit`` (dynamic codebooks on 32x32 tiles);
- ``torchao``: ``torchao.optim.AdamW8bit`` (dynamic codebooks on 256-element blocks, compiled;
  tensors under 4096 elements stay fp32). bitsandbytes is not installed, so it is not run.

The runs advance in lockstep (one step of each optimizer in turn on the same batch), so machine load hits
them alike; the optimizer step time is the median over steps of ``opt.step()`` alone.

    python -m experiments.adam8bit_quality    # writes experiments/results/adam8bit_quality.{md,json,png}
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import multiprocessing
import statistics
import sysconfig
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import torch

from ragged.models import LlamaConfig
from torch_backend.models import Llama, cross_entropy
from torch_backend.optim import Adam8bit

RESULTS = Path(__file__).parent / "results"
CONFIG = LlamaConfig(vocab_size=256, dim=192, n_layers=4, n_heads=6, n_kv_heads=3, head_dim=32, ffn_dim=512)
# Modules of the standard library whose source is the corpus (about 1.5 MB of English prose and code).
MODULES = ("argparse", "inspect", "dataclasses", "typing", "subprocess", "pathlib", "logging", "collections",
           "functools", "enum", "tarfile", "shutil", "email.message", "http.client", "urllib.request",
           "json.decoder", "unittest.case", "doctest", "pydoc", "textwrap")
BETAS, WEIGHT_DECAY = (0.9, 0.95), 0.1
OPTIMIZERS = ("fp32", "ours", "torchao")


def stdlib_text(modules: tuple[str, ...] = MODULES) -> bytes:
    """The concatenated source of ``modules`` from this interpreter's standard library."""
    return b"\n".join(Path(importlib.util.find_spec(m).origin).read_bytes() for m in modules)


def split(text: bytes, held_out: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """Byte ids of the training text and of the held-out tail."""
    ids = torch.from_numpy(np.frombuffer(text, dtype=np.uint8).astype(np.int64))
    cut = int(len(ids) * (1 - held_out))
    return ids[:cut], ids[cut:]


def batches(ids: torch.Tensor, count: int, batch: int, seq: int, seed: int) -> torch.Tensor:
    """``count`` batches of random windows ``(count, batch, seq + 1)`` (seeded)."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(ids) - seq - 1, (count, batch), generator=g)
    return ids[starts[..., None] + torch.arange(seq + 1)]


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warmup to ``peak``, then cosine decay to ``peak / 10`` at the last step."""
    if step < warmup:
        return peak * (step + 1) / warmup
    done = (step - warmup) / max(1, steps - warmup - 1)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * done)))


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for group in opt.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)  # torchao keeps the learning rate as a tensor (no recompiles)
        else:
            group["lr"] = lr


def make_optimizer(kind: str, model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    kw = dict(lr=lr, betas=BETAS, weight_decay=WEIGHT_DECAY)
    if kind == "fp32":
        return torch.optim.AdamW(model.parameters(), **kw)
    if kind == "ours":
        return Adam8bit(model.named_parameters(), **kw)
    if kind == "torchao":
        from torchao.optim import AdamW8bit

        return AdamW8bit(model.parameters(), **kw)
    raise ValueError(f"unknown optimizer {kind!r}; expected one of {OPTIMIZERS}")


def state_bytes_per_param(opt: torch.optim.Optimizer, model: torch.nn.Module) -> float:
    """Bytes of every tensor in the optimizer state (codes, scales, moments; not step counters)."""
    total = 0
    for state in opt.state.values():
        for t in state.values():
            if isinstance(t, torch.Tensor) and t.numel() > 1:
                parts = [getattr(t, a) for a in ("codes", "scale")] if hasattr(t, "codes") else [t]
                total += sum(p.numel() * p.element_size() for p in parts)
    return total / sum(p.numel() for p in model.parameters())


@torch.no_grad()
def evaluate(model: torch.nn.Module, val: torch.Tensor) -> float:
    return statistics.fmean(cross_entropy(model(b[:, :-1]), b[:, 1:]).item() for b in val)


def train_lockstep(kinds: tuple[str, ...], config: LlamaConfig, train: torch.Tensor, val: torch.Tensor,
                   peak_lr: float, eval_every: int, make: Callable = make_optimizer, label: str = "") -> dict:
    """Train one model per optimizer kind from the same init on ``train`` (steps, batch, seq + 1).

    With a ``label``, every evaluation prints a progress line (the long runs take an hour).

    Returns:
        ``{kind: {"train": [...], "val": [(step, loss), ...], "step_s": [...], "state_bytes_per_param"}}``.
    """
    steps, warmup = len(train), max(1, len(train) // 10)
    runs = {}
    for kind in kinds:
        torch.manual_seed(0)
        model = Llama(config)
        model.init_weights(seed=0)
        runs[kind] = dict(model=model, opt=make(kind, model, peak_lr), train=[], val=[], step_s=[])
    for step, b in enumerate(train):
        for run in runs.values():
            model, opt = run["model"], run["opt"]
            set_lr(opt, lr_at(step, steps, peak_lr, warmup))
            loss = cross_entropy(model(b[:, :-1]), b[:, 1:])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            t0 = time.perf_counter()
            opt.step()
            run["step_s"].append(time.perf_counter() - t0)
            run["train"].append(loss.item())
            if (step + 1) % eval_every == 0 or step + 1 == steps:
                run["val"].append((step + 1, evaluate(model, val)))
        if label and runs[kinds[-1]]["val"] and runs[kinds[-1]]["val"][-1][0] == step + 1:
            print(label, step + 1, {k: round(r["val"][-1][1], 4) for k, r in runs.items()}, flush=True)
    for run in runs.values():
        run["state_bytes_per_param"] = state_bytes_per_param(run["opt"], run["model"])
        del run["model"], run["opt"]
    return runs


def _gap(runs: dict, kind: str) -> float:
    """``kind``'s final validation loss against fp32 AdamW's, in percent."""
    return 100 * (runs[kind]["final_val"] / runs["fp32"]["final_val"] - 1)


def _markdown(summary: dict) -> str:
    a = summary["setup"]
    lines = [
        "# 8-bit Adam quality on a real-text character LM (`python -m experiments.adam8bit_quality`)",
        "",
        f"{a['params']:,}-parameter llama ({a['config']}), next byte of {a['corpus_bytes']:,} bytes of "
        f"CPython {a['python']} standard-library source ({len(MODULES)} modules), last 10% held out. "
        f"{a['steps']} steps of {a['batch']} x {a['seq']} bytes, warmup {a['warmup']} then cosine to 10%, "
        f"betas {BETAS}, weight decay {WEIGHT_DECAY}; validation loss is the mean over {a['val_batches']} "
        f"fixed held-out batches. Every (seed, lr) runs the optimizers in lockstep on the same batches from "
        f"the same init (the seed sets the data order), one process of one thread each, all in parallel; "
        f"wall time {summary['wall_s']:.0f} s. Step time: the median of `opt.step()` alone; ours / torchao "
        f"is the median over steps of the ratio of the two optimizers' times on the same step.",
        "",
        "| seed | lr | optimizer | final val loss | vs fp32 AdamW | state bytes / param "
        "| optimizer step (median) | step time / torchao's |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for seed, by_lr in summary["runs"].items():
        for lr, runs in by_lr.items():
            for kind, r in runs.items():
                lines.append(f"| {seed} | {lr} | {kind} | {r['final_val']:.4f} | {_gap(runs, kind):+.2f}% | "
                             f"{r['state_bytes_per_param']:.3f} | {1e3 * r['step_median_s']:.1f} ms | "
                             f"{r.get('step_ratio_to_torchao', float('nan')):.2f} |")
    seeds = list(summary["runs"])
    lines += ["", f"Mean over the seeds ({', '.join(seeds)}) of the gap to fp32 AdamW:", "",
              "| lr | " + " | ".join(k for k in next(iter(summary["runs"].values()))[a["lrs"][0]]) + " |",
              "|---|" + "---|" * len(OPTIMIZERS)]
    for lr in a["lrs"]:
        kinds = summary["runs"][seeds[0]][lr]
        means = [statistics.fmean(_gap(summary["runs"][s][lr], k) for s in seeds) for k in kinds]
        lines.append(f"| {lr} | " + " | ".join(f"{m:+.2f}%" for m in means) + " |")
    lines += ["", "Loss curves: `adam8bit_quality.png`."]
    return "\n".join(lines) + "\n"


def _plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [(seed, lr, runs) for seed, by_lr in summary["runs"].items() for lr, runs in by_lr.items()]
    fig, axes = plt.subplots(1, len(cells), figsize=(5 * len(cells), 4), squeeze=False)
    for ax, (seed, lr, runs) in zip(axes[0], cells):
        for kind, r in runs.items():
            train = np.convolve(r["train"], np.ones(50) / 50, mode="valid")
            line, = ax.plot(np.arange(len(train)) + 50, train, alpha=0.4, label=f"{kind} train (50-step avg)")
            steps, val = zip(*r["val"])
            ax.plot(steps, val, "o-", ms=3, color=line.get_color(), label=f"{kind} val")
        ax.set(title=f"seed {seed}, lr {lr}", xlabel="step", ylabel="cross entropy (nats / byte)",
               ylim=(1.0, 3.0))
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _run_one(job: tuple) -> dict:
    """One (seed, lr)'s lockstep runs, on one thread (the jobs run in parallel processes)."""
    torch.set_num_threads(1)
    kinds, train, val, lr, eval_every, label = job
    runs = train_lockstep(kinds, CONFIG, train, val, lr, eval_every, label=label)
    for r in runs.values():
        r["final_val"] = r["val"][-1][1]
        r["step_median_s"] = statistics.median(r["step_s"][5:] or r["step_s"])
    if "torchao" in runs:
        for r in runs.values():
            pairs = list(zip(r["step_s"], runs["torchao"]["step_s"]))[5:]
            r["step_ratio_to_torchao"] = statistics.median(mine / theirs for mine, theirs in pairs)
    for r in runs.values():
        del r["step_s"]
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--lrs", type=float, nargs="+", default=[3e-3, 1e-2])
    parser.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2], help="seeds of the data order")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    t0 = time.perf_counter()
    text = stdlib_text()
    train_ids, val_ids = split(text)
    val = batches(val_ids, 16, args.batch, args.seq, seed=2)
    lrs = [str(lr) for lr in args.lrs]
    summary = {"setup": dict(params=sum(p.numel() for p in Llama(CONFIG).parameters()), config=str(CONFIG),
                             corpus_bytes=len(text), python=sysconfig.get_python_version(), steps=args.steps,
                             batch=args.batch, seq=args.seq, seeds=args.seeds, lrs=lrs,
                             warmup=max(1, args.steps // 10), val_batches=16),
               "runs": {}}
    cells = [(seed, lr) for seed in args.seeds for lr in args.lrs]
    jobs = [(tuple(args.optimizers), batches(train_ids, args.steps, args.batch, args.seq, seed=seed), val, lr,
             max(1, args.steps // 10), f"seed {seed} lr {lr}:") for seed, lr in cells]
    with ProcessPoolExecutor(len(jobs), mp_context=multiprocessing.get_context("spawn")) as pool:
        for (seed, lr), runs in zip(cells, pool.map(_run_one, jobs)):
            summary["runs"].setdefault(str(seed), {})[str(lr)] = runs
            print(seed, lr, {k: round(r["final_val"], 4) for k, r in runs.items()}, flush=True)
    summary["wall_s"] = time.perf_counter() - t0
    args.out.mkdir(exist_ok=True)
    (args.out / "adam8bit_quality.json").write_text(json.dumps(summary, indent=1))
    (args.out / "adam8bit_quality.md").write_text(_markdown(summary))
    _plot(summary, args.out / "adam8bit_quality.png")
    print(_markdown(summary))


if __name__ == "__main__":
    main()
