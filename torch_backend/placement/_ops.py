"""Sharding rules for ops on RaggedShard DTensors.

A RaggedShard local tensor is a flat slice of the (box's) row-major storage, so an op keeps the
placement exactly when running it on the flat locals is the same as running it on the whole tensor
and slicing: elementwise ops (``torch.Tag.pointwise``, copies and fills, ``_foreach_*``, the fused
optimizer kernels) whose tensor operands all share the placement and shape (0-d scalars
are fine; a partial one, ``x / x.norm()``, is reduced first). Reductions to a scalar become a Partial.
Reductions over dims run on the local's sub-tensor view ``(n, *shape[k:])``: dims after the ragged
prefix stay RaggedShard, dims inside it leave a Partial; a device holding nothing contributes the
reduction's identity. Everything else raises ``UnsupportedRaggedOp`` naming the op and the placement.

The rules are written over ``Operand(shape, placements)``; ``_dtensor_patches`` turns torch's specs
into operands and the rules' placements back into torch's output specs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

import ragged
from torch_backend._torch_internals import mutates_self, pytree
from torch_backend.placement._placement import RaggedShard, ragged_mesh_dim

aten = torch.ops.aten


class UnsupportedRaggedOp(NotImplementedError, ragged.RaggedError):
    """An op that has no sharding rule for a RaggedShard operand."""


@dataclass(frozen=True)
class Operand:
    """A DTensor operand as the rules see it: its global shape and placements."""

    shape: tuple[int, ...]
    placements: tuple[Placement, ...]


@dataclass(frozen=True)
class PartialNorm:
    """A partial p-norm (turned into torch's norm partial / Partial('max'|'min'|'sum'))."""

    ord: float


@dataclass
class Rule:
    """Output placements (one entry per op output, ``None`` for non-tensors) and arguments to reshard.

    ``reshard`` maps an index into the flattened positional arguments to the placements that operand
    must be redistributed to before the local op runs.
    """

    outputs: list[Any]
    reshard: dict[int, tuple[Placement, ...]] = field(default_factory=dict)


# Elementwise ops without torch's pointwise tag.
_LIKE_OPS = {
    aten._to_copy.default,
    aten.copy_.default,
    aten.fill_.Scalar,
    aten.fill_.Tensor,
    aten.zero_.default,
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.empty_like.default,
    aten.full_like.default,
    aten.detach.default,
    aten.alias.default,
    aten.clone.default,
}
_FUSED_OPTIMIZERS = {
    "aten::_fused_adam_",
    "aten::_fused_adamw_",
    "aten::_fused_sgd_",
    "aten::_fused_adagrad_",
}

#: Reductions whose ragged local computation is not the op on the flat local (handled by ``reduce``):
#: reductions over dims, and reductions whose empty local needs the right identity (max of nothing).
REDUCTIONS_WITH_DIM = (
    aten.mean.default,
    aten.mean.dim,
    aten.sum.dim_IntList,
    aten.linalg_vector_norm.default,
    aten.amax.default,
    aten.amin.default,
    aten.max.default,
    aten.min.default,
    aten.any.default,
    aten.all.default,
)
#: Foreach reductions: one partial scalar per tensor (handled by ``foreach_reduce``).
FOREACH_REDUCTIONS = (aten._foreach_norm.Scalar, aten._foreach_max.default)
#: Random fills whose values do not depend on ``self``: run on the full tensor, keep the local slice,
#: so the values and the generator's consumption equal the single-process op (``random_fill``).
RANDOM_FILLS = (
    aten.normal_.default,
    aten.uniform_.default,
    aten.bernoulli_.float,
    aten.exponential_.default,
    aten.log_normal_.default,
    aten.cauchy_.default,
    aten.geometric_.default,
    aten.random_.default,
    getattr(aten.random_, "from"),  # a Python keyword
    aten.random_.to,
    aten.rand_like.default,
    aten.randn_like.default,
    aten.randint_like.default,
    aten.randint_like.low_dtype,
)

# The partial each full reduction leaves and the value an empty local contributes to it.
_REDUCE_KINDS = {
    aten.sum.dim_IntList: "sum",
    aten.mean.default: "mean",
    aten.mean.dim: "mean",
    aten.linalg_vector_norm.default: "norm",
    aten.amax.default: "max",
    aten.max.default: "max",
    aten.amin.default: "min",
    aten.min.default: "min",
    aten.any.default: "any",
    aten.all.default: "all",
}


def _is_ragged(x: Any) -> bool:
    return isinstance(x, Operand) and any(isinstance(p, RaggedShard) for p in x.placements)


def _is_scalar(x: Operand) -> bool:
    return x.shape == () and all(isinstance(p, Replicate) for p in x.placements)


def _error(op, operand: Operand, why: str) -> UnsupportedRaggedOp:
    return UnsupportedRaggedOp(
        f"{op}: no RaggedShard sharding rule for an operand of shape {operand.shape} with placements "
        f"{operand.placements}: {why}. Redistribute it (e.g. dt.redistribute(mesh, [Replicate()]) or "
        "dt.full_tensor()) before calling this op. If it is a parameter sharded by fully_shard, read in a "
        "module method other than forward, register that method with "
        "register_fsdp_forward_method(module, name): it then runs on the unsharded parameters."
    )


def _ragged_dim_beside_replicate(op, operand: Operand, what: str) -> int:
    """The ragged mesh dim of ``operand``, whose other mesh dims must be Replicate for ``what``."""
    m = ragged_mesh_dim(operand.placements)
    if any(not isinstance(p, Replicate) for i, p in enumerate(operand.placements) if i != m):
        raise _error(op, operand, f"{what} supports Replicate beside the RaggedShard only")
    return m


def rule(op, args: Any, kwargs: dict[str, Any], out_shapes: Any) -> Rule:
    """The sharding rule of ``op`` for operands of which at least one holds a RaggedShard.

    Args:
        op: the aten OpOverload.
        args: positional arguments with DTensor operands replaced by ``Operand``.
        kwargs: keyword arguments, likewise.
        out_shapes: the output shape, a list of shapes (``None`` for non-tensors), or ``None``.

    Returns:
        The output placements and the operands to redistribute first.

    Raises:
        UnsupportedRaggedOp: if ``op`` has no rule for these operands.
    """
    name = op.name()
    operands = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, Operand)]
    ragged_operand = next(x for x in operands if _is_ragged(x))
    if op is aten.sum.default:
        return Rule([_reduced(op, ragged_operand, "sum")])
    if op in FOREACH_REDUCTIONS:  # their values come from ``foreach_reduce``; this gives the placements
        order = float(args[1]) if len(args) > 1 else 2.0
        kind = Partial("max") if op is aten._foreach_max.default else PartialNorm(order)
        return Rule([_reduced(op, t, kind) for t in args[0]])
    if name.startswith("aten::_foreach_") or name in _FUSED_OPTIMIZERS:
        return _foreach(op, args, kwargs, out_shapes)
    if torch.Tag.pointwise in op.tags or op in _LIKE_OPS:
        return _elementwise(op, args, kwargs, ragged_operand, out_shapes)
    raise _error(
        op,
        ragged_operand,
        "only elementwise ops, foreach/fused optimizer ops and sum/mean/"
        "vector_norm reductions keep a RaggedShard",
    )


