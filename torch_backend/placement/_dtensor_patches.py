"""The patches of torch's private DTensor machinery that make RaggedShard a working placement.

torch accepts a custom ``Placement`` only in ``DTensor.from_local`` / ``to_local``. Everything else a
RaggedShard DTensor needs goes through the patches below. Each wraps one torch function, hands
RaggedShard cases to this package (``_redistribute`` executes the core's plans, ``_ops`` holds the
sharding rules) and calls the original function unchanged for every other DTensor.

Version guard: torch 2.11 to 2.13. Every private torch object patched here comes from
``torch_backend._torch_internals``, whose import checks the torch version and that each of them exists
(a plain function where its code is rebound), so a torch that moved one fails before anything is patched.

When: ``install()`` runs on the first use of the placement (``RaggedShard.__init__`` calls it: no
RaggedShard DTensor can exist before a RaggedShard does), once per process (idempotent, thread-safe).
Importing ``torch_backend`` patches nothing, so a process that never builds a RaggedShard keeps
torch's DTensor as it is.

Patches (the torch function each wraps):
  1. ``torch.distributed.tensor._redistribute.redistribute_local_tensor``: used by
     ``DTensor.redistribute``/``full_tensor``, their autograd backward, and the op dispatcher's
     argument resharding.
  2. ``torch.distributed.tensor._api.distribute_tensor``.
  3. ``torch.distributed.tensor._api.compute_global_tensor_info``: global shape for ``from_local``
     without ``shape`` (a RaggedShard infers the flat 1-D global shape).
  4. ``torch.distributed.tensor._api._dtensor_init_helper``: ``torch.distributed.tensor.zeros/ones/
     full/empty/rand/randn`` allocate the flat local slice (rand/randn: the seeded full tensor's slice).
  5. ``DTensor.from_local``: one all_gather of the local sizes (unless ``run_check=False``), so a local
     of the wrong size raises on every rank instead of one rank raising and the others hanging.
  6. ``torch.distributed.tensor._api._ToTorchTensor.backward``: ``to_local``'s backward rebuilds the
     gradient with the forward spec (torch would recompute a stride from the flat local).
  7. ``ShardingPropagator.propagate_op_sharding_non_cached`` (class, and the LRU cache of the live
     instance): sharding rules for ops on RaggedShard operands, clear errors for the rest (also for
     ops whose output depends on the data, which torch's fake-tensor propagation cannot shape).
  8. ``OpDispatcher._custom_op_handlers`` for ops whose local computation is not the op on the flat
     local: reductions (``_ops.REDUCTIONS_WITH_DIM``, ``_ops.FOREACH_REDUCTIONS``), random fills
     (``_ops.RANDOM_FILLS``), ``copy_`` from a plain full tensor, ``select.int`` on dim 0 and
     ``_local_scalar_dense`` (``.item()``).
  9. ``DTensor.__create_write_items__`` / ``__create_chunk_list__`` / ``__get_tensor_shard__``:
     torch.distributed.checkpoint metadata (see ``_dcp``).
 10. ``torch.distributed._state_dict_utils._distribute_tensors``: ``set_model_state_dict(...,
     broadcast_from_rank0=True)`` copies each RaggedShard local's flat range of the full tensor.

Patches 1, 2 and 4 rebind the code of torch's function object (``_rebind``) rather than a module
attribute, so callers that imported the function before ``torch_backend`` (``from
torch.distributed.tensor import distribute_tensor``, torch's own modules) reach the patch too.
"""

from __future__ import annotations

import math
import threading
import types

import torch
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate

from torch_backend._torch_internals import (
    REBINDABLE,
    DataDependentOutputException,
    DTensorSpec,
    DynamicOutputShapeException,
    LocalLRUCache,
    NormPartial,
    OpSchema,
    OutputSharding,
    ShardingPropagator,
    TensorMeta,
    current_mesh,
    dt_api,
    is_view_op,
    mutates_self,
    pytree,
    return_and_correct_aliasing,
    state_dict_utils,
)
from torch_backend.placement import _dcp, _ops
from torch_backend.placement import _redistribute as rd
from torch_backend.placement._dtensor import box_offset, boxes, has_ragged, local_piece, make_dtensor
from torch_backend.placement._placement import ragged_mesh_dim

