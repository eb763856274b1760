"""What the user watches: a rich progress bar on rank 0, a JSON-lines log per step, a final summary.

MFU is model FLOPs per token (``ragged.models.flops_per_token``, from the preset's shapes) times tokens per
second, over the devices' dense bf16 peak (``PEAK_TFLOPS``, matched against the device name; override
with ``--peak-tflops``). Without a known peak (a CPU) MFU is left out rather than guessed.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

# Dense bf16 tensor-core peak per device, TFLOP/s (vendor datasheets, SXM parts).
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "B200": 2250.0, "GB200": 2500.0, "L40S": 362.0,
               "MI300X": 1307.0, "TPU v5p": 459.0, "TPU v5 lite": 197.0, "TPU v4": 275.0, "TPU v6": 918.0}


def peak_tflops(device_name: str, override: float | None) -> float | None:
    if override is not None:
        return override
    for key, value in PEAK_TFLOPS.items():
        if key.lower() in device_name.lower():
            return value
    return None


class Monitor:
    """Per-step metrics: a progress bar and a JSON-lines log on rank 0 (no-ops elsewhere)."""

    def __init__(self, *, rank0: bool, steps: int, first_step: int, tokens_per_step: int,
                 flops_per_token: float, devices: int, peak: float | None, log_path: Path | None,
                 show_bar: bool = True) -> None:
        self.rank0, self.tokens_per_step, self.flops_per_token = rank0, tokens_per_step, flops_per_token
        self.devices, self.peak = devices, peak
        self.records: list[dict] = []
        self.log = open(log_path, "a") if rank0 and log_path is not None else None  # noqa: SIM115
        self.console = Console(stderr=True)
        self.bar = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                            TimeRemainingColumn(), TextColumn("{task.fields[stats]}"), console=self.console,
                            disable=not (rank0 and show_bar))
        self.task = self.bar.add_task("train", total=steps, completed=first_step, stats="")

    def __enter__(self) -> Monitor:
        self.bar.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.bar.__exit__(*exc)
        if self.log is not None:
            self.log.close()

    def step(self, step: int, loss: float, step_s: float, comm_s: float | None, peak_bytes: int | None,
             comm_bytes: int | None) -> None:
        tokens_per_s = self.tokens_per_step / step_s
        record = {"step": step, "loss": loss, "step_s": step_s, "tokens_per_s": tokens_per_s,
                  "mfu": (tokens_per_s * self.flops_per_token / (self.devices * self.peak * 1e12)
                          if self.peak else None),
                  "comm_wait_s": comm_s, "peak_memory_bytes": peak_bytes, "collective_bytes": comm_bytes}
        self.records.append(record)
        if not self.rank0:
            return
        if self.log is not None:
            self.log.write(json.dumps(record) + "\n")
            self.log.flush()
        parts = [f"loss {loss:.4f}", f"{tokens_per_s:,.0f} tok/s"]
        if record["mfu"] is not None:
            parts.append(f"MFU {record['mfu']:.1%}")
        if peak_bytes is not None:
            parts.append(f"peak {peak_bytes / 2**30:.2f} GiB")
        if comm_s is not None:
            parts.append(f"comm wait {comm_s / step_s:.0%}")
        self.bar.update(self.task, advance=1, stats="  ".join(parts))

    def summary(self) -> dict:
        """Medians over the steps after the first (compilation, warm-up), and the last loss."""
        timed = self.records[1:] or self.records
        if not timed:
            return {}
        median = lambda key: (statistics.median(r[key] for r in timed)  # noqa: E731
                              if timed[0][key] is not None else None)
        return {"steps": len(self.records), "last_step": self.records[-1]["step"],
                "last_loss": self.records[-1]["loss"], "median_step_s": median("step_s"),
                "tokens_per_s": median("tokens_per_s"), "mfu": median("mfu"),
                "comm_wait_s": median("comm_wait_s"),
                "peak_memory_bytes": max((r["peak_memory_bytes"] or 0) for r in self.records) or None}

    def print_summary(self, title: str) -> dict:
        s = self.summary()
        if self.rank0 and s:
            def fmt(v: object) -> str:
                return f"{v:.4g}" if isinstance(v, float) else str(v)

            self.console.print(f"[bold]{title}[/bold]: " + ", ".join(f"{k} {fmt(v)}" for k, v in s.items()))
        return s