def _reduced(op, x: Operand, kind: Any) -> tuple[Placement, ...]:
    """Placements of a full reduction of ``x``: sharded mesh dims become partial."""
    out = []
    for p in x.placements:
        if isinstance(p, (RaggedShard, Shard)):
            out.append(Partial("sum") if kind == "sum" else kind)
        elif isinstance(p, Replicate):
            out.append(p)
        elif kind == "sum" and isinstance(p, Partial) and p.reduce_op == "sum":
            out.append(p)
        else:
            raise _error(op, x, f"cannot reduce a {p} placement")
    return tuple(out)


def _elementwise(op, args, kwargs, ref: Operand, out_shapes) -> Rule:
    leaves = pytree.tree_leaves(args)
    if mutates_self(op) and isinstance(leaves[0], Operand) and leaves[0] != ref:
        # Resharding self would mutate a copy and relabel the original: refuse instead.
        raise _error(
            op, leaves[0], f"an in-place op's self must already have the placements {ref.placements}"
        )
    reshard = {}
    for i, x in enumerate(leaves):
        if not isinstance(x, Operand) or x == ref or _is_scalar(x):
            continue
        if x.shape == () and not _is_ragged(x):
            reshard[i] = (Replicate(),) * len(x.placements)  # a partial scalar (x / x.norm()): reduce it
            continue
        if (
            x.shape == ref.shape
            and not _is_ragged(x)
            and not any(isinstance(p, Partial) for p in x.placements)
        ):
            reshard[i] = ref.placements  # e.g. a Replicate operand is sliced locally to the ragged layout
            continue
        raise _error(
            op,
            x,
            f"elementwise operands must share the RaggedShard operand's shape {ref.shape} "
            f"and placements {ref.placements} (or be 0-d scalars)",
        )
    for x in pytree.tree_leaves(kwargs):
        if isinstance(x, Operand) and x != ref and not _is_scalar(x):
            raise _error(op, x, "keyword tensor operands must match the RaggedShard operand")
    if any(isinstance(p, Partial) for p in ref.placements):
        raise _error(op, ref, "a Partial placement beside the RaggedShard is not elementwise-safe")
    shapes = out_shapes if isinstance(out_shapes, list) else [out_shapes]
    for s in shapes:
        if s is not None and tuple(s) != ref.shape:
            raise _error(
                op, ref, f"the output shape {tuple(s)} differs from the operand shape (broadcasting)"
            )
    return Rule([None if s is None else ref.placements for s in shapes], reshard)


