"""Split Newton-Schulz on torch: one matrix orthogonalized by a group of devices
(``ragged.muon.assign_groups``).

The scheme is the core's (``ragged.muon.split_newton_schulz_reference``), on the wide orientation ``Xw``
(``m x n``, ``m <= n``) of a matrix whose ``g`` members each hold a column block ``Xw_i`` (``m x n/g``):
one all-reduce of the partial squared norms, then per step ``A = sum_i Xw_i Xw_i^T`` (an all-reduce of
``m x m``), member ``i``'s row block ``B_i = b A_i + c A_i A`` (all-gathered into ``B``) and
``Xw_i <- a Xw_i + B Xw_i``. Every collective runs on a torch sub-group of the members only.

Members receive the matrix as ``split_placement``'s row blocks (``rows / g`` rows each, from the core's
redistribution plan). For a tall stored matrix (rows > cols) a row block *is* the transposed column block
of ``Xw``; for rows <= cols the members swap sub-matrices (one ``all_to_all`` in the group) to hold column
blocks, and swap them back after Newton-Schulz.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

import ragged
import ragged.muon
from torch_backend._collectives import all_gather, all_reduce, all_to_all
from torch_backend.optim._params import at_least_fp32

Devices = tuple[int, ...]  # a sorted group of device indices on the sharding mesh dim


def split_placement(devices: Devices, world: int) -> ragged.RaggedShard:
    """Row blocks of ``rows / len(devices)`` rows, one on each member (in order), nothing elsewhere."""
    return ragged.RaggedShard((0,), tuple(int(d in devices) for d in range(world)))


def new_subgroups(groups: Sequence[Devices],
                  dim_group: dist.ProcessGroup) -> dict[Devices, dist.ProcessGroup]:
    """A torch process group for each distinct split group (more than one device) that this rank is in.

    ``groups`` hold indices on the mesh dim of ``dim_group``, the same list on every rank. ``new_group`` must
    be called by every rank of the job, for every group, in the same order (its name is a counter), so every
    rank learns the global ranks of every slice of the mesh dim (one ``all_gather_object`` over the job,
    HSDP replicas included) and creates each split group on each slice; it keeps the ones it is in. A group
    of the whole mesh dim is ``dim_group`` itself.
    """
    size = dist.get_world_size(dim_group)
    mine = tuple(dist.get_global_rank(dim_group, d) for d in range(size))  # index d -> global rank
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    me = dist.get_rank()
    out: dict[Devices, dist.ProcessGroup] = {}
    for ranks in sorted(set(every)):
        for devices in dict.fromkeys(g for g in groups if len(g) > 1):  # distinct, first-seen order
            members = [ranks[d] for d in devices]
            pg = dim_group if len(devices) == size else dist.new_group(members)  # the whole mesh dim: reuse
            if me in members:
                out[devices] = pg
    return out


def split_newton_schulz(rows: torch.Tensor, shape: tuple[int, int], group: dist.ProcessGroup,
                        steps: int = ragged.muon.NS_STEPS, eps: float = 1e-7,
                        dtype: torch.dtype | None = None) -> torch.Tensor:
    """This member's rows of Newton-Schulz of the ``shape`` matrix whose row blocks the group holds.

    Args:
        rows: this member's flat row block (``split_placement``: ``shape[0] / g`` rows, in group-rank order).
        shape: the whole matrix's shape; ``g`` (the group's size) must divide both sides.
        group: the members' process group.
        steps, eps, dtype: as ``newton_schulz`` (the result is ``rows``' dtype at least fp32). Each
            member's part of the Gram matrix is rounded to ``dtype`` by its own matmul, summed over the
            group in ``dtype`` at least fp32 and rounded to ``dtype`` again, where one device's matmul
            rounds once: in bf16 a split is about as far from one device's bf16 as bf16 is from exact.

    Returns:
        The flat row block of the orthogonalized matrix, in ``rows``' dtype at least fp32.

    Raises:
        ragged.PlanningError: ``g`` does not divide both sides; ValueError: ``rows`` is not one row block.
        Both before any collective (the first on every member alike).
    """
    g, i = dist.get_world_size(group), dist.get_rank(group)
    ragged.muon.split_newton_schulz_flops(shape, g)  # raises PlanningError unless g divides both sides
    if rows.numel() != shape[0] // g * shape[1]:
        raise ValueError(f"split_newton_schulz: member {i} of {g} holds {rows.numel()} elements of the "
                         f"{tuple(shape)} matrix; its row block has {shape[0] // g} x {shape[1]}")
    what = f"muon split {tuple(shape)}"
    a, b, c = ragged.muon.NS_COEFFS
    tall = shape[0] > shape[1]
    block = rows.view(shape[0] // g, shape[1])
    out = at_least_fp32(rows.dtype)
    dtype = dtype or out
    acc = at_least_fp32(dtype)  # the Gram matrix's and the norm's sums
    x = (block.T if tall else _rows_to_columns(block, g, group, what)).to(dtype)  # (m, n/g)
    m = x.shape[0]
    norm_sq = x.to(acc).square().sum().reshape(1)
    all_reduce(norm_sq, group, label=what).wait()
    x = x / (norm_sq.sqrt().to(dtype).squeeze() + eps)  # a 0-d norm in dtype, as newton_schulz's x.norm()
    poly = x.new_empty(m, m)
    for _ in range(steps):
        gram = (x @ x.T).to(acc)
        all_reduce(gram, group, label=what).wait()
        gram = gram.to(dtype)
        own = gram[i * m // g:(i + 1) * m // g]
        all_gather(poly, b * own + c * own @ gram, group, label=what).wait()
        x = a * x + poly @ x
    x = x.to(out)
    return (x.T if tall else _columns_to_rows(x, g, group, what)).reshape(-1)


def _rows_to_columns(block: torch.Tensor, g: int, group: dist.ProcessGroup, what: str) -> torch.Tensor:
    """Member ``i``'s ``(r, n)`` row block -> its ``(g r, n/g)`` column block ``i`` (sub-matrix ``j`` to
    member ``j``)."""
    r, n = block.shape
    send = block.reshape(r, g, n // g).transpose(0, 1)  # (g, r, n/g): [j] = my rows, member j's columns
    return _swap(send, group, what).view(g * r, n // g)  # [j] = member j's rows, my columns


def _columns_to_rows(block: torch.Tensor, g: int, group: dist.ProcessGroup, what: str) -> torch.Tensor:
    """The reverse of ``_rows_to_columns``: ``(g r, n/g)`` column block -> ``(r, n)`` row block."""
    m, w = block.shape
    send = block.reshape(g, m // g, w)  # [j] = member j's rows, my columns
    return _swap(send, group, what).transpose(0, 1).reshape(m // g, g * w)  # [j] = my rows, j's columns


def _swap(send: torch.Tensor, group: dist.ProcessGroup, what: str) -> torch.Tensor:
    """One ``all_to_all`` in the group: ``send[j]`` goes to member ``j``, ``out[j]`` came from ``j``."""
    send = send.contiguous()
    out = torch.empty_like(send)
    splits = [send[0].numel()] * send.shape[0]
    all_to_all(out.view(-1), send.view(-1), splits, splits, group, label=what).wait()
    return out
