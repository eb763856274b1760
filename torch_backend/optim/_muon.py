"""Distributed Muon (veScale-FSDP Algorithm 2) on RaggedShard DTensors, AdamW for the other parameters.

For each 2-D parameter: the momentum update runs on the local piece; the (Nesterov) momentum goes to
``RaggedShard.whole_on(ns_device)`` (a gather), Newton-Schulz orthogonalizes it on that one device, the
matrix's NS device (the other devices hold nothing and skip it), and the result goes back to the
parameter's placement (a scatter) and is applied. NS devices are chosen once by the core's load
balancing (``ragged.muon.assign_ns_devices`` over ``ragged.muon.newton_schulz_flops``), the same way on
every device. With ``max_imbalance`` (max / mean FLOPs per device; opt-in) the matrices that stop it
are *split* (``ragged.muon.assign_groups``): a group of ``g`` devices each gets ``rows / g`` rows
(``_muon_split``) and runs ``1/g`` of its Newton-Schulz, talking over a torch sub-group of the members.
Plain tensors (single process) and replicated DTensors run Newton-Schulz locally.

Matrices are ``ragged.muon.muon_matrices``'s: 2-D weights, and each matrix ``p[e]`` of a 3-D stack (fused
experts ``[E, m, n]``: one matrix per expert, gathered whole to its own NS device from the pieces of the
stack the devices hold, ``ragged.muon.matrix_placement``); biases and vectors get AdamW. NS devices are
balanced per mesh dim that shards matrices: under expert parallelism the experts' matrices over their
``fsdp`` ranks, the other matrices over all ranks.

Two schedules give the same bits. Sequential (``overlap=False``): each matrix is gathered,
orthogonalized and scattered in turn (two ``DTensor.redistribute`` calls). Overlapped (default): the
matrices go in the core's NS-device buckets (``ragged.muon.ns_device_buckets``: the ``j``-th matrix of
every NS device), each bucket's gathers are one asynchronous ``all_to_all`` (the core's plan over the
concatenated holdings, ``ragged.muon.bucket_holdings``), and so are its scatters; while a device
orthogonalizes its matrix of bucket ``j``, the gathers of the next ``in_flight`` buckets and the
scatters of the last ``in_flight`` are in flight (on CUDA on a side stream of the parameter's device; on
CPU on the backend's thread). Split matrices run after them in both schedules, in their own sequential
path: one gather of all of them, the groups' Newton-Schulz, one scatter.

The update is scaled by ``sqrt(max(1, rows / cols))`` (Keller Jordan's shape rule, so that tall matrices
get the same per-row step). Weight decay is decoupled. Parameters that are not 2-D use AdamW with
fp32 state (``adamw_lr``, ``adamw_betas``, ``adamw_eps``).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import ragged
import ragged.muon
from torch_backend.optim._adam8bit import adam_direction
from torch_backend.optim._muon_split import new_subgroups, split_newton_schulz, split_placement
from torch_backend.optim._params import ParamwiseOptimizer, local_slice, named_params
from torch_backend.placement import RaggedShard, make_dtensor, ragged_mesh_dim, start_all_to_all

Finish = Callable[[], torch.Tensor]  # waits for an issued exchange and returns what arrived

def newton_schulz(g: torch.Tensor, steps: int = ragged.muon.NS_STEPS, eps: float = 1e-7,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Approximately orthogonalize a matrix: 5 quintic steps on ``X / ||X||_F``, computed in ``dtype``.

    Each step maps the singular values by ``p(s) = a s + b s^3 + c s^5`` (``ragged.muon.NS_COEFFS``) and keeps
    the singular vectors, so the result is ``U p^steps(S / ||G||_F) V^T``: close to the polar factor
    ``U V^T``, with singular values in roughly [0.7, 1.2]. Works on the wide orientation (transposed when
    rows > cols) so ``X X^T`` is the smaller Gram matrix. Returns fp32 (bf16 ``dtype`` halves the
    matmul cost on accelerators at a stated tolerance, see docs/optimizers.md).
    """
    a, b, c = ragged.muon.NS_COEFFS
    x = g.to(dtype)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / (x.norm() + eps)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.T if tall else x).float()