aten = torch.ops.aten
# torch's original of everything patched, by name: the patches call it for every non-ragged case.
_ORIGINAL: dict[str, object] = {}
_INSTALLED = threading.Event()
_INSTALLING = threading.Lock()


def install() -> None:
    """Install the patches once per process; later calls (from any thread) return at once.

    Installing twice would make the patches their own originals (an endless recursion), so the first
    caller patches under a lock and the others wait for it.
    """
    if _INSTALLED.is_set():
        return
    with _INSTALLING:
        if not _INSTALLED.is_set():
            _patch()
            _INSTALLED.set()


def _patch() -> None:
    for owner, name in REBINDABLE:
        _ORIGINAL[name] = _rebind(getattr(owner, name), _REBOUND[name])

    # A C++ builtin on torch 2.13, read only by _api's own functions: the module attribute is the patch.
    _ORIGINAL["compute_global_tensor_info"] = dt_api.compute_global_tensor_info
    dt_api.compute_global_tensor_info = _compute_global_tensor_info

    _ORIGINAL["from_local"] = DTensor.from_local
    DTensor.from_local = staticmethod(_from_local)

    _ORIGINAL["to_local_backward"] = dt_api._ToTorchTensor.backward
    dt_api._ToTorchTensor.backward = staticmethod(_to_local_backward)

    _ORIGINAL["propagate"] = ShardingPropagator.propagate_op_sharding_non_cached
    ShardingPropagator.propagate_op_sharding_non_cached = _propagate_op_sharding_non_cached
    propagator = DTensor._op_dispatcher.sharding_propagator
    # The live instance caches a bound method of the original; rebuild its cache on the patched one.
    propagator.propagate_op_sharding = LocalLRUCache(propagator.propagate_op_sharding_non_cached)

    handlers = DTensor._op_dispatcher._custom_op_handlers
    for ops, handler in (
        (_ops.REDUCTIONS_WITH_DIM, _reduction_handler),
        (_ops.FOREACH_REDUCTIONS, _foreach_reduction_handler),
        (_ops.RANDOM_FILLS, _random_fill_handler),
        ((aten.copy_.default,), _copy_handler),
        ((aten._local_scalar_dense.default,), _item_handler),
        ((aten.select.int,), _select_handler),
        ((aten.new_empty.default,), _new_empty_handler),
    ):
        for op in ops:
            _ORIGINAL[f"handler:{op}"] = handlers.get(op)
            handlers[op] = handler

    _patch_state_dict_utils()

    for attr, patch in (
        ("__create_write_items__", _create_write_items),
        ("__create_chunk_list__", _create_chunk_list),
        ("__get_tensor_shard__", _get_tensor_shard),
    ):
        _ORIGINAL[attr] = getattr(DTensor, attr)
        setattr(DTensor, attr, patch)


def _trampoline(*args, _ragged_patch, **kwargs):
    # The code every rebound torch function runs: ``_ragged_patch`` comes from its __kwdefaults__.
    return _ragged_patch(*args, **kwargs)


def _rebind(fn: types.FunctionType, patch) -> types.FunctionType:
    """Make the function object ``fn`` itself run ``patch``; return an unpatched copy of ``fn``.

    Swapping the code of torch's function object (not the module attribute that names it) reaches
    every caller, including modules that did ``from torch.distributed.tensor import distribute_tensor``
    before ``torch_backend`` was imported.
    """
    original = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    original.__kwdefaults__ = fn.__kwdefaults__
    original.__dict__.update(fn.__dict__)
    original.__qualname__, original.__doc__ = fn.__qualname__, fn.__doc__
    fn.__code__ = _trampoline.__code__
    fn.__defaults__ = None
    fn.__kwdefaults__ = {"_ragged_patch": patch}
    fn.__wrapped__ = original  # inspect.signature still shows torch's signature
    return original


