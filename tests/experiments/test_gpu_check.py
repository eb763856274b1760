"""The device check (experiments/gpu_check.sh and .py) on CPU: its clear exit, its budget, its records,
the FLOP count its MFU divides by, and the stages whose logic runs on CPU; the CUDA stages are skipped."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from experiments import gpu_check

ROOT = Path(__file__).resolve().parents[2]
NO_GPU = not torch.cuda.is_available()


@pytest.mark.skipif(not NO_GPU, reason="a GPU is here: the check would run")
def test_without_a_gpu_the_script_and_each_stage_exit_at_once_writing_nothing(tmp_path):
    out = tmp_path / "results"
    script = subprocess.run(["bash", str(ROOT / "experiments" / "gpu_check.sh"), str(out)], cwd=ROOT,
                            capture_output=True, text=True, timeout=120,
                            env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable})
    assert script.returncode == 2
    assert "no GPU here" in script.stderr
    stage = subprocess.run([sys.executable, "-m", "experiments.gpu_check", "fsdp", "--out", str(out)],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert stage.returncode == 2
    assert "sees no CUDA device" in stage.stderr
    assert not out.exists()


def test_the_budgets_add_up_to_the_stated_total_under_six_minutes():
    total = sum(gpu_check.STAGES.values())
    assert total <= 330 < 360
    assert f"{total} s of budgets" in gpu_check.__doc__
    assert f"({total} s in all" in (ROOT / "experiments" / "gpu_check.sh").read_text()
    plan = subprocess.run([sys.executable, "-m", "experiments.gpu_check", "plan"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=True).stdout
    assert [line.split() for line in plan.splitlines()] == [[k, str(v)] for k, v in gpu_check.STAGES.items()]


def test_each_check_is_on_disk_when_made_and_the_summary_survives_a_timeout(tmp_path):
    report = gpu_check.Report(tmp_path, "muon")
    report("overlapped = sequential", True, True)
    assert json.loads((tmp_path / gpu_check.CHECKS).read_text()) == {
        "stage": "muon", "check": "overlapped = sequential", "value": True, "ok": True}
    report("against single-process Muon", "max abs 1e-3", False)
    gpu_check.Report(tmp_path, "fsdp")("step", "81.0 ms, 41.0%")
    line = gpu_check.summary_line(tmp_path, "muon", 124, 60)
    assert re.match(r"muon +TIMEOUT +60s of 60s, 2 checks, failed: against single-process Muon$", line), line
    assert gpu_check.summary_line(tmp_path, "fsdp", 0, 90).endswith("1 checks; step = 81.0 ms, 41.0%")
    assert "0 checks" in gpu_check.summary_line(tmp_path, "jax", 137, 3)


def test_the_mfu_flop_count_is_six_per_matmul_weight_plus_attention():
    """Against the torch model's own parameters: every 2-D weight but the embedding table is a matmul."""
    from ragged.models import LlamaConfig
    from torch_backend.models import Llama

    c = LlamaConfig(32768, 4096, 2, 32, 8, 128, 14336)
    with torch.device("meta"):
        model = Llama(c)
    weights = sum(p.numel() for n, p in model.named_parameters() if p.ndim == 2 and "tok_embeddings" not in n)
    seq = 4096
    assert gpu_check.model_flops_per_token(c, seq) == 6 * weights + 12 * c.n_layers * c.dim * seq


def test_the_muon_stage_on_two_cpu_processes(tmp_path):
    """The stage's own code with CPU tensors (no side stream): two gloo processes, overlapped against
    sequential and against one process, on the GPU's matrices with every dim a quarter (the same shapes
    otherwise: wide, tall, square; 40 s at full size on 2 cores)."""
    report = gpu_check.Report(tmp_path, "muon")
    shapes = {n: (r // 4, c // 4) for n, (r, c) in gpu_check.MUON_SHAPES.items()}
    gpu_check.stage_muon(report, device="cpu", shapes=shapes)
    rows = [json.loads(line) for line in (tmp_path / gpu_check.CHECKS).read_text().splitlines()]
    assert len(rows) == 4 and all(r["ok"] for r in rows), rows


def test_the_adam8bit_stage_compares_the_quantized_state_too():
    got = gpu_check._adam8bit_train("cpu")
    assert {k.split(".", 1)[0] for k in got} == {"w", "v"}
    state = [k for k in got if "." in k]
    assert any(got[k].dtype == torch.uint8 for k in state), state  # the 8-bit codes are compared
    assert all(torch.equal(a, b) for a, b in zip(got.values(), gpu_check._adam8bit_train("cpu").values()))


@pytest.mark.skipif(NO_GPU, reason="needs a GPU")
@pytest.mark.parametrize("stage", list(gpu_check.STAGES))
def test_stage_on_the_gpu(tmp_path, stage):
    result = subprocess.run([sys.executable, "-m", "experiments.gpu_check", stage, "--out", str(tmp_path)],
                            cwd=ROOT, capture_output=True, text=True, timeout=gpu_check.STAGES[stage] + 60)
    assert result.returncode == 0, result.stdout + result.stderr
