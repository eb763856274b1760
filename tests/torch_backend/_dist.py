"""Launch gloo worker processes (forkserver, never a fork of pytest) that run a test module's checks.

One launch per (test module, world size): every worker initialises a gloo process group with a short
timeout, loads the test module from its file, runs ``checks(rank, world_size, *args)`` -- which returns
``{case name: None | error text}`` -- and sends the dict back. A worker that hangs is killed when the
launch times out, and the failure names the ranks that did not answer and shows where each was: every
thread's Python stack, which the worker writes on SIGUSR1 (faulthandler) just before it is killed.

Workers meet through a file in a directory of the launch (no port to probe, so none another job can
take in between), and leave as ``experiments._distributed.leave_and_exit`` explains: barrier, destroy,
then end without finalizing the interpreter, which a gloo thread still freeing a collective's tensors
would abort (SIGABRT, "terminate called without an active exception").
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib.util
import os
import queue as queue_mod
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta

from experiments._distributed import worker_context

Results = dict[str, object]
# Launch timeouts are sized for an idle 2-core machine; tools that check numerics, not speed, on a loaded
# one (experiments/bug_injection.py, experiments/variance_check.py) multiply them by this.
TIMEOUT_SCALE_ENV = "RAGGED_LAUNCH_TIMEOUT_SCALE"


def _load(path: str):
    """Import a test module from its file, whatever pytest's import mode."""
    name = "_worker_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _worker(
    path: str, fn: str, args: tuple, rank: int, world: int, workdir: str, pg_timeout_s: float, out
) -> None:
    import torch
    import torch.distributed as dist

    finished = False
    stacks = open(_stacks_file(workdir, rank), "w")  # noqa: SIM115 (open until the process ends)
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{workdir}/rendezvous", rank=rank,
                                world_size=world, timeout=timedelta(seconds=pg_timeout_s))
        result = getattr(_load(path), fn)(rank, world, *args)
        finished = True
    except BaseException:  # report anything, including a failed init, instead of leaving the launcher waiting
        result = {"<worker>": traceback.format_exc()}
    out.put((rank, result))
    out.close()
    out.join_thread()  # the answer is in the pipe before the process ends
    if dist.is_initialized():
        if finished:
            dist.barrier()  # no rank closes its connections while a peer is still in a collective
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _stacks_file(workdir: str, rank: int) -> str:
    return os.path.join(workdir, f"stacks_{rank}")


def _stacks_of_silent(procs: list, workdir: str, results: dict) -> dict[int, str]:
    """Every thread's stack of each live rank that did not answer (SIGUSR1: faulthandler writes them)."""
    silent = {r: p for r, p in enumerate(procs) if r not in results and p.pid is not None and p.is_alive()}
    for p in silent.values():
        os.kill(p.pid, signal.SIGUSR1)
    time.sleep(1.0)
    out = {r: "(none written: the process had not reached the worker function)" for r in silent}
    for r in silent:
        with contextlib.suppress(OSError):
            with open(_stacks_file(workdir, r)) as f:
                out[r] = f.read() or out[r]
    return out


def collect(path: str, fn: str, world: int, *args: object, answers: int | None = None,
            timeout_s: float = 90.0, pg_timeout_s: float = 20.0) -> dict[int, Results]:
    """Run ``fn(rank, world, *args)`` of the module at ``path`` on ``world`` gloo workers.

    Returns once ``answers`` ranks (default: all) answered or ``timeout_s`` (times
    ``$RAGGED_LAUNCH_TIMEOUT_SCALE``, default 1) passed without an answer, then kills whatever still runs
    (a killed or hung rank never answers).

    Returns:
        ``{rank: result}`` for the ranks that answered, and ``{rank: {"<worker>": where its threads
        were}}`` for a live rank that did not.
    """
    timeout_s = scaled_timeout(timeout_s)
    ctx = worker_context()  # a forkserver: workers fork from it, never from pytest, which may hold jax
    out = ctx.Queue()
    results: dict[int, Results] = {}
    with tempfile.TemporaryDirectory() as workdir:
        procs = [
            ctx.Process(target=_worker, args=(path, fn, args, r, world, workdir, pg_timeout_s, out),
                        daemon=True)
            for r in range(world)
        ]
        try:
            for p in procs:
                p.start()
            while len(results) < (world if answers is None else answers):
                try:
                    rank, res = out.get(timeout=timeout_s)
                except queue_mod.Empty:
                    for rank, stacks in _stacks_of_silent(procs, workdir, results).items():
                        results[rank] = {"<worker>": f"rank {rank} did not answer within {timeout_s}s; "
                                                     f"its threads:\n{stacks}"}
                    break
                results[rank] = res
        finally:
            for p in procs:
                if p.pid is None:  # never started: a failed start's own error is the one to see
                    continue
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
    return results