def _native_redistribute(spec: DTensorSpec):
    def native(x: torch.Tensor, src: tuple[Placement, ...], dst: tuple[Placement, ...]) -> torch.Tensor:
        return _ORIGINAL["redistribute_local_tensor"](
            x,
            DTensorSpec(spec.mesh, src, tensor_meta=spec.tensor_meta),
            DTensorSpec(spec.mesh, dst, tensor_meta=spec.tensor_meta),
        )

    return native


# ---------------------------------------------------------------------------------------------------
# 1. torch.distributed.tensor._redistribute.redistribute_local_tensor
# ---------------------------------------------------------------------------------------------------


def _redistribute_local_tensor(local_tensor, current_spec, target_spec, *args, **kwargs):
    if not (has_ragged(current_spec.placements) or has_ragged(target_spec.placements)):
        return _ORIGINAL["redistribute_local_tensor"](
            local_tensor, current_spec, target_spec, *args, **kwargs
        )
    if current_spec.mesh != target_spec.mesh:
        raise NotImplementedError("RaggedShard: redistribute across different device meshes")
    mesh, shape = current_spec.mesh, tuple(current_spec.shape)
    return rd.redistribute(
        local_tensor,
        mesh,
        shape,
        current_spec.placements,
        target_spec.placements,
        native=_native_redistribute(current_spec),
        boxes=lambda placements: boxes(shape, mesh, placements),
    )


# ---------------------------------------------------------------------------------------------------
# 2. torch.distributed.tensor._api.distribute_tensor
# ---------------------------------------------------------------------------------------------------


def _distribute_tensor(tensor, device_mesh=None, placements=None, **kwargs):
    if placements is None or not has_ragged(placements):
        return _ORIGINAL["distribute_tensor"](tensor, device_mesh, placements, **kwargs)
    mesh = device_mesh or current_mesh()
    placements = tuple(placements)
    shape = tuple(tensor.shape)
    own, every = boxes(shape, mesh, placements)
    rd.validate(placements, mesh, shape, every)
    m = ragged_mesh_dim(placements)
    # torch distributes the standard placements (a broadcast from src_data_rank keeps ranks consistent);
    # the RaggedShard is then a local slice of the box.
    standard = tuple(Replicate() if i == m else p for i, p in enumerate(placements))
    boxed = _ORIGINAL["distribute_tensor"](tensor.detach(), mesh, standard, **kwargs)
    a, b = placements[m].core.ranges(own)[mesh.get_local_rank(m)]
    local = boxed._local_tensor.reshape(-1)[a:b].clone()
    return make_dtensor(
        local.requires_grad_(tensor.requires_grad), mesh, placements, shape, tensor.requires_grad
    )


# ---------------------------------------------------------------------------------------------------
# 3. torch.distributed.tensor._api.compute_global_tensor_info (from_local without shape)
# ---------------------------------------------------------------------------------------------------


def _compute_global_tensor_info(tensor, mesh, placements):
    if not has_ragged(placements):
        return _ORIGINAL["compute_global_tensor_info"](tensor, mesh, placements)
    numel = rd.infer_global_numel(tensor, mesh, tuple(placements))
    return [numel], [1]


# ---------------------------------------------------------------------------------------------------
# 4. torch.distributed.tensor._api._dtensor_init_helper (torch.distributed.tensor.zeros/ones/full/
#    empty/rand/randn)
# ---------------------------------------------------------------------------------------------------


