"""Hardware profiles: what one GPU and its links can do, as data with a source for every number.

A profile is per GPU: peak dense bf16 FLOP/s, HBM capacity and bandwidth, NVLink bandwidth to the other
GPUs of its node and network bandwidth to other nodes (both per direction), GPUs per node, and the
latency of one step of a ring collective inside a node and across nodes. Bandwidths are the vendor's
peaks; how much of them a collective or a copy reaches is the simulator's ``Efficiency`` (calibrated),
not the profile's business.

A user adds a profile from a JSON file with the same field names (``load_hardware``); ``sources`` maps
field names to where each number comes from.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ragged import RaggedError

_GB = 1e9

# Network: one 400 Gb/s (ConnectX-7 NDR) NIC per GPU, rail-optimised, as on DGX/HGX H100, H200 and B200
# systems (NVIDIA DGX H100/B200 user guides: 8 x 400 Gb/s compute ports per node). The veScale paper does
# not state its H800 fabric; this assumes the same one NIC per GPU.
_NDR = "400 Gb/s per GPU (one ConnectX-7 NDR NIC per GPU), NVIDIA DGX/HGX system specs"
# Latencies are estimates of one ring step (a send/recv pair through NCCL), the order of nccl-tests'
# small-message times divided by their ring steps; they only matter for small units or thousands of ranks.
_LAT = "estimate: NCCL per-step latency, order of nccl-tests small-message times / ring steps"


@dataclass(frozen=True)
class Hardware:
    """One GPU type and its cluster links (see the module docstring). Units: FLOP/s, bytes, bytes/s, s."""

    name: str
    peak_flops: float  # dense bf16 tensor-core FLOP/s (no sparsity)
    hbm_bytes: float
    hbm_bandwidth: float
    nvlink_bandwidth: float  # per GPU, per direction, to the NVSwitch
    network_bandwidth: float  # per GPU, per direction, to other nodes
    gpus_per_node: int = 8
    intra_latency: float = 3e-6
    inter_latency: float = 8e-6
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("name", "sources"):
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise RaggedError(f"hardware {self.name!r}: {f.name} must be a number > 0, got {value!r}")
        if not isinstance(self.gpus_per_node, int):
            raise RaggedError(f"hardware {self.name!r}: gpus_per_node must be an int, "
                              f"got {self.gpus_per_node!r}")

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


PROFILES: dict[str, Hardware] = {
    "h100": Hardware(
        "h100", 989.4e12, 80 * _GB, 3.35e12, 450 * _GB, 50 * _GB,
        sources={"peak_flops": "NVIDIA H100 SXM datasheet: 1,979 TFLOPS bf16 with sparsity, half dense",
                 "hbm_bytes": "NVIDIA H100 SXM datasheet: 80 GB HBM3",
                 "hbm_bandwidth": "NVIDIA H100 SXM datasheet: 3.35 TB/s",
                 "nvlink_bandwidth": "NVIDIA H100 SXM datasheet: NVLink 900 GB/s (both directions)",
                 "network_bandwidth": _NDR, "intra_latency": _LAT, "inter_latency": _LAT}),
    "h200": Hardware(
        "h200", 989.4e12, 141 * _GB, 4.8e12, 450 * _GB, 50 * _GB,
        sources={"peak_flops": "NVIDIA H200 SXM datasheet: 1,979 TFLOPS bf16 with sparsity, half dense",
                 "hbm_bytes": "NVIDIA H200 SXM datasheet: 141 GB HBM3e",
                 "hbm_bandwidth": "NVIDIA H200 SXM datasheet: 4.8 TB/s",
                 "nvlink_bandwidth": "NVIDIA H200 SXM datasheet: NVLink 900 GB/s (both directions)",
                 "network_bandwidth": _NDR, "intra_latency": _LAT, "inter_latency": _LAT}),
    "h800": Hardware(
        "h800", 989.4e12, 80 * _GB, 3.35e12, 200 * _GB, 50 * _GB,
        sources={"peak_flops": "NVIDIA H800 SXM: the H100 SXM's compute (same GH100 die and clocks)",
                 "hbm_bytes": "NVIDIA H800 SXM: 80 GB HBM3",
                 "hbm_bandwidth": "NVIDIA H800 SXM: 3.35 TB/s, as H100 SXM",
                 "nvlink_bandwidth": "NVIDIA H800 SXM: NVLink 400 GB/s (both directions), 8 of H100's 18 "
                                     "links",
                 "network_bandwidth": _NDR + " (assumed for H800; the paper does not state it)",
                 "intra_latency": _LAT, "inter_latency": _LAT}),
    "b200": Hardware(
        "b200", 2.25e15, 180 * _GB, 8e12, 900 * _GB, 50 * _GB,
        sources={"peak_flops": "NVIDIA HGX B200 spec: 4.5 PFLOPS bf16 with sparsity per GPU, half dense",
                 "hbm_bytes": "NVIDIA HGX B200 spec: 1.44 TB HBM3e per 8 GPUs",
                 "hbm_bandwidth": "NVIDIA HGX B200 spec: 8 TB/s per GPU",
                 "nvlink_bandwidth": "NVIDIA NVLink 5: 1.8 TB/s per GPU (both directions)",
                 "network_bandwidth": _NDR, "intra_latency": _LAT, "inter_latency": _LAT}),
    "a100": Hardware(
        "a100", 312e12, 80 * _GB, 2.039e12, 300 * _GB, 25 * _GB,
        sources={"peak_flops": "NVIDIA A100 datasheet: 312 TFLOPS bf16 dense",
                 "hbm_bytes": "NVIDIA A100 80GB SXM datasheet: 80 GB HBM2e",
                 "hbm_bandwidth": "NVIDIA A100 80GB SXM datasheet: 2,039 GB/s",
                 "nvlink_bandwidth": "NVIDIA A100 datasheet: NVLink 600 GB/s (both directions)",
                 "network_bandwidth": "200 Gb/s per GPU (one HDR NIC per GPU), NVIDIA DGX A100 spec",
                 "intra_latency": _LAT, "inter_latency": _LAT}),
}


def hardware(name_or_path: str) -> Hardware:
    """A built-in profile by name (``h100``, ``h200``, ``h800``, ``b200``, ``a100``) or one from a JSON file.

    Raises:
        RaggedError: neither a known profile nor a readable profile file.
    """
    key = name_or_path.lower()
    if key in PROFILES:
        return PROFILES[key]
    if name_or_path.endswith(".json"):
        return load_hardware(name_or_path)
    raise RaggedError(f"unknown hardware {name_or_path!r}: use one of {', '.join(PROFILES)} or a profile "
                      "file ending in .json (see docs/simulate.md)")


def load_hardware(path: str | Path) -> Hardware:
    """A profile from a JSON object with ``Hardware``'s field names (``sources`` optional).

    Raises:
        RaggedError: the file is not a JSON object, has unknown or missing fields, or a bad value.
    """
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise RaggedError(f"hardware file {path}: not JSON ({e})") from None
    if not isinstance(data, dict):
        raise RaggedError(f"hardware file {path}: must be a JSON object")
    names = {f.name for f in fields(Hardware)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise RaggedError(f"hardware file {path}: unknown fields {unknown}; allowed: {sorted(names)}")
    try:
        return Hardware(**data)
    except TypeError as e:  # a missing required field
        raise RaggedError(f"hardware file {path}: {e}") from None