def scaled_timeout(seconds: float) -> float:
    """A launch's timeout as run: times ``$RAGGED_LAUNCH_TIMEOUT_SCALE`` (default 1; the variance check
    raises it, since it checks numerics on a loaded machine, not speed)."""
    return seconds * float(os.environ.get(TIMEOUT_SCALE_ENV, "1"))


def launch(
    path: str, fn: str, world: int, *args: object, timeout_s: float = 90.0, pg_timeout_s: float = 20.0
) -> list[Results]:
    """``collect`` from every rank.

    Returns:
        Each rank's ``{case: None | error}``; a rank that died or did not answer gets a ``<worker>`` entry.
    """
    results = collect(path, fn, world, *args, timeout_s=timeout_s, pg_timeout_s=pg_timeout_s)
    missing = [r for r in range(world) if r not in results]
    return [
        results.get(r, {"<worker>": f"rank {r} did not answer within {timeout_s}s (silent ranks {missing})"})
        for r in range(world)
    ]


def run_cases(cases: dict[str, Callable[[], object]]) -> Results:
    """Run every case, recording what it returns or ``{"traceback": ...}``; a failing case does not stop
    the others."""
    out: Results = {}
    for name, case in cases.items():
        try:
            out[name] = case()
        except BaseException:
            out[name] = {"traceback": traceback.format_exc()}
    return out


def shared_dir() -> str:
    """In a worker: a fresh directory that every rank of the launch names (rank 0 makes it), e.g. for a
    checkpoint; the caller removes it."""
    import torch.distributed as dist

    path = [tempfile.mkdtemp(prefix="ckpt_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    return path[0]


def shared(jobs: dict[str, Callable[[], object]]) -> dict[str, object]:
    """In a worker: each of ``jobs`` run on one rank only (round robin in their order, which every rank
    must give alike), and every rank given all their results: references that every rank compares with,
    computed once and side by side instead of once per rank. A job that raises raises on every rank."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    mine: dict[str, object] = {}
    for i, (name, job) in enumerate(jobs.items()):
        if i % world == rank:
            try:
                mine[name] = job()
            except BaseException:  # the others wait in the gather: they must see it too
                mine[name] = _Failed(f"rank {rank}, job {name!r}:\n{traceback.format_exc()}")
    parts: list = [None] * world
    dist.all_gather_object(parts, mine)
    out = {name: value for part in parts for name, value in part.items()}
    failed = [v.text for v in out.values() if isinstance(v, _Failed)]
    if failed:
        raise RuntimeError("\n".join(failed))
    return {name: out[name] for name in jobs}


class _Failed:
    def __init__(self, text: str) -> None:
        self.text = text


def _errors(results: list[Results], name: str) -> list[str]:
    """Each rank's failure of case ``name``: its traceback, a dead worker, or a case that did not run."""
    errors = []
    for rank, res in enumerate(results):
        value = res.get(name)
        if "<worker>" in res:
            errors.append(f"rank {rank}: worker failed:\n{res['<worker>']}")
        elif name not in res:
            errors.append(f"rank {rank}: case {name!r} did not run")
        elif isinstance(value, dict) and "traceback" in value:
            errors.append(f"rank {rank}:\n{value['traceback']}")
    return errors


def assert_case(results: list[Results], name: str) -> None:
    """Fail with every rank's error text if ``name`` failed (or a worker died) on any rank."""
    errors = _errors(results, name)
    if errors:
        raise AssertionError("\n".join(errors))


class Launcher:
    """Caches one launch per world size for a test module (its 'one process group per module')."""

    def __init__(self, path: str, fn: str = "checks", *args: object) -> None:
        self.path, self.fn, self.args = path, fn, args
        self._results: dict[int, list[Results]] = {}

    def __call__(self, world: int) -> list[Results]:
        if world not in self._results:
            self._results[world] = launch(self.path, self.fn, world, *self.args)
        return self._results[world]


def case_results(results: list[Results], case: str) -> list:
    """Every rank's result of ``case``, after failing on any rank's error."""
    assert_case(results, case)
    return [res[case] for res in results]