def _dtensor_init_helper(init_op, size, device_mesh=None, placements=None, **kwargs):
    if placements is None or not has_ragged(placements):
        return _ORIGINAL["_dtensor_init_helper"](init_op, size, device_mesh, placements, **kwargs)
    mesh = device_mesh or current_mesh()
    placements, shape = tuple(placements), tuple(size)
    own, every = boxes(shape, mesh, placements)
    rd.validate(placements, mesh, shape, every)
    if kwargs.pop("layout", torch.strided) != torch.strided:
        raise NotImplementedError("RaggedShard: only the strided layout")
    requires_grad = kwargs.pop("requires_grad", False)
    kwargs["device"] = mesh.device_type
    if init_op in (torch.rand, torch.randn):
        # The full tensor from the default generator, then this device's slice: the values and the
        # generator's state equal the single-process call with the same seed, at every world size.
        local = local_piece(init_op(shape, **kwargs), mesh, placements).clone()
    else:
        m = ragged_mesh_dim(placements)
        numel = placements[m].core.local_numel(own, mesh.get_local_rank(m))
        fill = (kwargs.pop("fill_value", 0),) if init_op is torch.full else ()
        local = init_op((numel,), *fill, **kwargs)
    return make_dtensor(local.requires_grad_(requires_grad), mesh, placements, shape, requires_grad)


# ---------------------------------------------------------------------------------------------------
# 5. DTensor.from_local: a RaggedShard local of the wrong size raises on every rank
# ---------------------------------------------------------------------------------------------------

_UNSET = object()


def _from_local(local_tensor, device_mesh=None, placements=None, *, run_check=_UNSET, shape=None,
                stride=None, **kwargs):
    # Unless run_check=False is passed explicitly (the runtime's hot paths), a RaggedShard local is
    # checked against the layout with one all_gather of the local sizes that every rank enters.
    if placements is not None and has_ragged(placements) and shape is not None and run_check is not False:
        mesh = device_mesh or current_mesh()
        placements = tuple(placements)
        own, every = boxes(tuple(shape), mesh, placements)
        rd.validate(placements, mesh, tuple(shape), every)
        rd.check_local_numel(local_tensor, mesh, placements, tuple(shape), own)
    return _ORIGINAL["from_local"](
        local_tensor, device_mesh, placements, run_check=run_check is True, shape=shape, stride=stride,
        **kwargs,
    )


# ---------------------------------------------------------------------------------------------------
# 6. torch.distributed.tensor._api._ToTorchTensor.backward (to_local's backward)
# ---------------------------------------------------------------------------------------------------


def _to_local_backward(ctx, grad_output):
    spec = ctx.dtensor_spec
    if grad_output is None or not has_ragged(spec.placements):
        return _ORIGINAL["to_local_backward"](ctx, grad_output)
    placements = ctx.grad_placements or spec.placements
    grad = DTensor.from_local(
        grad_output, spec.mesh, placements, run_check=False, shape=spec.shape, stride=spec.stride
    )
    return grad, None


# ---------------------------------------------------------------------------------------------------
# 7. ShardingPropagator.propagate_op_sharding_non_cached
# ---------------------------------------------------------------------------------------------------


