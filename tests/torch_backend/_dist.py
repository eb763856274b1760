"""Launch gloo worker processes (spawn, never fork) that run a module's checks and report back.

One launch per (module, world size): every worker initialises a gloo process group with a short
timeout, runs ``checks(rank, world_size)`` -- a function of the test module that returns
``{case name: None | error text}`` -- and sends the dict back. A worker that hangs is killed when the
launch times out, and the failure names the ranks that did not answer.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import socket
import traceback
from collections.abc import Callable
from datetime import timedelta

Results = dict[str, str | None]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    module: str, fn: str, args: tuple, rank: int, world: int, port: int, timeout_s: float, queue
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
        checks = getattr(importlib.import_module(module), fn)
        queue.put((rank, checks(rank, world, *args)))
        dist.destroy_process_group()
    except BaseException:  # report anything, including a failed init, instead of hanging the launcher
        queue.put((rank, {"<worker>": traceback.format_exc()}))


def launch(
    module: str,
    fn: str,
    world: int,
    *args: object,
    timeout_s: float = 60.0,
    pg_timeout_s: float = 20.0,
) -> list[Results]:
    """Run ``module.fn(rank, world, *args)`` on ``world`` spawned gloo workers; return each rank's results."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    # Spawned children import the test module by name, so they need the tests directory on sys.path.
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env_path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, env_path) if p)
    procs = [
        ctx.Process(target=_worker, args=(module, fn, args, r, world, port, pg_timeout_s, queue), daemon=True)
        for r in range(world)
    ]
    try:
        for p in procs:
            p.start()
        results: dict[int, Results] = {}
        import queue as queue_mod

        while len(results) < world:
            try:
                rank, res = queue.get(timeout=timeout_s)
            except queue_mod.Empty:
                break
            results[rank] = res
    finally:
        os.environ["PYTHONPATH"] = env_path
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    missing = [r for r in range(world) if r not in results]
    return [
        results.get(r, {"<worker>": f"rank {r} did not answer within {timeout_s}s (ranks {missing})"})
        for r in range(world)
    ]


def run_cases(cases: dict[str, Callable[[], None]]) -> Results:
    """Run every case, recording None or the traceback; a failing case does not stop the others."""
    out: Results = {}
    for name, case in cases.items():
        try:
            case()
            out[name] = None
        except BaseException:
            out[name] = traceback.format_exc()
    return out


def assert_case(results: list[Results], name: str) -> None:
    """Fail with every rank's error text if ``name`` failed (or a worker died) on any rank."""
    errors = []
    for rank, res in enumerate(results):
        if "<worker>" in res:
            errors.append(f"rank {rank}: worker failed:\n{res['<worker>']}")
        elif name not in res:
            errors.append(f"rank {rank}: case {name!r} did not run")
        elif res[name] is not None:
            errors.append(f"rank {rank}:\n{res[name]}")
    if errors:
        raise AssertionError("\n".join(errors))
