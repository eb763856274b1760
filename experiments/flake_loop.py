"""Every multi-process test and the demo, N times on the current checkout: how often does anything fail?

A round runs the selected test files in one pytest process, then ``python -m experiments.demo`` (what
``make demo`` runs). The multi-process test files are found by what they launch (gloo workers through
``tests/torch_backend/_dist.py``, torchrun, JAX processes, the demo, the notebook kernel, the benchmarks'
ranks); the selection is printed and recorded, so a file the patterns miss shows. A failure is a failed or
erroring test (its node id and the first lines of its message, from pytest's JUnit XML), a pytest process
that ends abnormally after its tests passed (a crash at exit, e.g. SIGABRT), or a demo that exits non-zero.
Nothing is retried. The report is rewritten after every round, so a loop cut short keeps what it ran;
``--resume`` continues it while the code is unchanged (only ``NOT_CODE`` may differ from the commit it
started on).

    python -m experiments.flake_loop     # 20 rounds; writes experiments/results/flake_loop.{md,json}
    python -m experiments.flake_loop --resume   # the rounds an earlier, cut-short loop did not run
    python -m experiments.flake_loop --rounds 2 --only test_demo --only test_train_torch --no-demo

Run it on a quiet machine: it takes about as long per round as the multi-process part of ``make test``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results"
# What a test file contains when it starts more than one process (the benchmarks' launches go through
# experiments._distributed.spawn_ranks).
LAUNCHES = re.compile(r"\b_dist\b|_train_launch|experiments\.demo|nbclient|multihost_worker|"
                      r"torch\.distributed\.run|start_processes|spawn_ranks|torch_vs_fsdp2|moe_vs_fsdp2|"
                      r"calibrate_layer|gpu_check")
MESSAGE_LINES = 12


def multi_process_tests() -> list[str]:
    """Test files (relative to the repository) that launch processes, in path order."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                  if LAUNCHES.search(p.read_text()))


def _first_lines(text: str) -> str:
    return "\n".join(text.strip().splitlines()[:MESSAGE_LINES])


def run_tests(files: list[str], timeout_s: float) -> tuple[int, list[dict], dict[str, float]]:
    """One pytest process over ``files``; returns the number of tests, the failures and each file's
    seconds (its tests' times, from the JUnit XML)."""
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", *files]
        try:
            done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired as e:
            return 0, [{"test": "pytest", "message": f"did not finish within {timeout_s:.0f} s\n"
                        + _first_lines((e.stdout or b"")[-3000:].decode(errors="replace"))}], {}
        if not xml.exists():
            return 0, [{"test": "pytest", "message": f"exit {done.returncode}, no report:\n"
                        + _first_lines(done.stdout[-3000:] + done.stderr[-3000:])}], {}
        failures, count, seconds = [], 0, {}
        for case in ET.parse(xml).iter("testcase"):
            count += 1
            where = case.get("classname", "").replace(".", "/") + ".py"
            seconds[where] = seconds.get(where, 0.0) + float(case.get("time") or 0)
            for bad in [*case.iter("failure"), *case.iter("error")]:
                name = f"{where}::{case.get('name')}"
                failures.append({"test": name, "message": _first_lines(
                    (bad.get("message") or "") + "\n" + (bad.text or ""))})
        if done.returncode not in (0, 1) or (done.returncode == 1 and not failures):
            # the tests passed (or their failures are listed) but the process itself ended abnormally
            failures.append({"test": "pytest process", "message": f"exit {done.returncode} after the tests:\n"
                             + _first_lines(done.stderr[-3000:] or done.stdout[-3000:])})
        return count, failures, seconds


def run_demo(args: list[str], timeout_s: float) -> list[dict]:
    cmd = [sys.executable, "-m", "experiments.demo", *args]
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return [{"test": "experiments.demo", "message": f"did not finish within {timeout_s:.0f} s"}]
    if done.returncode == 0:
        return []
    return [{"test": "experiments.demo", "message": f"exit {done.returncode}:\n"
             + _first_lines(done.stderr[-3000:])}]


def _git(*a: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True)


def checkout() -> dict:
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no").stdout.strip())
    return {"commit": _git("rev-parse", "HEAD").stdout.strip(), "dirty": dirty}


# What a round cannot read, so it may change while a loop is resumed: the results, the prose (no test of
# the selection reads docs/ or a .md file), and this driver (it runs the tests; none runs it).
NOT_CODE = ("experiments/results", "docs", "*.md", "experiments/flake_loop.py")


def same_code(commit: str) -> bool:
    """The checkout's tracked files equal ``commit``'s, but for ``NOT_CODE``."""
    return _git("diff", "--quiet", commit, "--", ".", *(f":(exclude){p}" for p in NOT_CODE)).returncode == 0


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() \
        else platform.processor()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "load_at_start": load}