def _propagate_op_sharding_non_cached(self, op_schema: OpSchema) -> OutputSharding:
    leaves = pytree.tree_leaves((op_schema.args_schema, op_schema.kwargs_schema))
    specs = [x for x in leaves if isinstance(x, DTensorSpec)]
    if not any(has_ragged(s.placements) for s in specs):
        return _ORIGINAL["propagate"](self, op_schema)
    op = op_schema.op
    try:
        out_meta = self._propagate_tensor_meta_non_cached(op_schema)
    except (DataDependentOutputException, DynamicOutputShapeException) as e:  # nonzero, x[mask], allclose
        ragged_spec = next(s for s in specs if has_ragged(s.placements))
        raise _ops.UnsupportedRaggedOp(
            f"{op}: its output shape or value depends on the data, which no rank holds whole under "
            f"{ragged_spec.placements} (shape {tuple(ragged_spec.shape)}). Call dt.full_tensor() first."
        ) from e

    def operand(x):
        return _ops.Operand(tuple(x.shape), tuple(x.placements)) if isinstance(x, DTensorSpec) else x

    rule = _ops.rule(
        op,
        pytree.tree_map(operand, op_schema.args_schema, is_leaf=lambda x: isinstance(x, DTensorSpec)),
        pytree.tree_map(operand, op_schema.kwargs_schema, is_leaf=lambda x: isinstance(x, DTensorSpec)),
        _out_shapes(out_meta),
    )
    mesh = specs[0].mesh

    def spec_for(placements, meta):
        return (
            None
            if placements is None or meta is None
            else DTensorSpec(
                mesh,
                tuple(_torch_placement(p) for p in placements),
                tensor_meta=meta,
            )
        )

    if out_meta is not None and not isinstance(out_meta, TensorMeta):
        output_spec = tuple(spec_for(p, meta) for p, meta in zip(rule.outputs, out_meta))
        if isinstance(out_meta, list):
            output_spec = list(output_spec)
    else:
        output_spec = spec_for(rule.outputs[0] if rule.outputs else None, out_meta)
    if not rule.reshard:
        return OutputSharding(output_spec)
    flat, tree = pytree.tree_flatten(op_schema.args_schema)
    new_flat = []
    for i, x in enumerate(flat):
        target = rule.reshard.get(i)
        new_flat.append(x if target is None else DTensorSpec(mesh, target, tensor_meta=x.tensor_meta))
    new_schema = OpSchema(op, pytree.tree_unflatten(new_flat, tree), op_schema.kwargs_schema)
    return OutputSharding(output_spec, redistribute_schema=new_schema, needs_redistribute=True)


def _out_shapes(out_meta):
    if out_meta is None:
        return None
    if not isinstance(out_meta, TensorMeta):
        return [None if m is None else tuple(m.shape) for m in out_meta]
    return tuple(out_meta.shape)


def _torch_placement(p):
    """Turn the rule's neutral partial markers into torch placements."""
    if isinstance(p, _ops.PartialNorm):
        if p.ord == math.inf:
            return Partial("max")
        if p.ord == -math.inf:
            return Partial("min")
        if p.ord == 0:
            return Partial("sum")
        return NormPartial(p.ord)
    return p


# ---------------------------------------------------------------------------------------------------
# 8. OpDispatcher._custom_op_handlers: reductions, foreach reductions, random fills, copy_
# ---------------------------------------------------------------------------------------------------


def _reduction_handler(op, args, kwargs):
    x = args[0]
    if not (isinstance(x, DTensor) and has_ragged(x.placements)):
        return _fallback(op, args, kwargs)
    rank = x.device_mesh.get_local_rank(ragged_mesh_dim(x.placements))
    local, placements, shape = _ops.reduce(
        op,
        x._local_tensor,
        tuple(x.shape),
        x.placements,
        rank,
        args[1:],
        kwargs,
    )
    return make_dtensor(local, x.device_mesh, tuple(_torch_placement(p) for p in placements), shape)


def _foreach_reduction_handler(op, args, kwargs):
    xs = args[0]
    if not any(isinstance(x, DTensor) and has_ragged(x.placements) for x in xs):
        return _fallback(op, args, kwargs)
    out = []
    for x in xs:
        operand = _ops.Operand(tuple(x.shape), tuple(x.placements))
        local, placements = _ops.foreach_reduce(op, x._local_tensor, operand, args, kwargs)
        out.append(make_dtensor(local, x.device_mesh, tuple(_torch_placement(p) for p in placements), ()))
    return out