class _Matrix(NamedTuple):
    """One matrix Muon orthogonalizes in a step: a 2-D parameter, or matrix ``index`` of a 3-D stack."""

    p: torch.Tensor
    index: int | None  # None: the 2-D parameter itself
    group: dict[str, Any]
    update: torch.Tensor  # this device's flat slice of the matrix's (Nesterov) momentum
    lo: int  # where that slice starts in the parameter's local flat tensor
    shape: tuple[int, int]
    placements: tuple | None  # the matrix's placements on ``p``'s mesh; None: whole on this device

    @property
    def key(self) -> tuple[int, int | None]:
        return id(self.p), self.index


def orthogonalize(m: _Matrix, ns_device: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Newton-Schulz of the whole matrix ``m`` from this device's flat slice ``m.update``; returns the slice.

    A ragged-sharded matrix goes to ``ns_device`` and back (two redistributions); anything else is whole here.
    """
    update = m.update
    if m.placements is None:
        return newton_schulz(update.view(m.shape), dtype=dtype).reshape(-1)
    mesh, placements, dim = m.p.device_mesh, m.placements, _ragged_dim(m.p)
    on_ns_device = list(placements)
    on_ns_device[dim] = RaggedShard.whole_on(ns_device, mesh.size(dim))
    # run_check=False: both locals are cut from the layout here, so skip from_local's size all_gather.
    sharded = make_dtensor(update, mesh, placements, m.shape)
    whole = sharded.redistribute(mesh, on_ns_device).to_local()  # the full matrix there, empty elsewhere
    if whole.numel():
        whole = newton_schulz(whole.view(m.shape), dtype=dtype).reshape(-1)
    back = make_dtensor(whole, mesh, on_ns_device, m.shape)
    return back.redistribute(mesh, placements).to_local()


class _Bucket:
    """Matrices on one mesh dim moved together: the core's plan from their local slices (concatenated) to
    their ``targets`` (an NS-device bucket: ``whole_on(ns_device)`` each; the split bucket: a group's row
    blocks each)
    and the plan back."""

    def __init__(self, matrices: list[_Matrix], targets: list[ragged.RaggedShard]) -> None:
        dim = _ragged_dim(matrices[0].p)
        mesh = matrices[0].p.device_mesh
        self.group, self.rank, self.world = mesh.get_group(dim), mesh.get_local_rank(dim), mesh.size(dim)
        shapes = [m.shape for m in matrices]
        placements = [m.placements[dim].core for m in matrices]
        numels = [math.prod(s) for s in shapes]
        local = ragged.muon.bucket_holdings(
            [ragged.ragged_holdings(q, s) for q, s in zip(placements, shapes)], numels)
        held = ragged.muon.bucket_holdings(
            [ragged.ragged_holdings(t, s) for t, s in zip(targets, shapes)], numels)
        self.gather_plan, self.scatter_plan = ragged.transfers(local, held), ragged.transfers(held, local)
        self.local_numels = [q.local_numel(s, self.rank) for q, s in zip(placements, shapes)]
        self.held_numels = [t.local_numel(s, self.rank) for t, s in zip(targets, shapes)]
        # an NS-device bucket holds at most one matrix per device: the one this device orthogonalizes
        self.mine = next((k for k, n in enumerate(self.held_numels) if n), None)

    def gather(self, updates: list[torch.Tensor], stream: torch.cuda.Stream | None) -> Finish:
        """Start moving the local slices ``updates`` to their targets; finishing gives what this device
        holds of them there, concatenated (``held_numels``)."""
        return start_all_to_all(torch.cat(updates), self.gather_plan, sum(self.held_numels), self.group,
                                self.rank, self.world, stream=stream, what="muon gather")

    def scatter(self, held: torch.Tensor,
                stream: torch.cuda.Stream | None) -> Callable[[], list[torch.Tensor]]:
        """Start moving this device's results back; finishing gives the local slice of every matrix."""
        finish = start_all_to_all(held, self.scatter_plan, sum(self.local_numels), self.group, self.rank,
                                  self.world, stream=stream, what="muon scatter")
        return lambda: list(finish().split(self.local_numels))


class Muon(ParamwiseOptimizer):
    """Muon for matrices (distributed as in veScale-FSDP Algorithm 2), AdamW for the rest.

    Matrices are ``ragged.muon.muon_matrices``'s: 2-D weights and each matrix ``p[e]`` of a 3-D stack (fused
    experts); biases (also fused experts' ``[E, n]`` ones) and vectors get AdamW. NS devices are balanced
    over each mesh dim that shards matrices, on its own (expert parallelism: experts over their ``fsdp``
    ranks, the rest over all ranks).

    Args:
        params: parameters or ``named_parameters()`` (names appear in errors).
        lr: Muon's learning rate; momentum: its momentum; nesterov: use the Nesterov update.
        weight_decay: decoupled weight decay for every parameter.
        adamw_lr, adamw_betas, adamw_eps: AdamW for the parameters that are not matrices.
        overlap: bucket the matrices by NS device and overlap their gathers and scatters with Newton-Schulz
            (``False``: one matrix after another; both give the same bits).
        in_flight: buckets whose gathers (and, separately, scatters) may be in flight while a device
            orthogonalizes; a device then holds at most ``2 * in_flight + 1`` whole matrices.
        ns_dtype: the dtype Newton-Schulz computes in (``torch.bfloat16`` for the fast path).
        max_imbalance: ``None``: one NS device per matrix (``ragged.muon.assign_ns_devices``). A target
            max / mean of per-device Newton-Schulz FLOPs: the matrices that stop it are split over groups
            of devices (``ragged.muon.assign_groups``; the others keep one NS device). Splitting balances
            the FLOPs (llama3-8b's layers at 256 devices: 1.057 instead of 2.11) but adds collectives inside
            each group at every Newton-Schulz step (``ragged.muon.split_newton_schulz_bytes``), so it is
            opt-in, as in JAX's ``muon_plan``.

    Raises:
        ragged.PlacementError: a DTensor placement other than RaggedShard / Replicate.
        ValueError: ``in_flight < 1`` or ``max_imbalance < 1``.

    Example:
        >>> opt = Muon(model.named_parameters(), lr=0.02, adamw_lr=3e-4)
    """

    def __init__(self, params: Iterable[Any], lr: float = 0.02, momentum: float = 0.95, nesterov: bool = True,
                 weight_decay: float = 0.0, adamw_lr: float = 3e-4,
                 adamw_betas: tuple[float, float] = (0.9, 0.95), adamw_eps: float = 1e-8, *,
                 overlap: bool = True, in_flight: int = 2, ns_dtype: torch.dtype = torch.float32,
                 max_imbalance: float | None = None) -> None:
        if in_flight < 1:
            raise ValueError(f"Muon: in_flight={in_flight} must be >= 1 (buckets in flight at once)")
        super().__init__(params, dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                                      adamw_lr=adamw_lr, adamw_betas=adamw_betas, adamw_eps=adamw_eps))
        self.overlap, self.in_flight, self.ns_dtype = overlap, in_flight, ns_dtype
        by_dim: dict[tuple, list[tuple[str, _Matrix]]] = {}  # the matrices of each sharding mesh dim
        for p, name, group in named_params(self):
            local_slice(p, name)  # placement check, before any collective
            for m in _matrices(p, name, group, None):
                by_dim.setdefault(_mesh_dim(p), []).append((name, m))
        # NS devices (or split groups) balanced per mesh dim; assign_groups checks max_imbalance >= 1,
        # group_load that every g divides its matrix
        self._groups: dict[tuple, tuple[int, ...]] = {}
        self._loads: dict[tuple, np.ndarray] = {}
        for key, found in by_dim.items():
            world = _ragged_world(found[0][1].p)
            shapes = [m.shape for _, m in found]
            groups = ragged.muon.assign_groups(shapes, world, max_imbalance=max_imbalance)
            self._loads[key] = ragged.muon.group_load(shapes, groups, world)
            self._groups.update({m.key: devices for (_, m), devices in zip(found, groups)})
        self._subgroups = self._new_subgroups(by_dim)
        self._buckets: dict[tuple, Any] = {}  # the plans of one set of matrices, built once
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._matrices: list[_Matrix] = []  # the matrices of a step

    def ns_devices(self, p: torch.Tensor, index: int | None = None) -> tuple[int, ...]:
        """The devices (indices on the sharding mesh dim) that run the Newton-Schulz of the 2-D parameter
        ``p``, or of matrix ``index`` of the 3-D stack ``p``: its NS device, or the group it is split over.
        (Plain and replicated tensors run it whole on every device.)"""
        return self._groups[(id(p), index)]

    def ns_device(self, p: torch.Tensor, index: int | None = None) -> int:
        """The NS device of the 2-D parameter ``p`` (or of matrix ``index`` of the stack ``p``): the one
        device that orthogonalizes the whole matrix.

        Raises:
            ValueError: its Newton-Schulz is split over a group of devices (see ``ns_devices``).
        """
        devices = self.ns_devices(p, index)
        if len(devices) > 1:
            raise ValueError(f"Muon: the {tuple(p.shape)} matrix is split over devices {devices}, so it has "
                             "no single NS device")
        return devices[0]

    def newton_schulz_load(self) -> np.ndarray:
        """Newton-Schulz matmul FLOPs each device of the sharding mesh dim runs per step (int64, one entry per
        device): ``ragged.muon.group_load`` of this optimizer's assignment, each member of a group of ``g``
        running ``1/g`` of its matrix. ``max / mean`` is the step's load imbalance.

        Raises:
            ValueError: the matrices are sharded over several mesh dims (expert parallelism), each balanced
                on its own.
        """
        if len(self._loads) > 1:
            raise ValueError(f"Muon: matrices are sharded over {len(self._loads)} mesh dims, each balanced "
                             "on its own; there is no one load per device")
        return next(iter(self._loads.values()), np.zeros(1, np.int64)).copy()

    def _new_subgroups(self, by_dim: dict[tuple, list[tuple[str, _Matrix]]]
                       ) -> dict[tuple, dist.ProcessGroup]:
        """Check every split matrix, then create the process groups of its devices (``new_subgroups``),
        keyed by ``(mesh, mesh dim, devices)``: once, in parameter order, the same on every device."""
        split: dict[tuple, list[tuple[int, ...]]] = {}
        for (mesh, dim), found in by_dim.items():
            for name, m in found:
                devices = self.ns_devices(m.p, m.index)
                if len(devices) > 1 and dim is not None:
                    world = mesh.size(dim)
                    split_placement(devices, world).validate(m.shape, name, world)
                    split.setdefault((mesh, dim), []).append(devices)
        return {(mesh, dim, devices): pg for (mesh, dim), groups in split.items()
                for devices, pg in new_subgroups(groups, mesh.get_group(dim)).items()}

    def _update(self, p: torch.Tensor, name: str, group: dict[str, Any]) -> None:
        if ragged.muon.muon_matrices(name, tuple(p.shape)):  # orthogonalized in _finish_step, all together
            self._matrices.extend(_matrices(p, name, group, self._momentum(p, name, group)))
        else:
            self._adamw(p, name, group)

    def _finish_step(self) -> None:
        matrices, self._matrices = self._matrices, []
        whole, split = [], []
        for m in matrices:
            if m.placements is None:  # plain or replicated: whole on this device
                self._apply(m, newton_schulz(m.update.view(m.shape), dtype=self.ns_dtype).reshape(-1))
            else:
                (whole if len(self.ns_devices(m.p, m.index)) == 1 else split).append(m)
        if self.overlap:
            for items in _by_mesh_dim(whole):
                self._overlapped(items)
        else:
            for m in whole:
                self._apply(m, orthogonalize(m, self.ns_device(m.p, m.index), self.ns_dtype))
        for items in _by_mesh_dim(split):
            self._split(items)

    def _overlapped(self, items: list[_Matrix]) -> None:
        """Bucketed gathers, Newton-Schulz and scatters of matrices on one mesh dim, ``in_flight`` ahead."""
        key = tuple(m.key for m in items)
        if key not in self._buckets:
            order = ragged.muon.ns_device_buckets([self.ns_device(m.p, m.index) for m in items])
            world = _ragged_world(items[0].p)
            self._buckets[key] = [
                (_Bucket([items[k] for k in b],
                         [ragged.RaggedShard.whole_on(self.ns_device(items[k].p, items[k].index), world)
                          for k in b]), b)
                for b in order]
        buckets = self._buckets[key]
        stream = self._stream(items[0].update.device)
        gathers: deque = deque()
        scatters: deque = deque()

        def start_gather(j: int) -> None:
            bucket, members = buckets[j]
            gathers.append(bucket.gather([items[k].update for k in members], stream))

        def finish_scatter() -> None:
            members, finish = scatters.popleft()
            for k, ortho in zip(members, finish()):
                self._apply(items[k], ortho)

        for j in range(min(self.in_flight, len(buckets))):
            start_gather(j)
        for j, (bucket, members) in enumerate(buckets):
            whole = gathers.popleft()()
            if j + self.in_flight < len(buckets):
                start_gather(j + self.in_flight)
            if bucket.mine is not None:
                shape = items[members[bucket.mine]].shape
                whole = newton_schulz(whole.view(shape), dtype=self.ns_dtype).reshape(-1)
            scatters.append((members, bucket.scatter(whole, stream)))
            while len(scatters) > self.in_flight:
                finish_scatter()
        while scatters:
            finish_scatter()

    def _split(self, items: list[_Matrix]) -> None:
        """Split Newton-Schulz of matrices on one mesh dim: one gather of all of them to their groups' row
        blocks, each member's ``split_newton_schulz`` in parameter order (the same order on every device, so
        no two groups wait on each other in a cycle), one scatter back. Not overlapped."""
        key = ("split", *(m.key for m in items))
        if key not in self._buckets:
            world = _ragged_world(items[0].p)
            self._buckets[key] = _Bucket(items, [split_placement(self.ns_devices(m.p, m.index), world)
                                                 for m in items])
        bucket = self._buckets[key]
        held = bucket.gather([m.update for m in items], None)().split(bucket.held_numels)
        done = []
        for m, rows in zip(items, held):
            if rows.numel():  # a member of the matrix's group
                devices = self.ns_devices(m.p, m.index)
                pg = self._subgroups[(m.p.device_mesh, _ragged_dim(m.p), devices)]
                rows = split_newton_schulz(rows, m.shape, pg, dtype=self.ns_dtype)
            done.append(rows)
        for m, ortho in zip(items, bucket.scatter(torch.cat(done), None)()):
            self._apply(m, ortho)

    def _stream(self, device: torch.device) -> torch.cuda.Stream | None:
        """The side stream of ``device`` for Muon's exchanges (``None`` on CPU)."""
        if device.type != "cuda":
            return None
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device)
        return self._streams[device]

    def _momentum(self, p: torch.Tensor, name: str, group: dict[str, Any]) -> torch.Tensor:
        """Update the momentum of ``p``'s local slice; return the (Nesterov) direction to orthogonalize."""
        grad, _ = local_slice(p.grad, name + ".grad")
        state = self.state[p]
        if not state:
            state["momentum"] = torch.zeros_like(grad, dtype=torch.float32)
        buf, mu = state["momentum"], group["momentum"]
        buf.lerp_(grad.float(), 1 - mu)
        return torch.lerp(grad.float(), buf, mu) if group["nesterov"] else buf.clone()

    def _apply(self, m: _Matrix, ortho: torch.Tensor) -> None:
        local = local_slice(m.p, "param")[0][m.lo:m.lo + ortho.numel()]  # the matrix's part of it
        local.mul_(1 - m.group["lr"] * m.group["weight_decay"])
        local.add_(ortho.to(local.dtype), alpha=-m.group["lr"] * ragged.muon.muon_scale(m.shape))

    def _adamw(self, p: torch.Tensor, name: str, group: dict[str, Any]) -> None:
        local, _ = local_slice(p, name)
        grad, _ = local_slice(p.grad, name + ".grad")
        state = self.state[p]
        if not state:
            state.update(step=0, exp_avg=torch.zeros_like(local, dtype=torch.float32),
                         exp_avg_sq=torch.zeros_like(local, dtype=torch.float32))
        state["step"] += 1
        direction = adam_direction(state["exp_avg"], state["exp_avg_sq"], grad.float(), state["step"],
                                   group["adamw_betas"], group["adamw_eps"])
        local.mul_(1 - group["adamw_lr"] * group["weight_decay"])
        local.add_(direction.to(local.dtype), alpha=-group["adamw_lr"])


