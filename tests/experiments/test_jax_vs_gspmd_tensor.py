"""``experiments.jax_vs_gspmd --tensor 2`` run tiny in its own process (8 host devices, fsdp 4 x tensor 2):
the table's structure, ours and GSPMD computing the same losses, and the memory and collective columns read
from the compiled programs (recompiled here and compared). Timings are not checked."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import optax
import pytest
from flax import nnx

from experiments._gspmd import gspmd_step
from experiments._xla import host_devices_flags
from jax_backend import make_mesh
from jax_backend.models import Llama, cross_entropy, parallelize
from tests.experiments._train_launch import ROOT

RUNS = ["gspmd", "ours", "ours_kept", "ours_remat"]
MODELS = ["llama-tiny", "transformer"]
BATCH, SEQ = 32, 16  # the script's llama-tiny batch, and the sequence given below
# Ours against GSPMD, same parameters and batch: each step's loss is a mean of BATCH * SEQ token losses that
# the two programs sum in other orders, at most (n - 1) fp32 unit roundoffs (eps / 2) apart, relative; the
# parameters after one step differ by rounding far smaller (test_tensor_parallel: 2e-6 after 10 steps).
LOSS_RTOL = (BATCH * SEQ - 1) * 2.0**-24


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("tp_bench")
    # the run's XLA flags (its optimization level 0, an ISA limit of experiments.variance_check), 8 devices
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "OMP_NUM_THREADS": "1", "XLA_FLAGS": host_devices_flags(8)}
    # --eigen-threads: XLA:CPU's default threading, as this process compiles with (the resharded programs'
    # temporary memory depends on it: llama-tiny 2,616,352 B with the script's one thread per device,
    # 2,587,424 B without)
    done = subprocess.run(
        [sys.executable, "-m", "experiments.jax_vs_gspmd", "--tensor", "2", "--models", ",".join(MODELS),
         "--rounds", "2", "--warmup", "1", "--steps-per-round", "1", "--seq", str(SEQ),
         "--transformer", "128,32,4,96,2", "--eigen-threads", "--stem", "jax_vs_gspmd_tensor2",
         "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (out / "jax_vs_gspmd_tensor2.md").read_text().startswith(
        "# ragged-fsdp JAX backend vs GSPMD (8 host CPU devices, mesh fsdp 4 x tensor 2)")
    return json.loads((out / "jax_vs_gspmd_tensor2.json").read_text())


def test_every_model_has_every_run_on_the_2d_mesh(result):
    assert result["meta"]["mesh"] == {"fsdp": 4, "tensor": 2}
    assert [(r["model"], r["run"]) for r in result["rows"]] == [(m, run) for m in MODELS for run in RUNS]
    for m in MODELS:
        for run in RUNS:
            assert len(result["raw"][m][run]["losses"]) == 2  # 2 rounds of 1 step
            assert len(result["raw"][m][run]["round_s"]) == 1  # the warm-up round is not counted


def test_ours_computes_gspmd_s_losses(result):
    for row in result["rows"]:
        got = result["raw"][row["model"]][row["run"]]["losses"]
        want = result["raw"][row["model"]]["gspmd"]["losses"]
        np.testing.assert_allclose(got, want, rtol=LOSS_RTOL, err_msg=f"{row['model']} {row['run']}")
        assert row["max_loss_diff"] == max(abs(a - b) for a, b in zip(got, want))


def test_memory_and_collectives_are_the_compiled_programs(result):
    """llama-tiny's rows against its two programs compiled here from the same model, mesh and batch shape:
    temporary memory is ``memory_analysis()``'s (ours with the defaults), and ours kept gathered gathers and
    reduce-scatters each of its 6 units once (the tensor-parallel all-reduces are the partitioner's, not
    counted here)."""
    rows = {r["run"]: r for r in result["rows"] if r["model"] == "llama-tiny"}
    model, opt = Llama(rngs=nnx.Rngs(0)), optax.adamw(1e-3, weight_decay=0.1)
    fsdp = parallelize(model, make_mesh((4, 2), ("fsdp", "tensor")), tensor_axis="tensor")
    tokens = np.zeros((BATCH, SEQ), np.int32)
    buffers = fsdp.shard_params(model)
    ours = fsdp.train_step(opt, cross_entropy).lower(buffers, fsdp.init(opt, buffers), tokens, tokens)
    step, carry = gspmd_step(model, cross_entropy, opt, fsdp.mesh, data_axes=fsdp.data_axes,
                             tensor=fsdp.tensor_parallel)
    gspmd = step.lower(*carry, tokens, tokens)
    for run, lowered in (("ours", ours), ("gspmd", gspmd)):
        temp = lowered.compile().memory_analysis().temp_size_in_bytes
        assert rows[run]["temp_bytes"] == temp > 0, run
    kept = rows["ours_kept"]
    assert kept["all_gather_ops"] == kept["reduce_scatter_ops"] == len(fsdp.layouts) == 6
