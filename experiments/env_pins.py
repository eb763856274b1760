"""Pins for installing ragged-fsdp into an environment that brings its own torch and JAX (GPU box, cluster).

    python3 -m experiments.env_pins > pins.txt && python3 -m pip install -c pins.txt -e .

Prints one ``name==version`` line for each torch or JAX distribution installed (torch, jax, jaxlib and
JAX's CUDA plugins, ``jax-cuda*``), so pip installs only what is missing and replaces none of them: a
package that needs another torch or JAX makes pip fail instead of swapping the CUDA builds for others.
Refuses (exit 2) when torch or JAX is missing or older than the project needs: pip would fetch a
build of its own choosing, on PyPI a CPU-only JAX.
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys

NEEDED = {"torch": (2, 11), "jax": (0, 10)}  # pyproject.toml's lower bounds
KEPT = ("torch", "jax", "jaxlib")


def release(version: str) -> tuple[int, ...]:
    """``2.11.0+cu130`` -> (2, 11): major and minor."""
    return tuple(int(part) for part in version.split("+")[0].split(".")[:2])


def pins() -> list[str]:
    installed = {d.metadata["Name"].lower().replace("_", "-"): d.version for d in metadata.distributions()}
    for name, floor in NEEDED.items():
        if name not in installed:
            raise SystemExit(f"env_pins: {name} is not installed in {sys.executable}; install your CUDA "
                             f"{name} first (pip would otherwise bring one of its own choosing)")
        if release(installed[name]) < floor:
            floor_text = ".".join(map(str, floor))
            raise SystemExit(f"env_pins: {name} {installed[name]} is older than the {floor_text} that "
                             "ragged-fsdp needs")
    kept = [n for n in sorted(installed) if n in KEPT or n.startswith("jax-cuda")]
    return [f"{n}=={installed[n]}" for n in kept]


if __name__ == "__main__":
    try:
        print("\n".join(pins()))
    except SystemExit as e:
        print(e, file=sys.stderr)
        sys.exit(2)