def _ragged_dim(p: torch.Tensor) -> int | None:
    """The mesh dim that ragged-shards ``p`` (``None`` for plain or replicated tensors)."""
    return ragged_mesh_dim(p.placements) if isinstance(p, DTensor) else None


def _mesh_dim(p: torch.Tensor) -> tuple:
    """``(mesh, mesh dim)`` that ragged-shard ``p``; ``(None, None)`` for plain or replicated tensors."""
    dim = _ragged_dim(p)
    return (None, None) if dim is None else (p.device_mesh, dim)


def _by_mesh_dim(items: list[_Matrix]) -> list[list[_Matrix]]:
    """Matrices grouped by the mesh and mesh dim that ragged-shard them, in order."""
    out: dict[tuple, list[_Matrix]] = {}
    for m in items:
        out.setdefault(_mesh_dim(m.p), []).append(m)
    return list(out.values())


def _matrices(p: torch.Tensor, name: str, group: dict[str, Any],
              update: torch.Tensor | None) -> list[_Matrix]:
    """The matrices of parameter ``p`` (``ragged.muon.muon_matrices``: none, the 2-D ``p``, or each matrix of
    the 3-D stack ``p``) with their slices of ``update``, this device's flat slice of ``p``'s momentum
    (``None``: an empty slice, for planning)."""
    shape = tuple(p.shape)
    count = ragged.muon.muon_matrices(name, shape)
    if not count:
        return []
    if update is None:
        update = torch.empty(0)
    dim = _ragged_dim(p)
    if len(shape) == 2:
        return [_Matrix(p, None, group, update, 0, shape, None if dim is None else tuple(p.placements))]
    size = math.prod(shape[1:])
    out = []
    for e in range(count):
        if dim is None:  # whole here: the matrix is elements [e size, (e + 1) size) of the local tensor
            out.append(_Matrix(p, e, group, update[e * size:(e + 1) * size], e * size, shape[1:], None))
            continue
        core = p.placements[dim].core
        start, stop = core.ranges(shape, name)[p.device_mesh.get_local_rank(dim)]
        lo = min(max(e * size, start), stop) - start  # the matrix's part of the local slice
        hi = max(min((e + 1) * size, stop), start) - start
        placements = list(p.placements)
        placements[dim] = RaggedShard.from_core(ragged.muon.matrix_placement(core, shape, e, name))
        out.append(_Matrix(p, e, group, update[lo:hi], lo, shape[1:], tuple(placements)))
    return out


def _ragged_world(p: torch.Tensor) -> int:
    """Devices on the mesh dim that ragged-shards ``p`` (1 for plain or replicated tensors)."""
    dim = _ragged_dim(p)
    return 1 if dim is None else p.device_mesh.size(dim)