def _foreach(op, args, kwargs, out_shapes) -> Rule:
    lists = [a for a in args if isinstance(a, (list, tuple)) and a and isinstance(a[0], Operand)]
    n = len(lists[0])
    outputs = []
    for i in range(n):
        group = [lst[i] for lst in lists if len(lst) == n and isinstance(lst[i], Operand)]
        group += [x for x in args if isinstance(x, Operand)] + [
            x for x in pytree.tree_leaves(kwargs) if isinstance(x, Operand)
        ]
        ref = next((x for x in group if _is_ragged(x)), group[0])
        for x in group:
            if x != ref and not _is_scalar(x):
                raise _error(
                    op,
                    x,
                    f"foreach element {i} must share the placements {ref.placements} and "
                    f"shape {ref.shape} of the other lists' element {i}",
                )
            if any(isinstance(p, Partial) for p in x.placements):
                raise _error(op, x, "foreach ops over Partial placements are not elementwise-safe")
        outputs.append(ref.placements)
    if out_shapes is None:
        return Rule([])
    return Rule(outputs)


def reduce(
    op,
    local: torch.Tensor,
    shape: tuple[int, ...],
    placements: tuple[Placement, ...],
    rank: int,
    args: tuple,
    kwargs: dict,
) -> tuple[torch.Tensor, tuple[Any, ...], tuple[int, ...]]:
    """Run a reduction of ``REDUCTIONS_WITH_DIM`` on a RaggedShard local tensor.

    Mechanism: with ``dims = (0..k-1)`` the local is ``nb`` whole sub-tensors, viewed as
    ``(nb, *shape[k:])``. Reducing only dims ``>= k`` runs on that view and keeps the RaggedShard
    (same dims and local_units, on the output shape). Reducing every dim gives a scalar partial; a device
    that holds nothing contributes the reduction's identity (0 for sums, -inf for max, +inf for min
    and for norms of negative order, whose partials combine as ``sum(n_i ** p)``). Reducing some dim
    ``< k`` places the local sub-tensors in a tensor of the full shape filled with that identity and
    reduces it: each device then holds a full-shaped partial result.

    Args:
        op: one of ``REDUCTIONS_WITH_DIM``.
        local: the flat local tensor.
        shape: the global shape.
        placements: the DTensor's placements (only Replicate besides the RaggedShard).
        rank: this device's index on the RaggedShard's mesh dim.
        args: the op's positional arguments after ``self``.
        kwargs: its keyword arguments.

    Returns:
        (local result, output placements (``PartialNorm`` for norms), output global shape).

    Raises:
        UnsupportedRaggedOp: for Shard/Partial beside the RaggedShard.
    """
    operand = Operand(shape, placements)
    m = _ragged_dim_beside_replicate(op, operand, "reductions over dims")
    kind, order, dims, keepdim, dtype = _parse_reduction(op, args, kwargs, len(shape))
    core = placements[m].core
    k = len(core.dims)
    out_shape = tuple(1 if d in dims else n for d, n in enumerate(shape) if keepdim or d not in dims)

    def run(x: torch.Tensor, over: list[int]) -> torch.Tensor:
        if kind == "norm":
            return torch.linalg.vector_norm(x, order, over, keepdim, dtype=dtype)
        if kind in ("max", "min"):
            return (torch.amax if kind == "max" else torch.amin)(x, over, keepdim)
        if kind in ("any", "all"):
            return (torch.any if kind == "any" else torch.all)(x, tuple(over), keepdim)
        return (torch.mean if kind == "mean" else torch.sum)(x, over, keepdim, dtype=dtype)

    def with_placement(p: Any) -> tuple[Any, ...]:
        return tuple(p if i == m else q for i, q in enumerate(placements))

    partial = {"norm": PartialNorm(order), "max": Partial("max"), "any": Partial("max")}.get(kind)
    partial = partial or {"min": Partial("min"), "all": Partial("min")}.get(kind, Partial("sum"))
    fill = _identity(kind, order, local.dtype)
    if len(dims) == len(shape):
        if not local.numel():
            out_dtype = torch.bool if kind in ("any", "all") else dtype or local.dtype
            total = torch.full((), fill, dtype=out_dtype, device=local.device)
        elif kind == "mean":
            total = local.sum(dtype=dtype) / math.prod(shape)
        else:
            total = run(local, [0]).reshape(())
        return total.reshape(out_shape), with_placement(partial), out_shape
    if not dims & set(range(k)):
        view = local.view(-1, *shape[k:])
        out = run(view, [d - k + 1 for d in sorted(dims)])
        return out.reshape(-1), with_placement(RaggedShard(core.dims, core.local_units)), out_shape
    start, stop = core.ranges(shape)[rank]
    full = local.new_full((math.prod(shape),), fill)
    full[start:stop] = local
    full = full.view(shape)
    if kind == "mean":
        out = torch.sum(full, sorted(dims), keepdim, dtype=dtype) / math.prod(shape[d] for d in dims)
    else:
        out = run(full, sorted(dims))
    return out.reshape(out_shape), with_placement(partial), out_shape


