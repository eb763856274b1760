"""Inject realistic bugs into the runtimes and check that the parity tests catch each one.

A parity bound is only worth its margin below a real bug: this runs each bug of ``BUGS`` (a monkeypatch of
one function of ``torch_backend`` or ``jax_backend``, never a switch in their code) against the parity
tests it should break, each bug in its own pytest process, and the same tests once with no bug, which
must pass. A bug is caught when at least one of its tests fails.

The patch reaches every process a test computes in: pytest loads this module as a plugin
(``-p experiments.bug_injection``), whose ``pytest_configure`` applies the bug named by ``$RAGGED_BUG`` in
the test process (after tests/conftest.py set the XLA flags); for a torch bug ``$RAGGED_WORKER_PRELOAD``
adds ``experiments._bug_in_workers`` to what the forkserver that the gloo workers fork from imports
(tests/torch_backend/_dist.py), and importing that module applies the same bug there.

    python -m experiments.bug_injection                    # every bug, then results/bug_injection.{md,json}
    python -m experiments.bug_injection --only shard_off_by_one_element,stale_gathered_shard
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from experiments._distributed import WORKER_PRELOAD_ENV  # what the workers' forkserver imports

BUG_ENV = "RAGGED_BUG"
TIMEOUT_SCALE_ENV = "RAGGED_LAUNCH_TIMEOUT_SCALE"  # read by tests/torch_backend/_dist.py: its timeout factor
RESULTS = Path(__file__).parent / "results"
_DD = "tests/torch_backend/test_fsdp_data_dependent.py"
_MOE = "tests/torch_backend/test_fsdp_moe.py"
_JAX_STEP = "tests/jax_backend/test_step.py"
_JAX_EP = "tests/jax_backend/test_expert_parallel.py"


# ----- torch bugs -----------------------------------------------------------------------------------
def _torch_shard_off_by_one_element() -> None:
    """Every parameter's local shard view starts one element late (where the shard has room)."""
    from torch_backend.fsdp._dbuffer import DBuffer

    original = DBuffer.shard_view

    def shard_view(self, name: str):
        view = original(self, name)
        start = view.storage_offset() - self.shard.storage_offset() + 1
        fits = view.numel() and start + view.numel() <= len(self.shard)
        return self.shard[start:start + view.numel()] if fits else view

    DBuffer.shard_view = shard_view


def _torch_gradient_not_divided() -> None:
    """Each unit's reduce-scatter sums the ranks' gradients and the divide by the world size is lost
    (the mean becomes a sum: AdamW is nearly scale-invariant, only its eps sees it)."""
    import torch.distributed as dist

    import torch_backend.fsdp._unit as unit

    original = unit.reduce_scatter

    def reduce_scatter(shard, full, group, *, label):
        full.mul_(dist.get_world_size(group))
        return original(shard, full, group, label=label)

    unit.reduce_scatter = reduce_scatter


def _torch_stale_gathered_shard() -> None:
    """Each unit's all-gather reads a copy of its shard taken at the first gather, so the optimizer's
    updates never reach the forward (a stale buffer)."""
    import torch_backend.fsdp._unit as unit

    original, first = unit.all_gather, {}

    def all_gather(full, shard, group, *, label):
        return original(full, first.setdefault((label, shard.dtype), shard.clone()), group, label=label)

    unit.all_gather = all_gather


def _torch_gather_own_shard_missing() -> None:
    """The gloo all-gather never copies this rank's shard into its own slice of the gathered buffer: that
    slice keeps what the allocator left there (often an earlier gather's values) and goes to every peer."""
    import torch.distributed as dist

    import torch_backend._collectives as collectives

    original = collectives._gloo_all_gather

    def gather(full, shard, group, world):
        rank, n = dist.get_rank(group if group is not None else dist.group.WORLD), shard.numel()
        own = full.view(-1)[rank * n:(rank + 1) * n]
        return original(full, own, group, world)  # copies the slice onto itself

    collectives._gloo_all_gather = gather


def _torch_ep_gradient_dropped() -> None:
    """Expert parallelism's all-to-all backward loses the gradient rows of the last EP rank's block (an
    expert's gradient from that rank's tokens, and those tokens' gradient, never arrive)."""
    import importlib

    # the module, not the function of that name that torch_backend.models exports
    expert_parallel = importlib.import_module("torch_backend.models.expert_parallel")
    original = expert_parallel._AllToAll.backward

    def backward(ctx, grad):
        out, *rest = original(ctx, grad)
        last = ctx.splits[1][-1]
        if last:
            out = out.clone()
            out[-last:] = 0
        return (out, *rest)

    expert_parallel._AllToAll.backward = staticmethod(backward)


