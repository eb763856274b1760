"""The alpha-beta model of ring collectives inside a node and across nodes (hierarchical where it applies).

A ring collective over ``p`` ranks takes ``p - 1`` steps; in each step every rank sends one chunk to its
neighbour, so a step costs ``alpha + chunk / beta`` (latency plus bytes over the ring's bandwidth):

- all-gather of ``n``-byte shards: ``(p - 1) (alpha + n / beta)`` (each rank receives ``(p - 1) n``);
- reduce-scatter to ``n``-byte shards: the same (each rank sends and reduces ``(p - 1) n``);
- all-reduce of ``m`` bytes: reduce-scatter then all-gather, ``2 (p - 1) (alpha + m / (p beta))``.

Which ``beta`` a ring gets depends on where its ranks live (``ring_link``): inside one node it is the
NVLink bandwidth. A ring spanning nodes runs one NCCL channel per NIC: each node's boundary edge carries
one channel per NIC, so the node's ``local`` group members cross it together at ``local x network``
bandwidth while each GPU still pushes all its bytes through its own NVLink; ``beta = min(nvlink,
local x network)`` and every step waits on the slower inter-node hop (``alpha`` = inter-node latency).
A group with one member per node (an HSDP replica group) thus runs at one NIC's bandwidth.

The hierarchical (two-level) algorithm does the inter-node part among the ``nodes`` ranks with the same
local index (each on its own NIC) and the intra-node part over NVLink, which trades bandwidth for
``nodes + local - 2`` steps instead of ``p - 1``; ``collective_time`` takes the faster of the two, as
NCCL's tuner picks an algorithm. Every bandwidth is multiplied by an efficiency (calibrated).
"""

from __future__ import annotations

from dataclasses import dataclass

from ragged import RaggedError
from ragged.simulate._hardware import Hardware

KINDS = ("all_gather", "reduce_scatter", "all_reduce")


@dataclass(frozen=True)
class Link:
    """One ring's per-step latency ``alpha`` (s) and bandwidth ``beta`` (bytes/s)."""

    alpha: float
    beta: float


def ring_time(kind: str, p: int, nbytes: float, link: Link) -> float:
    """Seconds for a ring ``kind`` over ``p`` ranks (see the module docstring).

    ``nbytes`` is the shard per rank for ``all_gather`` (input) and ``reduce_scatter`` (output), and
    the whole buffer for ``all_reduce``.
    """
    if kind not in KINDS:
        raise RaggedError(f"collective kind {kind!r} is not one of {KINDS}")
    if p < 1:
        raise RaggedError(f"{kind}: group size must be >= 1, got {p}")
    if p == 1:
        return 0.0
    if kind == "all_reduce":
        return 2 * (p - 1) * (link.alpha + nbytes / p / link.beta)
    return (p - 1) * (link.alpha + nbytes / link.beta)


def group_shape(hw: Hardware, p: int, stride: int) -> tuple[int, int]:
    """``(local, nodes)``: members per node and nodes spanned by ``p`` ranks ``stride`` apart.

    Ranks fill nodes in order (rank ``r`` on node ``r // gpus_per_node``). A group whose ranks span at
    most one node is taken to sit inside one; a larger one must cover whole nodes the same way in each.

    Raises:
        RaggedError: the group straddles nodes unevenly (12 ranks on nodes of 8).
    """
    n = hw.gpus_per_node
    span = p * stride  # consecutive ranks the group's pattern covers
    local = min(p, max(1, n // stride))
    even = span <= n or (span % n == 0 and (stride % n == 0 or n % stride == 0))
    if not even or p % local:
        raise RaggedError(f"a group of {p} ranks {stride} apart does not fill nodes of {n} GPUs evenly")
    return local, p // local


def ring_link(hw: Hardware, p: int, stride: int, efficiency: float) -> Link:
    """The ring's link for ``p`` ranks ``stride`` apart (see the module docstring)."""
    local, nodes = group_shape(hw, p, stride)
    if nodes == 1:
        return Link(hw.intra_latency, efficiency * hw.nvlink_bandwidth)
    return Link(hw.inter_latency, efficiency * min(hw.nvlink_bandwidth, local * hw.network_bandwidth))


def hierarchical_time(kind: str, hw: Hardware, p: int, stride: int, nbytes: float,
                      efficiency: float) -> float:
    """Two-level ``kind``: inter-node rings of ``nodes`` ranks (one NIC each), intra-node rings of ``local``.

    All-gather: inter-node first on the ``n``-byte shards, then intra-node on ``nodes x n``; reduce-scatter
    the reverse; all-reduce: intra reduce-scatter, inter all-reduce of ``m / local``, intra all-gather.
    """
    local, nodes = group_shape(hw, p, stride)
    intra = Link(hw.intra_latency, efficiency * hw.nvlink_bandwidth)
    inter = Link(hw.inter_latency, efficiency * hw.network_bandwidth)
    if kind == "all_reduce":
        return (ring_time("reduce_scatter", local, nbytes / local, intra)
                + ring_time("all_reduce", nodes, nbytes / local, inter)
                + ring_time("all_gather", local, nbytes / local, intra))
    return ring_time(kind, nodes, nbytes, inter) + ring_time(kind, local, nodes * nbytes, intra)


def collective_time(kind: str, hw: Hardware, p: int, nbytes: float, *, stride: int = 1,
                    efficiency: float = 1.0) -> float:
    """The faster of the flat ring and the two-level algorithm for ``kind`` over ``p`` ranks.

    Args:
        kind: ``all_gather``, ``reduce_scatter`` or ``all_reduce``.
        hw: the hardware profile.
        p: ranks in the group.
        nbytes: shard bytes per rank (all-gather input, reduce-scatter output) or the all-reduce buffer.
        stride: rank distance between consecutive group members (1 for an FSDP group, the FSDP group
            size for an HSDP replica group).
        efficiency: the fraction of link bandwidth the collective reaches.
    """
    if p == 1:
        return 0.0
    flat = ring_time(kind, p, nbytes, ring_link(hw, p, stride, efficiency))
    local, nodes = group_shape(hw, p, stride)
    if nodes == 1 or local == 1:
        return flat
    return min(flat, hierarchical_time(kind, hw, p, stride, nbytes, efficiency))
