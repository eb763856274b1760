"""Multi-host: two local processes joined by ``jax.distributed.initialize`` train like one device."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import ragged
import ragged.checkpoint
from tests.jax_backend.jax_reference import assert_float64_parity
from tests.ports import coordinator_port

HERE = Path(__file__).parent


def test_two_processes_match_single_device(tmp_path, reference):
    port = coordinator_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent.parent)]),
           "OMP_NUM_THREADS": "1"}
    # XLA_FLAGS passed on: each worker replaces the device count and keeps the rest
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
    params = {name: checkpoint.tensors[name].bits for name in reference[1]}
    # Both processes train in float64, against the float64 reference (jax_reference.float64_bound).
    assert_float64_parity(losses, params, reference)
