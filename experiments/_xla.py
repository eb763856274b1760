"""XLA_FLAGS for a JAX process started with its own number of host CPU devices."""

from __future__ import annotations

import os

_DEVICE_COUNT = "--xla_force_host_platform_device_count"


def flags_but_device_count() -> str:
    """This process's XLA_FLAGS without the host device count (an optimization level, an ISA limit...)."""
    return " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(_DEVICE_COUNT))


def host_devices_flags(devices: int) -> str:
    """This process's XLA_FLAGS with the host device count set to ``devices``, the others kept: the new
    process compiles as this one does."""
    return f"{flags_but_device_count()} {_DEVICE_COUNT}={devices}".strip()
