"""A TCP port for a launch that must be told one in advance (a JAX coordinator), with the least chance
that another process takes it between the choice and the bind.

A port probed free with ``bind(0)`` comes from the kernel's ephemeral range, from which every outgoing
connection and every other ``bind(0)`` on the machine also draws (gloo alone opens several per process
pair), so it can be handed to someone else in the seconds before the launched process binds it. A port
below that range is never handed out by the kernel; only another launcher picking the same number at
random, among about twenty thousand, can collide.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_FLOOR = 10_000  # above the registered ports services usually listen on


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except OSError:  # not Linux: the IANA dynamic range starts here
        return 49152


def coordinator_port() -> int:
    """A port below the ephemeral range that nothing listens on now."""
    rng = random.SystemRandom()
    for _ in range(100):
        port = rng.randrange(_FLOOR, _ephemeral_start())
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free TCP port between {_FLOOR} and {_ephemeral_start()}")
