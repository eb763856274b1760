"""Collect what ``experiments/gpu_bench.sh`` measured into ``gpu_bench.md`` and ``gpu_bench.json``.

Reads the stage list and the per-stage files the script left in the results folder; a stage that failed or
timed out shows as such, so the summary is written whatever finished.

    python -m experiments._train.gpu_report experiments/results
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from experiments._train.metrics import peak_tflops


def collect(results: Path) -> dict:
    stages = []
    stages_file = results / "gpu_bench_stages.txt"
    if stages_file.exists():
        for line in stages_file.read_text().splitlines():
            name, rc, seconds = line.split()
            stages.append({"stage": name, "exit": int(rc) if rc.lstrip("-").isdigit() else rc,
                           "seconds": int(seconds)})
    runs = {p.stem.removeprefix("gpu_train_"): json.loads(p.read_text())
            for p in sorted(results.glob("gpu_train_*.json"))}
    check = results / "gpu_check.txt"
    versus = results / "gpu_torch_vs_fsdp2.json"
    return {"stages": stages, "train": runs, "gpu_check": check.read_text() if check.exists() else None,
            "torch_vs_fsdp2": _versus(json.loads(versus.read_text())) if versus.exists() else None}


def _versus(s: dict) -> dict:
    """Tokens/s and MFU of both runtimes from ``torch_vs_fsdp2``'s medians (the same steps, interleaved)."""
    peak = peak_tflops(s["device_name"], None)
    out = {}
    for kind in ("fsdp2", "ours"):
        tokens_per_s = s["tokens_per_step"] / s[kind]["median_step_s"]
        out[kind] = {"median_step_s": s[kind]["median_step_s"], "tokens_per_s": tokens_per_s,
                     "mfu": (tokens_per_s * s["flops_per_token"] / (s["world"] * peak * 1e12)
                             if peak else None),
                     "peak_memory_bytes": max(s[kind]["peak_memory_bytes_per_rank"]),
                     "copy_bytes_per_step": s[kind]["copy_bytes_per_step"]}
    out["step_time_ratio_ours_over_fsdp2"] = s["step_time_ratio_ours_over_fsdp2"]
    return out


def markdown(data: dict) -> str:
    lines = ["# GPU benchmark (`experiments/gpu_bench.sh`)", ""]
    for s in list(data["train"].values())[:1]:
        lines += [f"{s['model']}, {s['dtype']} compute (fp32 master weights and optimizer state), "
                  f"{s['batch']} x {s['seq_len']} tokens per step, world size 1. Medians over the steps "
                  "after the first.", ""]
    lines += ["| run | step time | tokens/s | MFU | peak memory | last loss |", "|---|---|---|---|---|---|"]
    for name, s in data["train"].items():
        mfu = f"{s['mfu']:.1%}" if s.get("mfu") is not None else "n/a"
        peak = f"{s['peak_memory_bytes'] / 2**30:.1f} GiB" if s.get("peak_memory_bytes") else "n/a"
        lines.append(f"| {name} | {s['median_step_s'] * 1e3:.0f} ms | {s['tokens_per_s']:,.0f} | {mfu} | "
                     f"{peak} | {s['last_loss']:.4f} |")
    lines += ["", "| stage | exit status | seconds |", "|---|---|---|"]
    lines += [f"| {s['stage']} | {s['exit']}{' (timed out)' if s['exit'] in (124, 137) else ''} | "
              f"{s['seconds']} |" for s in data["stages"]]
    if data["torch_vs_fsdp2"]:
        v = data["torch_vs_fsdp2"]
        lines += ["", "## fully_shard vs FSDP2 (torch_vs_fsdp2, interleaved steps)", "",
                  "| runtime | step time | tokens/s | MFU | peak memory | bytes copied or cast outside "
                  "collectives / step |", "|---|---|---|---|---|---|"]
        for kind in ("fsdp2", "ours"):
            r = v[kind]
            mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a"
            lines.append(f"| {kind} | {r['median_step_s'] * 1e3:.0f} ms | {r['tokens_per_s']:,.0f} | {mfu} | "
                         f"{r['peak_memory_bytes'] / 2**30:.1f} GiB | {r['copy_bytes_per_step']:,} |")
        lines += ["", f"Step time ratio (ours / FSDP2): **{v['step_time_ratio_ours_over_fsdp2']:.3f}**."]
    if data["gpu_check"]:
        lines += ["", "## gpu_check", "", "```", data["gpu_check"].rstrip(), "```"]
    return "\n".join(lines) + "\n"


def main() -> None:
    results = Path(sys.argv[1] if len(sys.argv) > 1 else "experiments/results")
    data = collect(results)
    (results / "gpu_bench.json").write_text(json.dumps(data, indent=1))
    text = markdown(data)
    (results / "gpu_bench.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
