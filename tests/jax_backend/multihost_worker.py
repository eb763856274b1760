"""One process of the two-process multi-host test (started by test_multihost.py with subprocess).

Each process owns 2 host CPU devices; ``jax.distributed.initialize`` joins them into one 4-device mesh, and
CPU collectives across processes go through gloo. The run trains llama-tiny in float64 like the test's
single-device reference (conftest.reference: the fp32 model built without x64, then copied to float64;
built under x64, flax would draw other initial values) and saves a neutral checkpoint (process 0 writes)
plus the losses.

Usage, with the repository root on PYTHONPATH:
    python tests/jax_backend/multihost_worker.py PROCESS_ID PORT OUT_DIR
"""

import os
import sys

from experiments._xla import host_devices_flags

# Before jax is imported: 2 devices, and the test process's other flags (its optimization level, an ISA
# limit), so that XLA compiles as it does for the reference: at XLA's default optimization level (the suite
# runs at 0) flax's fp32 initializers draw other last bits, and the model starts 1.3e-7 from the reference's.
os.environ["XLA_FLAGS"] = host_devices_flags(2)
os.environ["JAX_PLATFORMS"] = "cpu"

import json  # noqa: E402

import jax  # noqa: E402

try:  # CPU collectives across processes; newer JAX versions may pick gloo by default and drop the flag
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
except (AttributeError, KeyError, ValueError):
    pass


def main() -> None:
    pid, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2, process_id=pid,
                               initialization_timeout=60)
    from flax import nnx

    from jax_backend import make_mesh, save_neutral_checkpoint
    from jax_backend.models import Llama, parallelize
    from tests.jax_backend.jax_reference import BATCH, SEQ, STEPS, float64, run_fsdp

    assert jax.device_count() == 4 and jax.local_device_count() == 2
    import numpy as np

    batches = np.random.default_rng(0).integers(0, 256, size=(STEPS, BATCH, SEQ + 1)).astype(np.int32)
    model = float64(Llama(rngs=nnx.Rngs(0)))
    with jax.enable_x64(True):
        fsdp = parallelize(model, make_mesh((4,), ("fsdp",)), remat=True)
        losses, buffers = run_fsdp(fsdp, model, batches)  # shards span both processes: saved, not unsharded
        save_neutral_checkpoint(os.path.join(out, "ckpt"), buffers, fsdp.layouts)
    if pid == 0:
        with open(os.path.join(out, "losses.json"), "w") as f:
            json.dump(losses, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
