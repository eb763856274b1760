"""Distributed Muon (veScale-FSDP Algorithm 2) on RaggedShard DTensors, AdamW for the other parameters.

For each matrix (a 2-D weight, or one of a stack's, below): the momentum update runs on the local piece;
the (Nesterov) momentum goes to ``RaggedShard.whole_on(ns_device)`` (a gather), Newton-Schulz
orthogonalizes it on that one device, the matrix's NS device (the other devices hold nothing and skip
it), and the result goes back to the parameter's placement (a scatter) and is applied. NS devices are
chosen once by the core's load balancing (``ragged.muon.assign_ns_devices`` over
``ragged.muon.newton_schulz_flops``), the same way on every device. With tensor parallelism a matrix is
spread over the ragged mesh dim *and* its ``Shard`` (TP) mesh dims: its NS device is one device of all of
them together (its NS group, ``_muon_group``), so the gather brings every TP part too and the NS devices
are balanced over ``dp * tp`` devices. With ``max_imbalance`` (max / mean FLOPs per device; opt-in) the
matrices that stop it are *split* (``ragged.muon.assign_groups``): a group of ``g`` devices each gets
``rows / g`` rows (``_muon_split``) and runs ``1/g`` of its Newton-Schulz, talking over a torch sub-group
of the members.
Plain tensors (single process) and replicated DTensors run Newton-Schulz locally.

Matrices are ``ragged.muon.muon_matrices``'s: 2-D weights, and each matrix ``p[e]`` of a 3-D stack (fused
experts ``[E, m, n]``: one matrix per expert, gathered whole from the pieces of the stack its NS group
holds, ``ragged.muon.matrix_holdings``); biases and vectors get AdamW. Each NS group balances its own
matrices: NS devices (and split groups) are assigned over the members of each NS group on its own, so
matrices spread over NS groups of different sizes train together. Under expert parallelism the experts'
matrices are balanced over their EP rank's ``fsdp`` devices and the other matrices over all devices.

Two schedules give the same bits. Sequential (``overlap=False``): each matrix is gathered,
orthogonalized and scattered in turn (a bucket of one matrix: two ``all_to_all``). Overlapped (default): the
matrices go in the core's NS-device buckets (``ragged.muon.ns_device_buckets``: the ``j``-th matrix of
every NS device), each bucket's gathers are one asynchronous ``all_to_all`` (the core's plan over the
concatenated holdings, ``ragged.muon.bucket_holdings``), and so are its scatters; while a device
orthogonalizes its matrix of bucket ``j``, the gathers of the next ``in_flight`` buckets and the
scatters of the last ``in_flight`` are in flight (on CUDA on a side stream of the parameter's device; on
CPU on the backend's thread). Split matrices run after them in both schedules, in their own sequential
path: one gather of all of them, the groups' Newton-Schulz, one scatter.

The update is scaled by ``sqrt(max(1, rows / cols))`` (Keller Jordan's shape rule, so that tall matrices
get the same per-row step). Weight decay is decoupled. Parameters that are not matrices use AdamW
(``adamw_lr``, ``adamw_betas``, ``adamw_eps``). The state, the momentum and Newton-Schulz compute in at least
fp32: fp32 for bf16 and fp32 parameters, float64 for float64 ones (``ns_dtype`` may lower Newton-Schulz
alone, to bf16 say).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

import ragged
import ragged.muon
from torch_backend.optim._adam8bit import adam_direction
from torch_backend.optim._muon_group import NSGroup, group_dims, holdings, new_ns_group
from torch_backend.optim._muon_split import new_subgroups, split_newton_schulz, split_placement
from torch_backend.optim._params import ParamwiseOptimizer, at_least_fp32, local_slice, named_params
from torch_backend.placement import start_all_to_all

Finish = Callable[[], torch.Tensor]  # waits for an issued exchange and returns what arrived

def newton_schulz(g: torch.Tensor, steps: int = ragged.muon.NS_STEPS, eps: float = 1e-7,
                  dtype: torch.dtype | None = None) -> torch.Tensor:
    """Approximately orthogonalize a matrix: 5 quintic steps on ``X / ||X||_F``, computed in ``dtype``
    (default ``g``'s, at least fp32).

    Each step maps the singular values by ``p(s) = a s + b s^3 + c s^5`` (``ragged.muon.NS_COEFFS``) and keeps
    the singular vectors, so the result is ``U p^steps(S / ||G||_F) V^T``: close to the polar factor
    ``U V^T``, with singular values in roughly [0.7, 1.2]. Works on the wide orientation (transposed when
    rows > cols) so ``X X^T`` is the smaller Gram matrix. Returns ``g``'s dtype at least fp32 (bf16 ``dtype``
    halves the matmul cost on accelerators at a stated tolerance, see docs/optimizers.md).
    """
    a, b, c = ragged.muon.NS_COEFFS
    out = at_least_fp32(g.dtype)
    x = g.to(dtype or out)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / (x.norm() + eps)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.T if tall else x).to(out)


class _Matrix(NamedTuple):
    """One matrix Muon orthogonalizes: a 2-D parameter, or matrix ``index`` of a 3-D stack, and where it
    lies (planned once)."""

    p: torch.Tensor
    index: int | None  # None: the 2-D parameter itself
    name: str  # the parameter's name, ``name[index]`` for a stack's matrix
    shape: tuple[int, int]
    ns: NSGroup | None  # its NS group; None: whole on this device (plain or replicated)
    held: ragged.Holdings  # what each member of ``ns`` holds of it: intervals of its flat storage
    lo: int  # its elements are ``[lo, hi)`` of this device's local (flat) elements of ``p``
    hi: int

    @property
    def key(self) -> tuple[int, int | None]:
        return id(self.p), self.index


Step = tuple[_Matrix, dict, torch.Tensor]  # a matrix, its param group, its slice of the (Nesterov) momentum


def _matrices(p: torch.Tensor, name: str, ns: NSGroup | None) -> list[_Matrix]:
    """The matrices of parameter ``p`` (``ragged.muon.muon_matrices``: the 2-D ``p``, or each matrix of the
    3-D stack ``p``), each with what the members of ``ns`` hold of it."""
    shape = tuple(p.shape)
    stack = holdings(p, ns, name) if ns is not None else (((0, p.numel()),),)  # of p's flat storage
    rank = 0 if ns is None else ns.rank
    if len(shape) == 2:
        return [_Matrix(p, None, name, shape, ns, stack, 0, sum(b - a for a, b in stack[rank]))]
    out = []
    for e in range(ragged.muon.muon_matrices(name, shape)):
        held, local = ragged.muon.matrix_holdings(stack, shape, e, name)
        out.append(_Matrix(p, e, f"{name}[{e}]", shape[1:], ns, held, *local[rank]))
    return out


class _Bucket:
    """Matrices of one NS group moved together: the core's plan from their local slices (concatenated) to
    their ``targets`` (an NS-device bucket: ``whole_on(ns_device)`` each; the split bucket: a group's row
    blocks each), and the plan back."""

    def __init__(self, matrices: list[_Matrix], targets: list[ragged.RaggedShard]) -> None:
        ns = matrices[0].ns
        self.group, self.rank, self.world = ns.group, ns.rank, ns.world
        local = [m.held for m in matrices]
        numels = [math.prod(m.shape) for m in matrices]
        held = [ragged.ragged_holdings(t, m.shape) for t, m in zip(targets, matrices)]
        local_all = ragged.muon.bucket_holdings(local, numels)
        held_all = ragged.muon.bucket_holdings(held, numels)
        self.gather_plan = ragged.transfers(local_all, held_all)
        self.scatter_plan = ragged.transfers(held_all, local_all)
        self.local_numels = [sum(b - a for a, b in h[self.rank]) for h in local]
        self.held_numels = [sum(b - a for a, b in h[self.rank]) for h in held]
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
    experts); biases (also fused experts' ``[E, n]`` ones) and vectors get AdamW. Each NS group (the devices
    a matrix's pieces are spread over) balances its own matrices, so under expert parallelism the experts'
    matrices are balanced over their ``fsdp`` devices and the other matrices over all devices.

    Args:
        params: parameters or ``named_parameters()`` (names appear in errors).
        lr: Muon's learning rate; momentum: its momentum; nesterov: use the Nesterov update.
        weight_decay: decoupled weight decay for every parameter.
        adamw_lr, adamw_betas, adamw_eps: AdamW for the parameters that are not matrices.
        overlap: bucket the matrices by NS device and overlap their gathers and scatters with Newton-Schulz
            (``False``: one matrix after another; both give the same bits).
        in_flight: buckets whose gathers (and, separately, scatters) may be in flight while a device
            orthogonalizes; a device then holds at most ``2 * in_flight + 1`` whole matrices.
        ns_dtype: the dtype Newton-Schulz computes in (``torch.bfloat16`` for the fast path); default: the
            momentum's (fp32, float64 for float64 parameters).
        max_imbalance: ``None``: one NS device per matrix (``ragged.muon.assign_ns_devices``). A target
            max / mean of per-device Newton-Schulz FLOPs: the matrices that stop it are split over groups
            of devices (``ragged.muon.assign_groups``; the others keep one NS device). Splitting balances
            the FLOPs (llama3-8b's layers at 256 devices: 1.057 instead of 2.11) but adds collectives inside
            each group at every Newton-Schulz step (``ragged.muon.split_newton_schulz_bytes``), so it is
            opt-in, as in JAX's ``muon_plan``.

    Raises:
        ragged.PlacementError: a DTensor placement other than RaggedShard / Shard / Replicate, or an uneven
            Shard.
        ValueError: ``in_flight < 1`` or ``max_imbalance < 1``.

    Example:
        >>> opt = Muon(model.named_parameters(), lr=0.02, adamw_lr=3e-4)
    """

    def __init__(self, params: Iterable[Any], lr: float = 0.02, momentum: float = 0.95, nesterov: bool = True,
                 weight_decay: float = 0.0, adamw_lr: float = 3e-4,
                 adamw_betas: tuple[float, float] = (0.9, 0.95), adamw_eps: float = 1e-8, *,
                 overlap: bool = True, in_flight: int = 2, ns_dtype: torch.dtype | None = None,
                 max_imbalance: float | None = None) -> None:
        if in_flight < 1:
            raise ValueError(f"Muon: in_flight={in_flight} must be >= 1 (buckets in flight at once)")
        super().__init__(params, dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                                      adamw_lr=adamw_lr, adamw_betas=adamw_betas, adamw_eps=adamw_eps))
        self.overlap, self.in_flight, self.ns_dtype = overlap, in_flight, ns_dtype
        named = []
        for p, name, _ in named_params(self):
            local_slice(p, name)  # placement check, before any collective
            if ragged.muon.muon_matrices(name, tuple(p.shape)):
                named.append((p, name))
        # the meshes and sharded mesh dims (RaggedShard, Shard) of the matrices, in parameter order
        keys = list(dict.fromkeys((p.device_mesh, group_dims(p)) for p, _ in named if group_dims(p)))
        ns_groups = {key: new_ns_group(*key) for key in keys}  # process groups: every rank, same order
        # each NS group's matrices (None: plain and replicated ones, whole on this device), in parameter order
        by_group: dict[NSGroup | None, list[_Matrix]] = {}
        self._planned: dict[int, list[_Matrix]] = {}  # id(parameter) -> its matrices
        for p, name in named:
            ns = ns_groups[(p.device_mesh, group_dims(p))] if group_dims(p) else None
            self._planned[id(p)] = _matrices(p, name, ns)
            by_group.setdefault(ns, []).extend(self._planned[id(p)])
        # NS devices (or split groups) balanced over each NS group's members on its own; assign_groups
        # checks max_imbalance >= 1, group_load that every g divides its matrix
        self._groups: dict[tuple, tuple[int, ...]] = {}
        self._loads: list[np.ndarray] = []
        for ns, found in by_group.items():
            world, shapes = 1 if ns is None else ns.world, [m.shape for m in found]
            groups = ragged.muon.assign_groups(shapes, world, max_imbalance=max_imbalance)
            self._loads.append(ragged.muon.group_load(shapes, groups, world))
            self._groups.update({m.key: devices for m, devices in zip(found, groups)})
        self._subgroups = self._new_subgroups(by_group)
        self._buckets: dict[tuple, Any] = {}  # the plans of one set of matrices, built once
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._matrices: list[Step] = []  # the matrices of a step

    def ns_devices(self, p: torch.Tensor, index: int | None = None) -> tuple[int, ...]:
        """The devices that run the Newton-Schulz of the 2-D parameter ``p``, or of matrix ``index`` of the
        3-D stack ``p``: its NS device, or the group it is split over, as member indices of its NS group (the
        sharding mesh dim, flattened with the tensor-parallel ones: ``dp_index * tp + tp_index`` on a (dp,
        tp) mesh). (Plain and replicated tensors run it whole on every device.)"""
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
        """Newton-Schulz matmul FLOPs each member of the NS group runs per step (int64, one entry per
        member): ``ragged.muon.group_load`` of this optimizer's assignment, each member of a group of ``g``
        running ``1/g`` of its matrix. ``max / mean`` is the step's load imbalance.

        Raises:
            ValueError: the matrices lie in several NS groups (expert parallelism; plain or replicated
                matrices next to sharded ones), each balanced on its own: there is no one load per member.
        """
        if len(self._loads) > 1:
            raise ValueError(f"Muon: the matrices lie in {len(self._loads)} NS groups, each balanced on its "
                             "own; there is no one load per member")
        return next(iter(self._loads), np.zeros(1, np.int64)).copy()

    def _new_subgroups(self, by_group: dict[NSGroup | None, list[_Matrix]]) -> dict[tuple, dist.ProcessGroup]:
        """Check every split matrix, then create the process groups of its devices (``new_subgroups``),
        keyed by ``(NS group, devices)``: once, in parameter order, the same on every device."""
        split: dict[NSGroup, list[tuple[int, ...]]] = {}
        for ns, found in by_group.items():
            for m in found:
                devices = self._groups[m.key]
                if len(devices) > 1 and ns is not None:
                    split_placement(devices, ns.world).validate(m.shape, m.name, ns.world)
                    split.setdefault(ns, []).append(devices)
        return {(ns, devices): pg for ns, groups in split.items()
                for devices, pg in new_subgroups(groups, ns.group).items()}

    def _update(self, p: torch.Tensor, name: str, group: dict[str, Any]) -> None:
        if id(p) in self._planned:  # orthogonalized in _finish_step, all matrices together
            update = self._momentum(p, name, group)
            self._matrices.extend((m, group, update[m.lo:m.hi]) for m in self._planned[id(p)])
        else:
            self._adamw(p, name, group)

    def _finish_step(self) -> None:
        matrices, self._matrices = self._matrices, []
        whole, split = [], []
        for m, group, update in matrices:
            if m.ns is None:  # plain or replicated: whole on this device
                self._apply(m, group, newton_schulz(update.view(m.shape), dtype=self.ns_dtype).reshape(-1))
            else:
                (whole if len(self._groups[m.key]) == 1 else split).append((m, group, update))
        for items in _by_ns_group(whole):
            if self.overlap:
                self._overlapped(items)
            else:  # one bucket per matrix: the same exchanges and Newton-Schulz, one matrix after another
                for item in items:
                    self._overlapped([item])
        for items in _by_ns_group(split):
            self._split(items)

    def _overlapped(self, items: list[Step]) -> None:
        """Bucketed gathers, Newton-Schulz and scatters of matrices of one NS group, ``in_flight`` ahead."""
        key = tuple(m.key for m, _, _ in items)
        if key not in self._buckets:
            ns_devices = [self._groups[m.key][0] for m, _, _ in items]
            self._buckets[key] = [
                (_Bucket([items[k][0] for k in b],
                         [ragged.RaggedShard.whole_on(ns_devices[k], items[k][0].ns.world) for k in b]), b)
                for b in ragged.muon.ns_device_buckets(ns_devices)]
        buckets = self._buckets[key]
        stream = self._stream(items[0][2].device)
        gathers: deque = deque()
        scatters: deque = deque()

        def start_gather(j: int) -> None:
            bucket, members = buckets[j]
            gathers.append(bucket.gather([items[k][2] for k in members], stream))

        def finish_scatter() -> None:
            members, finish = scatters.popleft()
            for k, ortho in zip(members, finish()):
                self._apply(items[k][0], items[k][1], ortho)

        for j in range(min(self.in_flight, len(buckets))):
            start_gather(j)
        for j, (bucket, members) in enumerate(buckets):
            whole = gathers.popleft()()
            if j + self.in_flight < len(buckets):
                start_gather(j + self.in_flight)
            if bucket.mine is not None:
                shape = items[members[bucket.mine]][0].shape
                whole = newton_schulz(whole.view(shape), dtype=self.ns_dtype).reshape(-1)
            scatters.append((members, bucket.scatter(whole, stream)))
            while len(scatters) > self.in_flight:
                finish_scatter()
        while scatters:
            finish_scatter()

    def _split(self, items: list[Step]) -> None:
        """Split Newton-Schulz of matrices of one NS group: one gather of all of them to their groups' row
        blocks, each member's ``split_newton_schulz`` in parameter order (the same order on every device, so
        no two groups wait on each other in a cycle), one scatter back. Not overlapped."""
        key = ("split", *(m.key for m, _, _ in items))
        if key not in self._buckets:
            targets = [split_placement(self._groups[m.key], m.ns.world) for m, _, _ in items]
            self._buckets[key] = _Bucket([m for m, _, _ in items], targets)
        bucket = self._buckets[key]
        held = bucket.gather([update for _, _, update in items], None)().split(bucket.held_numels)
        done = []
        for (m, _, _), rows in zip(items, held):
            if rows.numel():  # a member of the matrix's group
                pg = self._subgroups[(m.ns, self._groups[m.key])]
                rows = split_newton_schulz(rows, m.shape, pg, dtype=self.ns_dtype)
            done.append(rows)
        for (m, group, _), ortho in zip(items, bucket.scatter(torch.cat(done), None)()):
            self._apply(m, group, ortho)

    def _stream(self, device: torch.device) -> torch.cuda.Stream | None:
        """The side stream of ``device`` for Muon's exchanges (``None`` on CPU)."""
        if device.type != "cuda":
            return None
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device)
        return self._streams[device]

    def _momentum(self, p: torch.Tensor, name: str, group: dict[str, Any]) -> torch.Tensor:
        """Update the momentum of ``p``'s local slice; return the (Nesterov) direction to orthogonalize."""
        grad = local_slice(p.grad, name + ".grad").flat
        state = self.state[p]
        if not state:
            state["momentum"] = torch.zeros_like(grad, dtype=at_least_fp32(grad.dtype))
        buf, mu = state["momentum"], group["momentum"]
        grad = grad.to(buf.dtype)
        buf.lerp_(grad, 1 - mu)
        return torch.lerp(grad, buf, mu) if group["nesterov"] else buf.clone()

    def _apply(self, m: _Matrix, group: dict[str, Any], ortho: torch.Tensor) -> None:
        local = local_slice(m.p, "param").flat[m.lo:m.hi]  # the matrix's part of the parameter's elements
        local.mul_(1 - group["lr"] * group["weight_decay"])
        local.add_(ortho.to(local.dtype), alpha=-group["lr"] * ragged.muon.muon_scale(m.shape))

    def _adamw(self, p: torch.Tensor, name: str, group: dict[str, Any]) -> None:
        local = local_slice(p, name).flat
        grad = local_slice(p.grad, name + ".grad").flat
        state = self.state[p]
        if not state:
            dtype = at_least_fp32(grad.dtype)
            state.update(step=0, exp_avg=torch.zeros_like(local, dtype=dtype),
                         exp_avg_sq=torch.zeros_like(local, dtype=dtype))
        state["step"] += 1
        direction = adam_direction(state["exp_avg"], state["exp_avg_sq"], grad.to(state["exp_avg"].dtype),
                                   state["step"], group["adamw_betas"], group["adamw_eps"])
        local.mul_(1 - group["adamw_lr"] * group["weight_decay"])
        local.add_(direction.to(local.dtype), alpha=-group["adamw_lr"])


def _by_ns_group(items: list[Step]) -> list[list[Step]]:
    """Step items grouped by their matrices' NS group, in order."""
    out: dict[NSGroup, list[Step]] = {}
    for item in items:
        out.setdefault(item[0].ns, []).append(item)
    return list(out.values())
