"""Run the numerics-sensitive tests under emulated machine variance: other CPU kernels, ISAs and threads.

A parity bound that sits on rounding passes on one machine and fails on the next, because the CPU's
kernels sum in another order. This emulates other machines on this one, each variance in its own pytest
process: torch's kernels picked by ``ATEN_CPU_CAPABILITY`` (default, avx2, and avx512 where the CPU has
it), XLA:CPU's code limited to an ISA (``--xla_cpu_max_isa``: AVX2, SSE4_2), one intra-op thread for both,
and none of these. A variance that changes only one stack's kernels runs only that stack's tests.

    python -m experiments.variance_check                             # every variance, every file below
    python -m experiments.variance_check --only tests/torch_backend/test_fsdp_data_dependent.py \
        --variances aten_default,aten_avx2                           # a subset

Writes ``experiments/results/variance_check.{md,json}``: per variance its environment, the tests passed
and failed, each failure's node id and message, and the wall time; with the CPU model and its ISAs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).parents[1]
TIMEOUT_SCALE_ENV = "RAGGED_LAUNCH_TIMEOUT_SCALE"  # read by tests/torch_backend/_dist.py
RESULTS = ROOT / "experiments" / "results"
EARLIER_CPU = "AMD EPYC"  # rows recorded before rows named their CPU (all on that machine)

# The tests that compare a sharded run with a reference (or two summation orders), by stack.
NUMERICS_TESTS = {
    "torch": tuple(f"tests/torch_backend/{f}.py" for f in (
        "test_fsdp_data_dependent", "test_fsdp_user_models", "test_fsdp_dropin", "test_fsdp_parity",
        "test_fsdp_moe", "test_moe_optim", "test_moe_dcp", "test_fsdp_tp", "test_optim", "test_muon_split",
        "test_dcp", "test_fsdp_multi_forward", "test_lightning", "test_accelerate", "test_collectives")),
    "jax": tuple(f"tests/jax_backend/{f}.py" for f in (
        "test_step", "test_expert_parallel", "test_expert_parallel_optim", "test_tensor_parallel",
        "test_optax", "test_model_state", "test_optim", "test_muon_split", "test_checkpoint", "test_orbax",
        "test_multihost")),
}


@dataclass(frozen=True)
class Variance:
    """An emulated machine: environment variables set for one pytest process, and the stacks they touch."""

    env: dict[str, str]
    stacks: tuple[str, ...]
    needs_isa: str | None = None  # a /proc/cpuinfo flag the CPU must have


VARIANCES: dict[str, Variance] = {
    "none": Variance({}, ("torch", "jax")),
    "aten_default": Variance({"ATEN_CPU_CAPABILITY": "default"}, ("torch",)),
    "aten_avx2": Variance({"ATEN_CPU_CAPABILITY": "avx2"}, ("torch",), "avx2"),
    "aten_avx512": Variance({"ATEN_CPU_CAPABILITY": "avx512"}, ("torch",), "avx512f"),
    "xla_avx2": Variance({"XLA_FLAGS": "--xla_cpu_max_isa=AVX2"}, ("jax",), "avx2"),
    "xla_sse4_2": Variance({"XLA_FLAGS": "--xla_cpu_max_isa=SSE4_2"}, ("jax",), "sse4_2"),
    # the suite compiles with XLA:CPU's loop emitters on jaxlib 0.10 (tests/conftest.py): XLA's default too
    "xla_fusion_emitters": Variance({"XLA_FLAGS": "--xla_cpu_use_fusion_emitters=true"}, ("jax",)),
    # torch's gloo workers already run one thread each (tests/torch_backend/_dist.py); the test process
    # and XLA's intra-op pool get one here.
    "one_thread": Variance({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                            "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false"}, ("torch", "jax")),
}


def cpu() -> dict:
    """The CPU model and the ISA flags that matter to kernel choice."""
    info = Path("/proc/cpuinfo")
    fields = {}  # the first processor's "key: value" lines
    for line in (info.read_text() if info.exists() else "").splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    model = fields.get("model name") or platform.processor()
    flags = fields.get("flags", "").split()
    isas = sorted(f for f in flags if f.startswith(("avx", "sse4", "fma", "amx")))
    return {"model": model, "cores": os.cpu_count(), "isas": isas}


def tests_for(variance: Variance, only: list[str] | None, stack: str | None = None) -> list[str]:
    """The files (or node ids) of ``only``, or every numerics test file, of the variance's stacks (of
    ``stack`` alone when given)."""
    chosen = only or [t for s in ("torch", "jax") for t in NUMERICS_TESTS[s]]
    stacks = [s for s in variance.stacks if stack in (None, s)]
    return [t for t in chosen if any(t.startswith(f"tests/{s}_backend/") for s in stacks)
            or not t.startswith(("tests/torch_backend/", "tests/jax_backend/"))]


def run_variance(name: str, variance: Variance, tests: list[str], workdir: Path,
                 timeout_scale: float) -> dict:
    """One pytest process over ``tests`` under ``variance``'s environment, its gloo launches' timeouts
    scaled by ``timeout_scale``, with an inductor cache of its own: inductor's cache key does not include
    ``ATEN_CPU_CAPABILITY``, so a variance would otherwise run kernels another one compiled (under avx2 on an
    AVX-512 CPU the compiled test's losses were then 7% off, FSDP2's as much as ours)."""
    xml = workdir / f"{name}.xml"
    env = os.environ | variance.env | {TIMEOUT_SCALE_ENV: str(timeout_scale),
                                       "TORCHINDUCTOR_CACHE_DIR": str(workdir / f"{name}.inductor")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    start = time.perf_counter()
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", *tests]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = round(time.perf_counter() - start, 1)
    if not xml.exists():
        return {"env": variance.env, "tests": tests, "wall_s": wall, "passed": 0, "skipped": 0,
                "failed": [{"node": "<pytest>", "message": proc.stdout[-2000:] + proc.stderr[-2000:]}],
                "commit": _commit()}
    passed = skipped = 0
    failed = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        problem = case.find("failure") if case.find("failure") is not None else case.find("error")
        if problem is not None:
            node = f"{case.get('classname').replace('.', '/')}.py::{case.get('name')}"
            failed.append({"node": node, "message": (problem.get("message") or "")[:1000]})
        elif case.find("skipped") is not None:
            skipped += 1
        else:
            passed += 1
    return {"env": variance.env, "tests": tests, "wall_s": wall, "passed": passed, "skipped": skipped,
            "failed": failed, "commit": _commit()}


def _commit() -> str:
    """The checkout's commit, with ``+changes`` when the tree differs from it."""
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return git("rev-parse", "--short=12", "HEAD") + ("+changes" if git("status", "--porcelain") else "")