def _identity(kind: str, order: float, dtype: torch.dtype) -> float | bool:
    """What a device holding nothing contributes to the cross-device reduction of ``kind``."""
    if kind == "norm":
        return math.inf if order < 0 else 0.0  # inf ** p == 0 for p < 0; +inf is min's identity
    if kind in ("max", "min"):
        if dtype == torch.bool:
            return kind == "min"
        if dtype.is_floating_point:
            return -math.inf if kind == "max" else math.inf
        info = torch.iinfo(dtype)
        return info.min if kind == "max" else info.max
    return kind == "all"


def foreach_reduce(op, local: torch.Tensor, operand: Operand, args: tuple, kwargs: dict):
    """One tensor's part of ``_foreach_norm`` / ``_foreach_max``: (local partial scalar, placements).

    A device that holds nothing of a tensor contributes the identity instead of failing alone
    (``_foreach_max`` and the inf-norm of an empty tensor raise) while the others wait in a collective.
    """
    if op is aten._foreach_max.default:
        kind, order, placement = "max", math.inf, Partial("max")
    else:
        given = args[1] if len(args) > 1 else kwargs.get("ord", 2)
        kind, order = "norm", float(2 if given is None else given)
        placement = PartialNorm(order)
    dtype = kwargs.get("dtype")
    placements = _reduced(op, operand, placement)
    if not local.numel():
        identity = _identity(kind, order, local.dtype)
        return torch.full((), identity, dtype=dtype or local.dtype, device=local.device), placements
    if kind == "max":
        return local.max(), placements
    return torch.linalg.vector_norm(local, order, dtype=dtype), placements


def _parse_reduction(op, args, kwargs, ndim):
    """(kind, norm order, reduced dims, keepdim, dtype) of a call of a REDUCTIONS_WITH_DIM op."""
    dtype = kwargs.get("dtype")
    kind, order = _REDUCE_KINDS[op], 2.0
    if op in (aten.mean.default, aten.max.default, aten.min.default, aten.any.default, aten.all.default):
        return kind, order, set(range(ndim)), False, dtype
    names = ("ord", "dim", "keepdim") if kind == "norm" else ("dim", "keepdim")
    given = dict(zip(names, args)) | {k: v for k, v in kwargs.items() if k in names}
    order = float(given.get("ord", 2))
    dim, keepdim = given.get("dim"), bool(given.get("keepdim", False))
    if dim is None or (isinstance(dim, (list, tuple)) and not dim):
        dims = set(range(ndim))
    else:
        dims = {d % ndim for d in ([dim] if isinstance(dim, int) else dim)}
    return kind, order, dims, keepdim, dtype


def select_first(
    op, shape: tuple[int, ...], placements: tuple[Placement, ...], rank: int, index: int
) -> tuple[int, int, tuple[Placement, ...]]:
    """``x[index]`` (``select`` on dim 0) as a view of the flat local: (start, stop, output placements).

    The selected sub-tensor is one contiguous flat interval, so each device's part of it is a slice of its
    local tensor; the output is element-granular RaggedShard over those parts (one-hot for a 0-d
    result). This keeps HuggingFace's ``init.zeros_(weight[padding_idx])`` a local write.

    Raises:
        UnsupportedRaggedOp: beside a Shard or Partial mesh dim.
        IndexError: (on every rank) for an index out of range.
    """
    operand = Operand(shape, placements)
    m = _ragged_dim_beside_replicate(op, operand, "select")
    if not -shape[0] <= index < shape[0]:
        raise IndexError(f"index {index} is out of bounds for dimension 0 with size {shape[0]}")
    row = math.prod(shape[1:])  # elements of x[index]
    lo = (index % shape[0]) * row
    ranges = placements[m].core.ranges(shape)
    parts = [max(0, min(b, lo + row) - max(a, lo)) for a, b in ranges]
    out_dims = tuple(range(len(shape) - 1))
    a, b = ranges[rank]
    start, stop = min(max(lo - a, 0), b - a), min(max(lo + row - a, 0), b - a)
    if row == 0:
        return start, stop, tuple(Replicate() if i == m else p for i, p in enumerate(placements))
    out = RaggedShard(out_dims, parts) if out_dims else RaggedShard((), [int(n > 0) for n in parts])
    return start, stop, tuple(out if i == m else p for i, p in enumerate(placements))
