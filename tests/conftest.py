"""Test-wide setup that must happen before torch or jax is imported anywhere in the run.

JAX reads XLA_FLAGS once, at import: 8 host CPU devices let the JAX tests build meshes of 1, 2, 3, 4
and 8 devices in this one process. Torch multi-process tests must not fork after JAX is imported,
so they start workers with ``spawn``/``forkserver`` or use the threaded process group.
"""

import os

# LLVM optimization level 0: XLA:CPU compiles a quarter faster, and compiling is most of a JAX test's time
# on these small models. The suite passes at both levels (bit-exactness checks included); the benchmarks
# in experiments/ run at XLA's default.
for _flag in ("--xla_force_host_platform_device_count=8", "--xla_backend_optimization_level=0"):
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