def _random_fill_handler(op, args, kwargs):
    x = args[0]
    if not (isinstance(x, DTensor) and has_ragged(x.placements)):
        return _fallback(op, args, kwargs)
    if any(isinstance(p, Partial) for p in x.placements):
        raise _ops.UnsupportedRaggedOp(f"{op}: a random fill of a Partial DTensor {x.placements}")
    # Every rank draws the whole tensor from the same generator and keeps its slice: the values and
    # the generator's consumption equal the single-process op on the full tensor, with no collective.
    local = x._local_tensor
    full = op(torch.empty(x.shape, dtype=local.dtype, device=local.device), *args[1:], **kwargs)
    piece = local_piece(full, x.device_mesh, x.placements)
    if mutates_self(op):
        local.copy_(piece)
        return x
    return make_dtensor(piece.clone(), x.device_mesh, x.placements, tuple(x.shape))


def _copy_handler(op, args, kwargs):
    dst, src = args[0], args[1]
    if not (
        isinstance(dst, DTensor)
        and has_ragged(dst.placements)
        and not isinstance(src, DTensor)
        and isinstance(src, torch.Tensor)
        and src.dim() > 0
    ):
        return _fallback(op, args, kwargs)
    if any(isinstance(p, Partial) for p in dst.placements):
        raise _ops.UnsupportedRaggedOp(f"{op}: copy of a full tensor into a Partial DTensor {dst.placements}")
    # A plain tensor is read as the full value (every rank passes the same one, as in single-process
    # code): each rank copies its own slice, broadcasting as copy_ does.
    full = src.expand(dst.shape)
    dst._local_tensor.copy_(local_piece(full, dst.device_mesh, dst.placements), *args[2:], **kwargs)
    return dst


def _select_handler(op, args, kwargs):
    x = args[0]
    names = dict(zip(("dim", "index"), args[1:])) | kwargs
    if not (isinstance(x, DTensor) and has_ragged(x.placements) and names["dim"] % max(x.ndim, 1) == 0):
        return _fallback(op, args, kwargs)
    mesh, m = x.device_mesh, ragged_mesh_dim(x.placements)
    start, stop, placements = _ops.select_first(
        op, tuple(x.shape), tuple(x.placements), mesh.get_local_rank(m), names["index"]
    )
    return make_dtensor(x._local_tensor[start:stop], mesh, placements, tuple(x.shape[1:]))


def _new_empty_handler(op, args, kwargs):
    x, size = args[0], tuple(args[1])
    if not (isinstance(x, DTensor) and has_ragged(x.placements) and size == tuple(x.shape)):
        return _fallback(op, args, kwargs)  # another shape: the sharding rules refuse it, naming the op
    # An uninitialised tensor of the operand's shape keeps its placements (DCP's async staging copies
    # each DTensor as ``new_empty(x.size(), device="cpu")``); the local is the flat local's shape.
    local = x._local_tensor.new_empty(x._local_tensor.shape, **kwargs)
    return make_dtensor(local, x.device_mesh, x.placements, size)


def _item_handler(op, args, kwargs):
    x = args[0]
    reduced_or_ragged = isinstance(x, DTensor) and any(p.is_partial() for p in x.placements)
    if not (reduced_or_ragged or (isinstance(x, DTensor) and has_ragged(x.placements))):
        return _fallback(op, args, kwargs)
    # torch reads .item() of a Partial from the local value (so `if not mask.any()`, as in
    # nn.init.trunc_normal_, would branch differently per rank) and of a RaggedShard from a local
    # that may be empty: reduce or gather first (every rank holds the same spec, so all enter).
    return op(x.full_tensor())


def _fallback(op, args, kwargs):
    original = _ORIGINAL.get(f"handler:{op}")
    return original(op, args, kwargs) if original else _default_dispatch(op, args, kwargs)


def _default_dispatch(op, args, kwargs):
    """torch's dispatch for a non-ragged call of an op we registered a handler for.

    The C++ fast path sends every call of a handled op to its handler, so the handler re-runs the
    Python slow path that ``OpDispatcher`` keeps for exactly this (unwrap, propagate, local compute,
    wrap). As in torch's dispatch, an in-place op returns its mutated ``self`` and a view (``select``)
    gets its aliasing corrected.
    """
    dispatcher = DTensor._op_dispatcher
    op_info = dispatcher.unwrap_to_op_info(op, args, kwargs)
    dispatcher.sharding_propagator.propagate(op_info)
    local = dispatcher._dispatch_get_local_results_slow_path(op, args, op_info)
    if mutates_self(op):
        return args[0]
    out = dispatcher.wrap(local, op_info.output_sharding.output_spec)
    return return_and_correct_aliasing(op, args, kwargs, out) if is_view_op(op) else out