def _torch_hsdp_replicas_not_reduced() -> None:
    """Under HSDP the all-reduce over the replicas is skipped: each replica steps on its own rows only."""
    import torch_backend.fsdp._unit as unit
    from torch_backend._collectives import Pending

    unit.all_reduce = lambda tensor, group, *, label, **_: Pending(None, f"skipped all_reduce of {label}")


# ----- JAX bugs -------------------------------------------------------------------------------------
def _jax_shard_off_by_one_element() -> None:
    """Every unit's gathered buffer is shifted by one element (a shard placed one element off)."""
    import jax.numpy as jnp

    import jax_backend._units as units

    original = units._all_gather
    units._all_gather = lambda shard, comm: jnp.roll(original(shard, comm), 1, axis=-1)


def _jax_hsdp_replicas_not_reduced() -> None:
    """Under HSDP the psum over the replica axis is left out of the gradient's reduce-scatter."""
    import jax_backend._units as units

    original = units._reduce_scatter
    units._reduce_scatter = lambda grad, comm: original(grad, comm._replace(replica_axis=None))


def _jax_ep_gradient_dropped() -> None:
    """Expert parallelism's all-to-alls pass no gradient back for the block of the last EP rank."""
    import types

    import jax.numpy as jnp
    from jax import lax

    from jax_backend.models import expert_parallel

    def all_to_all(x, axis_name, split_axis, concat_axis, **kwargs):
        x = jnp.concatenate([x[:-1], lax.stop_gradient(x[-1:])], axis=0)  # dim 0: the destination EP rank
        return lax.all_to_all(x, axis_name, split_axis, concat_axis, **kwargs)

    expert_parallel.lax = types.SimpleNamespace(**{**vars(lax), "all_to_all": all_to_all})


@dataclass(frozen=True)
class Bug:
    """A bug: the patch that makes it, the stack it lives in, and the parity tests that must catch it."""

    apply: Callable[[], None]
    stack: str  # "torch" (also applied in the gloo workers) or "jax"
    tests: tuple[str, ...]  # pytest node ids

    @property
    def what(self) -> str:
        return " ".join(self.apply.__doc__.split())


BUGS: dict[str, Bug] = {
    "torch_shard_off_by_one_element": Bug(_torch_shard_off_by_one_element, "torch", (
        f"{_DD}::test_routed_experts_root_and_aux_parameters_train_like_single_process[2]",)),
    "torch_gradient_not_divided": Bug(_torch_gradient_not_divided, "torch", (
        f"{_DD}::test_routed_experts_root_and_aux_parameters_train_like_single_process[2]",)),
    "torch_stale_gathered_shard": Bug(_torch_stale_gathered_shard, "torch", (
        f"{_DD}::test_routed_experts_root_and_aux_parameters_train_like_single_process[2]",)),
    "torch_gather_own_shard_missing": Bug(_torch_gather_own_shard_missing, "torch", (
        f"{_DD}::test_routed_experts_root_and_aux_parameters_train_like_single_process[2]",)),
    "torch_ep_gradient_dropped": Bug(_torch_ep_gradient_dropped, "torch", (
        f"{_MOE}::test_expert_parallel_with_fsdp_equals_single_process[mixtral-tiny-2-2]",
        f"{_MOE}::test_expert_parallel_in_bf16_within_the_policy_references_spread[mixtral-tiny]")),
    "torch_hsdp_replicas_not_reduced": Bug(_torch_hsdp_replicas_not_reduced, "torch", (
        f"{_DD}::test_routed_under_hsdp_2x2_trains_like_single_process",)),
    "jax_shard_off_by_one_element": Bug(_jax_shard_off_by_one_element, "jax", (
        f"{_JAX_STEP}::test_fsdp_matches_single_device[2-remat-False]",
        f"{_JAX_STEP}::test_bf16_compute_matches_bf16_reference")),
    "jax_hsdp_replicas_not_reduced": Bug(_jax_hsdp_replicas_not_reduced, "jax", (
        f"{_JAX_STEP}::test_hsdp_2x2_matches_single_device",)),
    "jax_ep_gradient_dropped": Bug(_jax_ep_gradient_dropped, "jax", (
        f"{_JAX_EP}::test_five_adamw_steps_equal_single_device_training[2-2-1-mixtral-tiny]",
        f"{_JAX_EP}::test_bf16_policy_within_the_spread_of_the_policy_reference[2-4-1-gpt-oss-tiny]")),
}


def apply_named_bug(stacks: tuple[str, ...] = ("torch", "jax")) -> str | None:
    """Apply the bug named by ``$RAGGED_BUG`` if it belongs to one of ``stacks``; returns its name."""
    name = os.environ.get(BUG_ENV)
    if not name:
        return None
    if name not in BUGS:
        raise KeyError(f"{BUG_ENV}={name!r} names no bug of experiments.bug_injection.BUGS: {sorted(BUGS)}")
    if BUGS[name].stack in stacks:
        BUGS[name].apply()
    return name


