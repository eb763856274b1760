"""Expert parallelism for the torch ``MoEDecoder``: experts split over an ``ep`` mesh dim, tokens moved by
all-to-all, composed with ragged FSDP (torchtitan's EP + FSDP arrangement).

On a 2-D ``(ep, fsdp)`` mesh, EP rank ``i`` keeps experts ``[i E/ep, (i+1) E/ep)`` of every MoE layer and
drops the others; those experts are one FSDP unit sharded over the ``fsdp`` dim (the ranks that hold
the same experts); everything else is sharded over all ranks by ``parallelize``. On a 3-D
``(replicate, ep, fsdp)`` mesh (HSDP) the experts unit is sharded over ``fsdp`` and replicated over
``replicate``, and ``parallelize`` takes the 2-D ``(replicate, ep * fsdp)`` mesh for the rest: tokens move
along ``ep`` inside one replica. Each MoE layer's experts module is wrapped by two hooks, as torchtitan's
``ExpertParallel`` does:

- before it runs (dispatch): the rank sorts its ``tokens x top_k`` assignments by expert, exchanges the
  per-expert counts with one fixed-size ``all_to_all_single`` over ``ep`` (always first, whatever the
  data), then sends each token to the rank holding its expert with an uneven ``all_to_all_single``;
  the experts module then runs on what it received, each row to its local expert, unweighted;
- after it runs (combine): the outputs go back by the reverse all-to-all, and each source rank adds them
  to its tokens, weighted by the router, with ``index_add``.

So the collectives and their order never depend on the data (only their split sizes do), and a rank
whose experts received nothing still runs the experts unit, with empty tensors (fused experts then still
get their zero gradient, as a whole fused tensor does in one process). Gradients: FSDP averages
an expert's gradient over its ``fsdp`` ranks (and replicas), but each of those already summed the tokens
of all ``ep`` ranks; a ``1/ep`` on the experts' gradients (and ``ep`` back on their inputs') makes it the
mean over every rank, as for the other parameters.

Names. In the module tree an EP rank's experts keep local indices (EP rank 1 of 2 with 8 experts calls
expert 4 ``experts.0``; a fused tensor holds rows ``[4, 8)``): an ``nn.ModuleList`` numbers its children
from 0 and a fused tensor has one name. Checkpoints use the one-process names: each expert parameter carries
a ``CheckpointAs`` (``experts.4.w1.weight``; a fused slice as the whole ``[E, ...]`` tensor, ``Shard(0)``
over ``ep`` around its ragged shard over ``fsdp``, and ``Replicate`` over the replicas under HSDP), so a DCP
checkpoint moves between (ep, fsdp) layouts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from ragged.models import ExpertParallelUnit, ExpertSource, moe_shapes, plan_expert_parallel
from torch_backend.fsdp import GranularityArg, MixedPrecisionPolicy, fully_shard
from torch_backend.fsdp._dcp_checkpoint import CheckpointAs
from torch_backend.models.llama import OneProcessPlace
from torch_backend.models.moe import ExpertList, FusedExperts, MoEDecoder


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits; its backward sends gradients back the reverse way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, recv_splits: list[int], send_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (recv_splits, send_splits), group
        out = x.new_empty((sum(recv_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        recv_splits, send_splits = ctx.splits
        out = grad.new_empty((sum(send_splits), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), send_splits, recv_splits, group=ctx.group)
        return out, None, None, None


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the gradient by ``scale`` in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


@dataclass(frozen=True)
class _Routed:
    """What the dispatch hands to the combine of the same forward."""

    token: torch.Tensor  # (N k,) the source token of each sent row, rows sorted by expert
    weight: torch.Tensor  # (N k,) its router weight
    recv_splits: list[int]  # rows received from each EP rank
    send_splits: list[int]  # rows sent to each EP rank
    received: torch.Tensor  # (M, dim) the experts' input
    n_tokens: int


class _ExpertParallelHooks:
    """The dispatch (forward pre-hook) and combine (forward hook) of one experts module."""

    def __init__(self, n_experts: int, ep_group, ep: int) -> None:
        self.n_experts, self.group, self.ep = n_experts, ep_group, ep
        self.n_local = n_experts // ep
        self.routed: _Routed | None = None

    def dispatch(self, _module: nn.Module, args: tuple) -> tuple:
        x, weights, chosen = args  # (N, dim), (N, k), (N, k)
        k = chosen.shape[1]
        order = torch.argsort(chosen.flatten(), stable=True)  # rows grouped by expert, hence by EP rank
        counts = torch.bincount(chosen.flatten(), minlength=self.n_experts)  # (E,) rows per expert
        received = torch.empty_like(counts)  # (ep * n_local,): [source rank, local expert]
        dist.all_to_all_single(received, counts, group=self.group)  # fixed size: always, first
        send = counts.view(self.ep, self.n_local).sum(1).tolist()
        recv = received.view(self.ep, self.n_local).sum(1).tolist()
        token = order // k
        x_recv = _AllToAll.apply(x[token], recv, send, self.group)  # (M, dim)
        local = torch.arange(self.n_local, device=x.device).repeat(self.ep)
        expert = torch.repeat_interleave(local, received)  # (M,) the local expert of each received row
        x_recv = _ScaleGrad.apply(x_recv, float(self.ep))
        self.routed = _Routed(token, weights.flatten()[order], recv, send, x_recv, len(x))
        ones = torch.ones(len(expert), 1, dtype=weights.dtype, device=x.device)
        return x_recv, ones, expert[:, None]

    def combine(self, module: nn.Module, _args: tuple, out: torch.Tensor) -> torch.Tensor:
        r, self.routed = self.routed, None
        if not out.requires_grad:  # no expert ran here: keep the (empty) input in the graph, so this
            # rank's backward reaches the experts unit as every other rank's does; fused tensors get a
            # zero gradient, as a whole tensor does in one process when any of its experts ran
            out = module.expert(0, r.received) if isinstance(module, FusedExperts) else r.received * 0
        out = _ScaleGrad.apply(out, 1.0 / self.ep)
        back = _AllToAll.apply(out, r.send_splits, r.recv_splits, self.group)  # (N k, dim) in sorted order
        combined = back.new_zeros((r.n_tokens, back.shape[1]))
        return combined.index_add(0, r.token, back * r.weight[:, None].to(back.dtype))


def _keep_local_experts(experts: nn.Module, lo: int, hi: int) -> None:
    """Drop every expert outside ``[lo, hi)`` from an ``ExpertList`` or ``FusedExperts`` (before sharding)."""
    if isinstance(experts, ExpertList):
        for e in reversed(range(experts.n_experts)):
            if not lo <= e < hi:
                del experts[e]
    elif isinstance(experts, FusedExperts):
        for name, p in list(experts.named_parameters(recurse=False)):
            setattr(experts, name, nn.Parameter(p.detach()[lo:hi].clone()))
    else:
        raise TypeError(f"expert parallelism: {type(experts).__name__} is not ExpertList or FusedExperts")
    experts.n_experts = hi - lo


def _rank_sources(unit: ExpertParallelUnit, ep_rank: int) -> dict[str, ExpertSource]:
    """EP rank ``ep_rank``'s local expert tensors (FQNs of the core's local plan) -> what each holds."""
    k = len(unit.local.tensors)
    return {t.name: s for t, s in zip(unit.local.tensors, unit.sources[ep_rank * k:(ep_rank + 1) * k])}


def _one_process_places(model: MoEDecoder, units: tuple[ExpertParallelUnit, ...], ep_rank: int
                        ) -> dict[str, OneProcessPlace]:
    """Where each parameter this EP rank keeps sits in the one-process model (whose order the core's
    ``moe_shapes`` gives): other parameters where they are, expert ``g`` or rows ``[lo, hi)`` of a fused
    tensor where the core's plan says this rank's experts come from."""
    whole = [t for u in moe_shapes("", model.config).units for t in u.tensors]
    index = {fqn: i for i, (fqn, _) in enumerate(whole)}
    places = {fqn: OneProcessPlace(i) for fqn, i in index.items() if ".experts." not in fqn}
    for unit in units:
        for fqn, s in _rank_sources(unit, ep_rank).items():
            i = index[s.fqn]
            places[fqn] = OneProcessPlace(i, s.lo, s.hi, None if s.lo is None else whole[i][1])
    return places


def _name_globally(experts: nn.Module, unit: ExpertParallelUnit, ep_rank: int, whole_mesh: DeviceMesh,
                   n_experts: int) -> None:
    """Give each (sharded) expert parameter the one-process name the core's composed plan gives it and, for
    a fused slice, the whole tensor's shape on ``whole_mesh`` (``ep`` first, then the experts unit's mesh
    dims) in checkpoints."""
    prefix = unit.name + "."
    holds = {fqn.removeprefix(prefix): s for fqn, s in _rank_sources(unit, ep_rank).items()}
    for name, p in experts.named_parameters():
        source = holds[name]  # "0.w1.weight" holds "...experts.4.w1.weight"; "gate_up_proj" rows [lo, hi)
        if source.lo is None:
            p.checkpoint_as = CheckpointAs(name, source.fqn.removeprefix(prefix))
        else:
            p.checkpoint_as = CheckpointAs(name, name, whole_mesh, Shard(0), (n_experts, *p.shape[1:]))


def expert_parallel(model: MoEDecoder, ep_mesh: DeviceMesh, *, reshard_after_forward: bool = True,
                    mp_policy: MixedPrecisionPolicy | None = None, granularity: GranularityArg = None
                    ) -> MoEDecoder:
    """Keep this EP rank's experts of every MoE layer, shard them over ``fsdp`` and hook their dispatch.

    Call before ``parallelize`` (which then shards the rest over all ranks; under HSDP on the 2-D
    ``(replicate, ep * fsdp)`` mesh of the same ranks).

    Example:
        >>> ep_mesh = init_device_mesh("cuda", (2, 4), mesh_dim_names=("ep", "fsdp"))
        >>> expert_parallel(model, ep_mesh)
        >>> parallelize(model, init_device_mesh("cuda", (8,)))
        >>> # HSDP, 2 replicas of (ep, fsdp) = (2, 2):
        >>> dims = ("replicate", "ep", "fsdp")
        >>> expert_parallel(model, init_device_mesh("cuda", (2, 2, 2), mesh_dim_names=dims))
        >>> parallelize(model, init_device_mesh("cuda", (2, 4)))

    Args:
        model: an ``MoEDecoder`` with every expert, built and initialised (the same values on every rank).
        ep_mesh: a mesh over every rank with dims ``("ep", "fsdp")``, or ``("replicate", "ep", "fsdp")`` for
            HSDP (the experts unit replicated over ``replicate``).
        reshard_after_forward, mp_policy, granularity: passed to the experts' ``fully_shard``.

    Raises:
        ValueError: the mesh dims are not those, or ``ep`` does not divide the number of experts.
    """
    if ep_mesh.mesh_dim_names not in (("ep", "fsdp"), ("replicate", "ep", "fsdp")):
        raise ValueError(f"expert_parallel: ep_mesh must have dims ('ep', 'fsdp') or ('replicate', 'ep', "
                         f"'fsdp') (HSDP), got {ep_mesh.mesh_dim_names} of shape {tuple(ep_mesh.shape)}")
    c, ep = model.config, ep_mesh.size(ep_mesh.mesh_dim_names.index("ep"))
    if c.n_experts % ep:
        raise ValueError(f"expert_parallel: ep={ep} must divide the {c.n_experts} experts of each MoE layer")
    n_local = c.n_experts // ep
    lo = ep_mesh.get_local_rank("ep") * n_local
    experts_mesh, whole_mesh = ep_mesh["fsdp"], ep_mesh
    if ep_mesh.ndim == 3:  # HSDP: a fused tensor whole is Shard(0) over ep around (Replicate, RaggedShard)
        experts_mesh = ep_mesh["replicate", "fsdp"]
        if c.experts == "fused":
            whole_mesh = DeviceMesh(ep_mesh.device_type, ep_mesh.mesh.permute(1, 0, 2).contiguous(),
                                    mesh_dim_names=("ep", "replicate", "fsdp"))
    moe_layers = model.layers[c.n_dense_layers:]
    # The core's plan of every EP rank's experts (the JAX backend shards by it): here, the global names
    units = plan_expert_parallel(c, ep, ep_mesh.size(ep_mesh.mesh_dim_names.index("fsdp")))
    model.one_process_places = _one_process_places(model, units, ep_mesh.get_local_rank("ep"))
    for layer in moe_layers:  # every new (sliced) parameter exists before fully_shard frees any original:
        _keep_local_experts(layer.feed_forward.experts, lo, lo + n_local)  # it tells units apart by id()
    for layer, unit in zip(moe_layers, units, strict=True):
        experts = layer.feed_forward.experts
        hooks = _ExpertParallelHooks(c.n_experts, ep_mesh.get_group("ep"), ep)
        experts.register_forward_pre_hook(hooks.dispatch)  # after FSDP's (it prepends its own)
        fully_shard(experts, mesh=experts_mesh, reshard_after_forward=reshard_after_forward,
                    mp_policy=mp_policy, granularity=granularity)
        experts.register_forward_hook(hooks.combine, prepend=True)  # before FSDP's post-forward
        _name_globally(experts, unit, ep_mesh.get_local_rank("ep"), whole_mesh, c.n_experts)
    return model
