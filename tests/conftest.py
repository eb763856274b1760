"""Test-wide setup that must happen before torch or jax is imported anywhere in the run.

JAX reads XLA_FLAGS once, at import: 8 host CPU devices let the JAX tests build meshes of 1, 2, 3, 4
and 8 devices in this one process. Torch multi-process tests must not fork after JAX is imported,
so they start workers with ``spawn``/``forkserver`` or use the threaded process group.
"""

import os

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