def report(results: dict) -> str:
    c = results["cpu"]
    lines = ["# Numerics-sensitive tests under emulated machine variance", "",
             f"`python -m experiments.variance_check`, last on {c['model']} ({c['cores']} cores; "
             f"ISAs: {', '.join(c['isas'])}); each row names the CPU and commit it ran on.", "",
             "| variance | environment | CPU | commit | passed | failed | skipped | wall s |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in results["variances"].items():
        env = " ".join(f"`{k}={v}`" for k, v in r["env"].items()) or "(none)"
        counts = f"{r['passed']} | {len(r['failed'])} | {r['skipped']}"
        lines.append(f"| {name} | {env} | {r.get('cpu', EARLIER_CPU)} | {r.get('commit', '?')} | {counts} | "
                     f"{r['wall_s']} |")
    skipped = results["not_run"]
    if skipped:
        lines += ["", "Not run (the CPU lacks the ISA): " + ", ".join(skipped) + "."]
    lines += ["", "Tests (of each variance's stacks): " + ", ".join(f"`{t}`" for t in results["tests"]) + "."]
    for name, r in results["variances"].items():
        base, _, stack = name.partition(" (")
        if base in VARIANCES and r["tests"] != tests_for(VARIANCES[base], None, stack.rstrip(")") or None):
            lines.append(f"- {name} ran only: " + ", ".join(f"`{t}`" for t in r["tests"]) + ".")
    for name, r in results["variances"].items():
        for f in r["failed"]:
            lines.append(f"- {name}: `{f['node']}`: {f['message'].splitlines()[0] if f['message'] else ''}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="comma-separated test files or node ids (default: NUMERICS_TESTS)")
    parser.add_argument("--variances", help=f"comma-separated, of {', '.join(VARIANCES)} (default: all)")
    parser.add_argument("--out", default=str(RESULTS / "variance_check"), help="stem of the .md and .json")
    parser.add_argument("--stack", choices=tuple(NUMERICS_TESTS),
                        help="this stack's tests only, in rows named 'variance (stack)' (after changing it)")
    parser.add_argument("--jobs", type=int, default=1, help="pytest processes at a time")
    parser.add_argument("--update", action="store_true",
                        help="keep the other variances of an earlier run in --out (rows name their commit)")
    parser.add_argument("--timeout-scale", type=float, default=10.0,
                        help="multiplies the gloo launches' timeouts (this checks numerics, not speed)")
    args = parser.parse_args(argv)
    names = args.variances.split(",") if args.variances else list(VARIANCES)
    unknown = sorted(set(names) - set(VARIANCES))
    if unknown:
        parser.error(f"unknown variances {unknown}; known: {list(VARIANCES)}")
    only = args.only.split(",") if args.only else None
    machine = cpu()
    results = {"cpu": machine, "tests": only or [t for ts in NUMERICS_TESTS.values() for t in ts],
               "variances": {}}
    earlier = Path(f"{args.out}.json")
    if args.update and earlier.exists():
        results["variances"] = json.loads(earlier.read_text())["variances"]
    runnable = [n for n in names if tests_for(VARIANCES[n], only, args.stack)]
    results["not_run"] = [n for n in runnable if VARIANCES[n].needs_isa not in (None, *machine["isas"])]
    with tempfile.TemporaryDirectory() as workdir, ThreadPoolExecutor(args.jobs) as pool:
        runs = {n: pool.submit(run_variance, n, VARIANCES[n], tests_for(VARIANCES[n], only, args.stack),
                               Path(workdir), args.timeout_scale)
                for n in runnable if n not in results["not_run"]}
        for name, future in runs.items():
            r = future.result() | {"cpu": machine["model"]}
            results["variances"][f"{name} ({args.stack})" if args.stack else name] = r
            print(f"{name}: {r['passed']} passed, {len(r['failed'])} failed, {r['wall_s']} s", flush=True)
    Path(f"{args.out}.json").write_text(json.dumps(results, indent=1) + "\n")
    Path(f"{args.out}.md").write_text(report(results))
    sys.exit(0 if all(not r["failed"] for r in results["variances"].values()) else 1)


if __name__ == "__main__":
    main()