# ---------------------------------------------------------------------------------------------------
# 9. DTensor.__create_write_items__ / __create_chunk_list__ / __get_tensor_shard__ (checkpoint)
# ---------------------------------------------------------------------------------------------------


def _ragged_chunks(dt: DTensor) -> list[_dcp.Chunk]:
    placements = dt.placements
    m = ragged_mesh_dim(placements)
    if any(isinstance(p, Partial) for p in placements):
        raise ValueError(f"cannot checkpoint a DTensor with Partial placements {placements}")
    box, offset = box_offset(dt.shape, dt.device_mesh, placements, dt.device_mesh.get_coordinate())
    start, stop = placements[m].core.ranges(box)[dt.device_mesh.get_local_rank(m)]
    return _dcp.chunks(box, offset, start, stop)


def _create_write_items(self, fqn, object):
    if not has_ragged(self.placements):
        return _ORIGINAL["__create_write_items__"](self, fqn, object)
    return _dcp.write_items(fqn, self._local_tensor, self.shape, _ragged_chunks(self))


def _create_chunk_list(self):
    if not has_ragged(self.placements):
        return _ORIGINAL["__create_chunk_list__"](self)
    return _dcp.chunk_list(_ragged_chunks(self))


def _get_tensor_shard(self, index):
    if not has_ragged(self.placements):
        return _ORIGINAL["__get_tensor_shard__"](self, index)
    return _dcp.find(self._local_tensor, _ragged_chunks(self), index, index.fqn)


# The patch of each torch function whose function object is rebound (patches 1, 2 and 4).
_REBOUND = {
    "redistribute_local_tensor": _redistribute_local_tensor,
    "distribute_tensor": _distribute_tensor,
    "_dtensor_init_helper": _dtensor_init_helper,
}


# ---------------------------------------------------------------------------------------------------
# 10. torch.distributed._state_dict_utils._distribute_tensors (full state dicts broadcast from rank 0)
# ---------------------------------------------------------------------------------------------------


def _patch_state_dict_utils() -> None:
    """Wrap ``torch.distributed._state_dict_utils._distribute_tensors``.

    ``set_model_state_dict(..., broadcast_from_rank0=True)`` broadcasts each full tensor, then copies
    the box torch computes for the placements into the local tensor; a RaggedShard local is a flat
    range of that box, so it gets that range instead.
    """
    sd_utils = state_dict_utils()
    original = getattr(sd_utils, "_distribute_tensors", None)
    if original is None:
        return  # a torch without this internal: broadcast_from_rank0 is torch's own business there
    _ORIGINAL["_distribute_tensors"] = original

    def _distribute_tensors(local_state_dict, keys, device, pg=None):
        ragged = []
        for key in keys:
            entry = local_state_dict.get(key)
            if isinstance(entry, tuple) and isinstance(entry[0], DTensor) and has_ragged(entry[0].placements):
                ragged.append(key)
        for key in ragged:
            local_state, full = local_state_dict[key]
            local = local_state.to_local()
            if not local_state.is_meta:
                m = ragged_mesh_dim(local_state.placements)
                ranges = local_state.placements[m].core.ranges(tuple(full.shape))
                start, stop = ranges[local_state.device_mesh.get_local_rank(m)]
                local.copy_(full.reshape(-1)[start:stop])
            local_state_dict[key] = local_state
        original(local_state_dict, [k for k in keys if k not in ragged], device, pg)

    sd_utils._distribute_tensors = _distribute_tensors

