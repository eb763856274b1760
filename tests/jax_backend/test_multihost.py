"""Multi-host: two local processes joined by ``jax.distributed.initialize`` train like one device."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import ragged
import ragged.checkpoint
from tests.jax_backend.jax_reference import (
    SPREAD_ORDERS,
    assert_within_spread,
    permuted_rows,
    train_references,
)
from tests.ports import coordinator_port

HERE = Path(__file__).parent


def test_two_processes_match_single_device(tmp_path, model, batches):
    port = coordinator_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent.parent)]),
           "OMP_NUM_THREADS": "1"}
    env.pop("XLA_FLAGS", None)  # each worker sets its own device count
    workers = [subprocess.Popen([sys.executable, str(HERE / "multihost_worker.py"), str(pid), str(port),
                                 str(tmp_path)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
               for pid in range(2)]
    outputs = []
    for w in workers:
        try:
            outputs.append(w.communicate(timeout=120)[0].decode())
        except subprocess.TimeoutExpired:
            for other in workers:
                other.kill()
            raise
    assert all(w.returncode == 0 for w in workers), "\n".join(o[-3000:] for o in outputs)
    losses = json.loads((tmp_path / "losses.json").read_text())
    checkpoint = ragged.checkpoint.load_neutral_checkpoint(tmp_path / "ckpt")
    assert [lay.world_size for lay in checkpoint.layouts] == [4] * len(checkpoint.layouts)
    # fp32, bounded by the spread of the reference over row orders in 4 micro-batches (as the batch is
    # split across the two processes' 4 devices; jax_reference.assert_within_spread): in float64 the two
    # processes trained 1.6e-7 from the float64 reference, so something across the processes (the gloo
    # collectives?) rounds like fp32 there. Measured: parameters 7.9e-7 (spread 5.9e-7), losses 9.0e-8
    # (spread 1.0e-7).
    orders = [batches, *(permuted_rows(batches, seed) for seed in range(SPREAD_ORDERS))]
    reference, *others = train_references(model, orders, micro_batches=4)
    params = {name: checkpoint.tensors[name].bits for name in reference[1]}
    assert_within_spread(losses, params, reference, others)
