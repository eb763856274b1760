"""Launching ``experiments.train`` from the tests: torchrun, JAX processes, and reading the JSON-lines log."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from experiments._xla import host_devices_flags
from tests.ports import coordinator_port

ROOT = Path(__file__).resolve().parents[2]
BATCH, SEQ = 8, 32
TINY = ["--model", "llama-tiny", "--dtype", "fp32", "--batch", str(BATCH), "--seq-len", str(SEQ),
        "--no-progress"]
# A distributed run's loss against one process's: the step's loss is the mean over BATCH * SEQ token
# predictions, summed in another order (each rank its rows, then the ranks), which changes it by at most
# (n - 1) fp32 unit roundoffs (eps / 2), relative; the parameters' differences add far less in 5 steps.
LOSS_RTOL = (BATCH * SEQ - 1) * 2.0**-24  # 1.5e-5


def env(devices: int = 1) -> dict:
    """One thread per process; JAX processes own ``devices`` host CPU devices (not the test run's 8), with
    the run's other XLA flags (its optimization level, an ISA limit of experiments.variance_check) and its
    compilation cache (tests/conftest.py: a relaunched job loads what its first launch compiled)."""
    out = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": host_devices_flags(devices)}
    out.pop("WORLD_SIZE", None)
    return out


def run(cmd: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout)


def torchrun(nproc: int, args: list[str]) -> subprocess.CompletedProcess:
    """``torchrun --standalone``: its agent binds the rendezvous store to a port the kernel picks at that
    moment and the workers join that store, so no port is chosen ahead (and none can be taken meanwhile)."""
    return run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                "-m", "experiments.train", "--stack", "torch", *args])


def start_jax(nproc: int, args: list[str]) -> list[subprocess.Popen]:
    """``nproc`` JAX processes joined by explicit coordinator flags (sharing the run's compilation cache)."""
    coordinator = f"localhost:{coordinator_port()}"
    return [subprocess.Popen([sys.executable, "-m", "experiments.train", "--stack", "jax", *args,
                              "--coordinator", coordinator, "--num-processes", str(nproc),
                              "--process-id", str(i)],
                             cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
            for i in range(nproc)]


def finish(procs: list[subprocess.Popen], timeout: float = 240) -> list[subprocess.CompletedProcess]:
    """Wait for every process (all are killed if one times out)."""
    out = []
    try:
        for p in procs:
            stdout, _ = p.communicate(timeout=timeout)
            out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, ""))
    finally:
        for p in procs:
            p.kill()
    return out


def losses(log: Path) -> dict[int, float]:
    """``{step: loss}`` from a log; a step logged twice (before a crash and after resuming) keeps the last."""
    return {r["step"]: r["loss"] for r in map(json.loads, log.read_text().splitlines())}


def log_records(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]