def markdown(report: dict) -> str:
    lines = [
        "# flake_loop: every multi-process test and the demo, repeated",
        "",
        f"`{report['command']}` on {report['checkout']['commit'][:12]}"
        f"{' (uncommitted changes)' if report['checkout']['dirty'] else ''}, {report['machine']['cpu']}, "
        f"{report['machine']['cores']} cores, {report['wall_s'] / 60:.1f} min.",
        "",
        f"**{report['rounds']} rounds{_of_planned(report)}, {report['failed_rounds']} with a failure, "
        f"{len(report['failures'])} "
        f"failures** ({report['tests_per_round']} tests per round"
        f"{', and the demo' if report['demo'] else ''}).",
        "",
        "Test files: " + ", ".join(f"`{f}`" for f in report["test_files"]),
        "",
    ]
    if report.get("round_s"):
        timed = len(report["round_s"])
        slowest = sorted(report.get("file_s", {}).items(), key=lambda kv: -kv[1])[:8]
        minutes = sum(report["round_s"]) / timed / 60
        lines += [f"Rounds recorded with times: {timed}, {minutes:.1f} min each on average; slowest files, "
                  "seconds per round: "
                  + ", ".join(f"`{f}` {t / timed:.0f}" for f, t in slowest) + ".", ""]
    if report["failures"]:
        lines += ["| round | test | message |", "|---|---|---|"]
        for f in report["failures"]:
            message = f["message"].replace("|", "\\|").replace("\n", "<br>")
            lines.append(f"| {f['round']} | `{f['test']}` | {message} |")
        lines.append("")
    return "\n".join(lines)


def _of_planned(report: dict) -> str:
    planned = report.get("planned_rounds", report["rounds"])
    return "" if planned == report["rounds"] else f" of {planned} (cut short: `--resume` runs the rest)"


def resumed(out: Path, files: list[str], demo: bool) -> dict | None:
    """The report of an earlier loop over the same files and code, to continue; None to start afresh."""
    path = out / "flake_loop.json"
    if not path.exists():
        return None
    report = json.loads(path.read_text())
    if report["checkout"]["dirty"] or not same_code(report["checkout"]["commit"]):
        raise SystemExit(f"--resume: the code differs from {report['checkout']['commit'][:12]}, "
                         "where the recorded loop ran; start a new loop")
    if report["test_files"] != files or report["demo"] != demo:
        raise SystemExit("--resume: the recorded loop ran other test files or demo setting")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--only", action="append", default=[],
                        help="keep the test files whose path contains this (repeatable)")
    parser.add_argument("--no-demo", dest="demo", action="store_false", help="skip the demo")
    parser.add_argument("--demo-args", default="", help="experiments.demo's arguments (default: make demo's)")
    parser.add_argument("--timeout-min", type=float, default=40, help="per pytest process, and per demo")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--resume", action="store_true",
                        help="continue the loop recorded in --out (same code, same files) up to --rounds")
    args = parser.parse_args(argv)
    files = [f for f in multi_process_tests() if not args.only or any(o in f for o in args.only)]
    if not files and not args.demo:
        parser.error("nothing to run: no test file matches --only and --no-demo is set")
    print("test files:", *files, sep="\n  ")
    earlier = resumed(args.out, files, args.demo) if args.resume else None
    command = "python -m experiments.flake_loop " + shlex.join(sys.argv[1:] if argv is None else argv)
    report = earlier or {"command": command.strip(), "rounds": 0, "test_files": files, "tests_per_round": 0,
                         "demo": args.demo, "failed_rounds": 0, "failures": [], "wall_s": 0.0,
                         "checkout": checkout(), "machine": machine()}
    report["planned_rounds"] = args.rounds
    args.out.mkdir(parents=True, exist_ok=True)
    for r in range(report["rounds"] + 1, args.rounds + 1):
        start, found = time.time(), []
        if files:
            report["tests_per_round"], found, seconds = run_tests(files, args.timeout_min * 60)
            file_s = report.setdefault("file_s", {})
            for f, t in seconds.items():
                file_s[f] = file_s.get(f, 0.0) + t
        if args.demo:
            found += run_demo(args.demo_args.split(), args.timeout_min * 60)
        report["failures"] += [{"round": r, **f} for f in found]
        report["failed_rounds"] = len({f["round"] for f in report["failures"]})
        report["rounds"], report["wall_s"] = r, report["wall_s"] + time.time() - start
        report.setdefault("round_s", []).append(round(time.time() - start, 1))
        (args.out / "flake_loop.json").write_text(json.dumps(report, indent=1))
        (args.out / "flake_loop.md").write_text(markdown(report))
        print(f"round {r}/{args.rounds}: {len(found)} failure(s)"
              + "".join(f"\n  {f['test']}: {f['message'].splitlines()[0] if f['message'] else ''}"
                        for f in found), flush=True)
    print(markdown(report))
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