def pytest_configure(config) -> None:
    """The plugin's entry (``-p experiments.bug_injection``): the bug in the test process."""
    apply_named_bug()


# ----- the runner -----------------------------------------------------------------------------------
def run_tests(tests: list[str], bug: str | None, workdir: Path, timeout_scale: float) -> dict:
    """One pytest process over ``tests`` with ``bug`` injected (None: none), its gloo launches' timeouts
    scaled by ``timeout_scale``; each test's outcome."""
    xml = workdir / f"{bug or 'no_bug'}.xml"
    env = {k: v for k, v in os.environ.items() if k != BUG_ENV} | ({BUG_ENV: bug} if bug else {})
    env[TIMEOUT_SCALE_ENV] = str(timeout_scale)
    if bug and BUGS[bug].stack == "torch":  # the gloo workers' forkserver imports it: the bug there too
        env[WORKER_PRELOAD_ENV] = "experiments._bug_in_workers"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parents[1]), env.get("PYTHONPATH")]))
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "experiments.bug_injection",
                           f"--junitxml={xml}", *tests], env=env, capture_output=True, text=True)
    wall_s = round(time.perf_counter() - start, 1)
    if not xml.exists():  # pytest itself failed (the patch raised, say): no test ran, nothing was caught
        tail = (proc.stdout + proc.stderr)[-300:]
        return {"outcomes": {t: f"not run: {tail}" for t in tests}, "wall_s": wall_s}
    outcomes = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        node = f"{case.get('classname').replace('.', '/')}.py::{case.get('name')}"
        failure = case.find("failure") if case.find("failure") is not None else case.find("error")
        outcomes[node] = ("skipped" if case.find("skipped") is not None else
                          "passed" if failure is None else "failed: " + failure.get("message", "")[:300])
    return {"outcomes": outcomes, "wall_s": wall_s}


def report(results: dict) -> str:
    lines = ["# Bug injection: does every realistic bug fail a parity test?", "",
             "`python -m experiments.bug_injection`: each bug a monkeypatch of one runtime function, in its "
             "own pytest process; the same tests with no bug must pass.", "",
             "| bug | what it does | tests failed | caught | wall s |", "|---|---|---|---|---|"]
    for name, r in results["bugs"].items():
        failed = sum(o.startswith("failed") for o in r["outcomes"].values())
        lines.append(f"| `{name}` | {r['what']} | {failed} of {len(r['outcomes'])} | "
                     f"{'yes' if r['caught'] else '**no**'} | {r['wall_s']} |")
    base = results["no_bug"]
    passed = sum(o == "passed" for o in base["outcomes"].values())
    lines += ["", f"No bug: {passed} of {len(base['outcomes'])} tests passed ({base['wall_s']} s).", ""]
    for name, r in results["bugs"].items():
        for node, outcome in r["outcomes"].items():
            lines.append(f"- `{name}`: `{node}`: {outcome.splitlines()[0] if outcome else outcome}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="comma-separated bug names (default: every bug)")
    parser.add_argument("--out", default=str(RESULTS / "bug_injection"), help="stem of the .md and .json")
    parser.add_argument("--jobs", type=int, default=1, help="pytest processes at a time")
    parser.add_argument("--timeout-scale", type=float, default=10.0,
                        help="multiplies the gloo launches' timeouts (this checks numerics, not speed)")
    args = parser.parse_args(argv)
    names = args.only.split(",") if args.only else list(BUGS)
    unknown = sorted(set(names) - set(BUGS))
    if unknown:
        parser.error(f"unknown bugs {unknown}; known: {sorted(BUGS)}")
    tests = sorted({t for n in names for t in BUGS[n].tests})
    with tempfile.TemporaryDirectory() as workdir, ThreadPoolExecutor(args.jobs) as pool:
        run = functools.partial(run_tests, workdir=Path(workdir), timeout_scale=args.timeout_scale)
        no_bug = pool.submit(run, tests, None)
        runs = {name: pool.submit(run, list(BUGS[name].tests), name) for name in names}
        results = {"no_bug": no_bug.result(), "bugs": {}}
        print(f"no bug: {results['no_bug']}", flush=True)
        for name, future in runs.items():
            r = future.result()
            caught = any(o.startswith("failed") for o in r["outcomes"].values())
            r |= {"what": BUGS[name].what, "caught": caught}
            results["bugs"][name] = r
            print(f"{name}: caught={r['caught']} {r['outcomes']}", flush=True)
    Path(f"{args.out}.json").write_text(json.dumps(results, indent=1) + "\n")
    Path(f"{args.out}.md").write_text(report(results))
    ok = all(o == "passed" for o in results["no_bug"]["outcomes"].values()) and \
        all(r["caught"] for r in results["bugs"].values())
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
