"""Optimizer step time of 8-bit Adam against fp32 AdamW and torchao's AdamW8bit, interleaved.

``experiments.adam8bit_quality``'s 1.7M-parameter llama computes the gradients of one real-text batch;
each optimizer (the same three as there) then steps in turn on those gradients, round after round, on one
thread, so machine load hits them alike. Reported: the median ``opt.step()`` time per optimizer and, per
optimizer, the median over rounds of its time divided by torchao's in the same round. The first rounds
(torchao compiles its kernels) are dropped.

    python -m experiments.adam8bit_step_time   # writes experiments/results/adam8bit_step_time.{md,json}
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from experiments.adam8bit_quality import CONFIG, OPTIMIZERS, batches, make_optimizer, split, stdlib_text
from torch_backend.models import Llama, cross_entropy

RESULTS = Path(__file__).parent / "results"


def measure(rounds: int, warmup: int = 3) -> dict[str, list[float]]:
    """Seconds of ``opt.step()`` per optimizer and round (after ``warmup`` rounds)."""
    torch.set_num_threads(1)
    train_ids, _ = split(stdlib_text())
    batch = batches(train_ids, 1, 8, 128, seed=1)[0]
    opts = {}
    for kind in OPTIMIZERS:
        model = Llama(CONFIG)
        model.init_weights(seed=0)
        cross_entropy(model(batch[:, :-1]), batch[:, 1:]).backward()
        opts[kind] = make_optimizer(kind, model, 1e-3)
    times = {kind: [] for kind in opts}
    for r in range(warmup + rounds):
        for kind, opt in opts.items():
            t0 = time.perf_counter()
            opt.step()
            if r >= warmup:
                times[kind].append(time.perf_counter() - t0)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    times = measure(args.rounds)
    summary = {kind: {"median_s": statistics.median(t),
                      "ratio_to_torchao": statistics.median(a / b for a, b in zip(t, times["torchao"]))}
               for kind, t in times.items()}
    lines = ["# 8-bit Adam optimizer step time (`python -m experiments.adam8bit_step_time`)", "",
             f"{sum(p.numel() for p in Llama(CONFIG).parameters()):,}-parameter llama of "
             f"`experiments.adam8bit_quality`, one thread, {args.rounds} interleaved rounds of `opt.step()` "
             "on the same real-text gradients (after 3 warm-up rounds) on a shared 2-core machine.", "",
             "| optimizer | step (median) | step time / torchao's (median over rounds) |", "|---|---|---|"]
    lines += [f"| {kind} | {1e3 * s['median_s']:.1f} ms | {s['ratio_to_torchao']:.2f} |"
              for kind, s in summary.items()]
    args.out.mkdir(exist_ok=True)
    summary["rounds"] = args.rounds
    (args.out / "adam8bit_step_time.json").write_text(json.dumps(summary, indent=1))
    (args.out / "adam8bit_step_time.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
