"""Launching ``experiments.train`` from the tests: torchrun, torch ranks forked from the preloaded forkserver,
JAX processes, and reading the JSON-lines log."""

from __future__ import annotations

import faulthandler
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import wait
from pathlib import Path
from typing import NoReturn

from experiments._distributed import leave_and_exit, rendezvous, worker_context
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


def torchrun(nproc: int, args: list[str]) -> subprocess.CompletedProcess:
    """``torchrun --standalone``: its agent binds the rendezvous store to a port the kernel picks at that
    moment and the workers join that store, so no port is chosen ahead (and none can be taken meanwhile)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "experiments.train", "--stack", "torch", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=240)


@dataclass
class TorchLaunch:
    """What a ``torch_ranks`` launch left: as torchrun's, its exit status (the first failed rank's; 0 when
    every rank succeeded) and every rank's stderr, rank 0's first; and the largest peak resident memory
    (KiB) of the ranks that came back from ``main`` (returned or raised)."""

    returncode: int
    stderr: str
    peak_rss_kib: int


# Once a rank failed, how long the others get to end before they are killed (as torchrun kills the rest of
# a failed launch): a rank whose peer died can wait in a collective until its group's timeout.
FAIL_GRACE_S = 10.0


def torch_ranks(nproc: int, args: list[str], timeout: float = 240) -> TorchLaunch:
    """``experiments.train --stack torch *args`` on ``nproc`` gloo ranks forked from the preloaded
    forkserver (``experiments._distributed.worker_context``), each given the environment torchrun gives a
    worker and a process group joined by a file rendezvous, which the run keeps: a launch starts in a
    fraction of a second, where torchrun's fresh interpreters take seconds each to import torch on 2 cores.
    ``nproc`` 1 is a plain process, which makes its own group. A launch still running after ``timeout``
    raises, with every rank's stderr and each live rank's thread stacks."""
    ctx = worker_context()
    with tempfile.TemporaryDirectory() as workdir:
        argv = ["--stack", "torch", *args]
        procs = [ctx.Process(target=_torch_rank, args=(r, nproc, workdir, timeout, argv), daemon=True)
                 for r in range(nproc)]
        try:
            for p in procs:
                p.start()
            timed_out = _wait(procs, timeout)
            live = [r for r, p in enumerate(procs) if p.exitcode is None]
            for r in live:  # faulthandler writes the stacks of its threads to its stderr
                os.kill(procs[r].pid, signal.SIGUSR1)
            if live:
                time.sleep(1.0)
        finally:
            for p in procs:
                if p.pid is not None:
                    p.kill()
                    p.join()
        stderrs = [Path(workdir, f"stderr_{r}").read_text() for r in range(nproc)]
        rss = [int(f.read_text()) for f in Path(workdir).glob("peak_rss_*")]
    if timed_out:
        each = "".join(f"--- rank {r} ---\n{text}" for r, text in enumerate(stderrs))
        raise TimeoutError(f"ranks {live} still ran after {timeout}s; the ranks' stderr:\n{each}")
    returncode = next((p.exitcode for p in procs if p.exitcode), 0)
    return TorchLaunch(returncode, "".join(stderrs), max(rss, default=0))


def _wait(procs: list, timeout: float) -> bool:
    """Wait until every rank ended, or ``FAIL_GRACE_S`` after the first failure; True if ``timeout``
    passed first."""
    end, failed = time.monotonic() + timeout, False
    while live := [p for p in procs if p.exitcode is None]:
        if not failed and any(p.exitcode for p in procs):
            end, failed = min(end, time.monotonic() + FAIL_GRACE_S), True
        left = end - time.monotonic()
        if left <= 0:
            return not failed
        wait([p.sentinel for p in live], timeout=left)
    return False


def _torch_rank(rank: int, nproc: int, workdir: str, timeout: float, argv: list[str]) -> NoReturn:
    """One rank of ``torch_ranks``: its stderr to a file of the launch; an exception out of ``main`` ends it
    as the interpreter would (the message or traceback, status 1); success, as ``experiments.train``
    ends (``leave_and_exit``)."""
    import torch
    import torch.distributed as dist

    from experiments.train import main

    os.dup2(os.open(Path(workdir, f"stderr_{rank}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    torch.set_num_threads(1)  # torchrun's OMP_NUM_THREADS=1
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        os.environ.pop(name, None)
    try:
        if nproc > 1:
            os.environ.update(RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank),
                              LOCAL_WORLD_SIZE=str(nproc))
            dist.init_process_group("gloo", init_method=rendezvous(workdir), rank=rank, world_size=nproc,
                                    timeout=timedelta(seconds=timeout))
        main(argv)
        status = 0
    except SystemExit as e:
        if isinstance(e.code, int | None):
            status = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            status = 1
    except BaseException:
        traceback.print_exc()
        status = 1
    Path(workdir, f"peak_rss_{rank}").write_text(str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss))
    if status == 0:
        leave_and_exit()
    # A failed rank leaves without the exit barrier: a peer may be waiting in another collective, which then
    # fails on the closed connection (or is killed after FAIL_GRACE_S) instead of waiting out its timeout.
    sys.stderr.flush()
    os._exit(status)


def start_jax(nproc: int, args: list[str]) -> list[subprocess.Popen]:
    """``nproc`` JAX processes joined by explicit coordinator flags (sharing the run's compilation cache)."""
    coordinator = f"localhost:{coordinator_port()}"
    return [subprocess.Popen([sys.executable, "-m", "experiments.train", "--stack", "jax", *args,
                              "--coordinator", coordinator, "--num-processes", str(nproc),
                              "--process-id", str(i)],
                             cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
            for i in range(nproc)]


def jax_runs(devices: int, runs: list[list[str]], timeout: float = 240) -> subprocess.CompletedProcess:
    """``experiments.train --stack jax *argv`` for each of ``runs``, one after another in one process on
    ``devices`` host devices: one interpreter's imports (3-4 s of jax, flax and optax on 2 cores) serve
    them all. Each run builds its own mesh and programs, as a launch of its own does; ``timeout`` is per
    run."""
    code = "import json, sys\nfrom experiments.train import main\nfor argv in json.loads(sys.argv[1]):\n" \
           "    main(['--stack', 'jax', *argv])"
    return subprocess.run([sys.executable, "-c", code, json.dumps(runs)], cwd=ROOT, env=env(devices),
                          capture_output=True, text=True, timeout=timeout * len(runs))


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
