"""How the torch launchers of experiments/ join and leave a process group, the same way everywhere.

Join: ``rendezvous(workdir)``, a file in a directory of the launch, so there is no port to choose (a port
probed free and bound later can be taken in between by any process on the machine).

Leave: ``leave_and_exit()``. Every rank passes a barrier (none closes its connections while a peer is still
in a collective), destroys the process group and ends the process without finalizing the interpreter.
The last step is the fix for "terminate called without an active exception" (SIGABRT) at exit: a gloo
worker thread frees a finished collective's tensors after the caller's ``wait()`` returned, and that
needs the GIL. Once the interpreter finalizes, a thread that asks for the GIL is ended by
``pthread_exit``, whose unwinding through gloo's ``noexcept`` destructor calls ``std::terminate`` (a core
dump shows ``~AsyncAllreduceWork -> decref_pyobject -> take_gil -> PyThread_exit_thread``).
``destroy_process_group`` does not join those threads while anything still references the group, and
DTensor's caches keep the device mesh, and with it the group, for the life of the process. So a rank
that finalized right after its last collective aborted now and then (more often under load); a rank
that never finalizes cannot.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn


def rendezvous(workdir: str | Path) -> str:
    """The ``init_method`` of a launch whose ranks share ``workdir`` (a fresh directory per launch)."""
    return f"file://{Path(workdir).resolve()}/rendezvous"


def leave_and_exit(code: int = 0) -> NoReturn:
    """Barrier, destroy the process group, flush, and end the process with ``code`` (see the module
    docstring). Whatever the rank must leave behind (files, queue items) is written before this."""
    dist = sys.modules.get("torch.distributed")  # a JAX-only process never imports torch for this
    if dist is not None and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# What a CPU launch's forkserver imports once, before it forks the ranks: each rank would otherwise import
# torch afresh, several seconds apiece on 2 cores. torch._dynamo too: torch imports it lazily, at the first
# call of anything marked ``torch._disable_dynamo`` (an optimizer's step or zero_grad, a meta-device init),
# which nearly every rank makes (2-4 s each on 2 cores). $RAGGED_WORKER_PRELOAD adds modules
# (space-separated): the test suite's (tests/conftest.py) and experiments/bug_injection.py's, which patches
# the runtime in every worker. One process has one forkserver, started by its first launch: every launcher
# takes this list.
WORKER_PRELOAD = ["torch", "torch._dynamo", "torch.distributed.tensor", "torch.distributed.checkpoint",
                  "torch_backend"]
WORKER_PRELOAD_ENV = "RAGGED_WORKER_PRELOAD"


def worker_context(device: str = "cpu"):
    """The multiprocessing context of a launch's ranks: a forkserver that preloads ``WORKER_PRELOAD`` on
    CPU (the server is a fresh process, so a parent holding jax or threads is never forked), ``spawn`` on
    CUDA (a CUDA runtime must not be inherited by a fork)."""
    import multiprocessing as mp

    if device == "cuda":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([*WORKER_PRELOAD, *os.environ.get(WORKER_PRELOAD_ENV, "").split()])
    return ctx


def spawn_ranks(world: int, worker: Callable[..., object], *args: object, device: str = "cpu") -> list:
    """Run ``worker(rank, workdir, *args)`` in ``world`` fresh processes (``worker_context(device)``)
    sharing a fresh ``workdir`` to join by (``rendezvous``); returns what each rank's worker returned, in
    rank order. ``worker`` and ``args`` must pickle (a module-level function); each rank leaves through
    ``leave_and_exit`` after sending its result."""
    ctx = worker_context(device)
    queue = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as workdir:
        procs = [ctx.Process(target=_rank_main, args=(worker, r, workdir, queue, args)) for r in range(world)]
        for p in procs:
            p.start()
        results = dict(queue.get() for _ in procs)
        for p in procs:
            p.join()
    return [results[r] for r in range(world)]


def _rank_main(worker: Callable[..., object], rank: int, workdir: str, queue, args: tuple) -> NoReturn:
    queue.put((rank, worker(rank, workdir, *args)))  # a SimpleQueue: written before put returns
    leave_and_exit()
