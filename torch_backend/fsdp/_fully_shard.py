"""``fully_shard``: FSDP2's API over structure-aware layouts and zero-copy DBuffers.

Imports flow one way: api, debug, collectives, dbuffer, unit, schedule, root, hooks, embedding_renorm,
fully_shard.
"""

from __future__ import annotations

import contextlib
import functools
import math
import weakref
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.tensor import DTensor, Shard

import ragged
from ragged import Granularity, GranularityRule, Layout, TensorSpec
from torch_backend._collectives import all_reduce
from torch_backend._torch_internals import offset_free, source_mesh
from torch_backend.fsdp._api import as_mp_policy, offloads_to_cpu
from torch_backend.fsdp._dbuffer import norm_dtype
from torch_backend.fsdp._embedding_renorm import EmbeddingRenorm
from torch_backend.fsdp._hooks import FSDPState, states_under
from torch_backend.fsdp._module import FSDPModule
from torch_backend.fsdp._tensor_parallel import check_one_tp_mesh, shard_dims_split, tensor_parallel
from torch_backend.fsdp._unit import ParamRef, Unit

GranularityArg = GranularityRule | Granularity | int | str | None


def _managed(modules: Sequence[nn.Module], ignored: frozenset[int] = frozenset()
             ) -> list[tuple[str, nn.Module, str, nn.Parameter]]:
    """``(name, owner, attr, param)`` for the parameters a new unit over ``modules`` would manage.

    The order is ``named_parameters()``'s; parameters of submodules already sharded are left to their
    own unit. A parameter registered several times (tied weights) is taken once, named by its first
    use; ``_uses`` finds the others. Names are relative to each module, with the module's index
    in front when several are given. Parameters whose ``id`` is in ``ignored`` are left alone.
    """
    return [(name, owner, attr, p) for name, owner, attr, p in _uses(modules, ignored) if name is not None]


def _uses(modules: Sequence[nn.Module], ignored: frozenset[int] = frozenset()
          ) -> list[tuple[str | None, nn.Module, str, nn.Parameter]]:
    """Every ``(name, module, attr, param)`` registration under ``modules`` outside sharded submodules
    and ``ignored``; the name is None for a parameter already seen."""
    out: list[tuple[str | None, nn.Module, str, nn.Parameter]] = []
    seen: set[int] = set()
    visited: set[int] = set()

    def visit(m: nn.Module, prefix: str) -> None:
        if id(m) in visited:  # a module registered twice: its parameters are already listed
            return
        visited.add(id(m))
        for attr, p in m.named_parameters(recurse=False, remove_duplicate=False):
            if id(p) in ignored:
                continue
            out.append((None if id(p) in seen else prefix + attr, m, attr, p))
            seen.add(id(p))
        for child_name, child in m.named_children():
            if not isinstance(child, FSDPModule):
                visit(child, f"{prefix}{child_name}.")

    for i, m in enumerate(modules):
        visit(m, f"{i}." if len(modules) > 1 else "")
    return out


def _resolve_granularity(granularity: GranularityArg, name: str, shape: tuple[int, ...]) -> Granularity:
    if callable(granularity):
        return Granularity.parse(granularity(name, shape))
    return ragged.granularity_for(shape, "rows:1" if granularity is None else granularity)


def _packed_shape(param: torch.Tensor) -> tuple[int, ...]:
    """The shape the unit's buffer holds: a TP parameter's TP-local part (FSDP shards each TP rank's part,
    as FSDP2 does), a plain parameter itself. Only ``Shard`` dims split it: a parameter already sharded
    by ``fully_shard`` (its ``RaggedShard`` dim) plans as the tensor it stands for."""
    if not isinstance(param, DTensor):
        return tuple(param.shape)
    return shard_dims_split(tuple(param.shape), tuple(param.device_mesh.shape), param.placements)


def _as_list(module_or_modules: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
    if isinstance(module_or_modules, nn.Module):
        return [module_or_modules]
    modules = list(module_or_modules)
    if not modules or not all(isinstance(m, nn.Module) for m in modules):
        raise TypeError(f"fully_shard: expected an nn.Module or a non-empty list of them, got {modules!r}")
    return modules


def _fqns(root: nn.Module) -> dict[int, str]:
    return {id(m): name for name, m in root.named_modules(remove_duplicate=False)}


def plan_module(module_or_modules: nn.Module | Sequence[nn.Module], world_size: int,
                granularity: GranularityArg = None, *, root: nn.Module | None = None,
                ignored_params: set[nn.Parameter] | None = None) -> Layout:
    """Plan the unit ``fully_shard(module_or_modules)`` would build, without any process group.

    Pure and deterministic: the tensors are the parameters the unit would manage, in
    ``named_parameters()`` order, planned by ``ragged.plan`` with the buffer's itemsize; the JAX backend
    plans the same specs, so both get the same Layout for the same model and granularity.

    Args:
        module_or_modules: one module or a list of modules planned as one unit.
        world_size: devices on the sharding mesh dim.
        granularity: None for FSDP2's expectation (whole rows of matrices, 1-D tensors element-wise),
            one granularity for every matrix (e.g. ``"rows:32"``), or a function ``(name, shape) ->``
            granularity (``ragged.GranularityRule``, as on JAX), called with the names that go into the
            Layout: relative to the module (FSDP2 has no root at wrap time) unless ``root`` is given.
            A parameter that tensor parallelism made a DTensor is planned (and given to ``granularity``)
            with this rank's TP-local shape: the unit packs each TP rank's local storage.
        root: when given, tensors are named by their FQN under ``root`` and the Layout by the FQN of
            the last module (``"output"`` for ``[model.norm, model.output]``); otherwise names are
            relative to the module (prefixed by the list index for a list).
        ignored_params: parameters left out of the unit (``fully_shard``'s argument of the same name).

    Returns:
        The unit's Layout.

    Raises:
        TypeError: not a module or a list of modules. ValueError: a module not inside ``root``.
        ragged.GranularityError / PlanningError: a granularity that does not divide its parameter.
    """
    modules = _as_list(module_or_modules)
    params = _managed(modules, _ids(ignored_params))
    names = [name for name, *_ in params]
    unit_name = ""
    if root is not None:
        fqns = _fqns(root)
        missing = [type(m).__name__ for m in modules if id(m) not in fqns]
        if missing:
            raise ValueError(f"plan_module: module(s) {missing} are not inside root {type(root).__name__}")
        names = [_join(fqns[id(owner)], attr) for _, owner, attr, _ in params]
        unit_name = fqns[id(modules[-1])]
    shapes = [_packed_shape(p) for *_, p in params]
    specs = [TensorSpec(n, shape, _resolve_granularity(granularity, n, shape))
             for n, shape in zip(names, shapes)]
    itemsize = params[0][3].element_size() if params else 4
    return ragged.plan(specs, world_size, itemsize=itemsize, name=unit_name)


def _join(prefix: str, attr: str) -> str:
    return f"{prefix}.{attr}" if prefix else attr


def _default_mesh() -> DeviceMesh:
    if not dist.is_initialized():
        raise RuntimeError("fully_shard: no mesh given and torch.distributed is not initialised; call "
                           "dist.init_process_group first or pass mesh=")
    return init_device_mesh(mesh_device_type(dist.get_backend()), (dist.get_world_size(),))


def mesh_device_type(backend: str) -> str:
    """The device type of the default mesh over a process group of ``backend`` (``dist.get_backend()``).

    The machine's accelerator (cuda, xpu) when the backend serves it: "nccl", a per-device string
    ("cpu:gloo,cuda:nccl") that names it, or "undefined" (``init_process_group()`` without a backend,
    which gives each device its default backend); else the CPU ("gloo").
    """
    accelerator = torch.accelerator.current_accelerator(check_available=True)  # None: no device here
    if accelerator is None:
        return "cpu"
    if backend == "undefined":
        return accelerator.type
    if ":" in backend:
        served = {entry.split(":")[0] for entry in backend.split(",")}
    else:
        served = {device for device, b in dist.Backend.default_device_backend_map.items() if b == backend}
    return accelerator.type if accelerator.type in served else "cpu"


def _check_mesh_covers(mesh: DeviceMesh) -> None:
    """Every rank of the process group sits in the mesh (or in the mesh a sub-mesh was cut from).

    A rank outside it would never join the unit's collectives and leave the others blocked; ranks
    inside cannot see that without communicating, so a source mesh smaller than the process group is
    rejected on every rank.
    """
    if not dist.is_initialized():
        return
    source = source_mesh(mesh)
    world = dist.get_world_size()
    if source.size() != world or mesh.get_coordinate() is None:
        ranks = source.mesh.flatten().tolist()
        raise ValueError(f"fully_shard: the mesh covers ranks {ranks} but the process group has {world} "
                         f"ranks; every rank must hold a place in the mesh (build it over all "
                         f"{world} ranks, e.g. init_device_mesh(device_type, ({world},)), or cut sub-meshes "
                         "from such a mesh)")


def _check(modules: list[nn.Module], params: list, mesh: DeviceMesh) -> list:
    """Reject bad input before any collective, with the same message on every rank.

    Returns:
        Each parameter's TP split (``_tensor_parallel.TensorParallel``) or None.
    """
    if mesh.ndim not in (1, 2):
        raise ValueError(f"fully_shard: mesh must be 1-D (shard) or 2-D (replicate, shard), got "
                         f"{mesh.ndim}-D mesh {tuple(mesh.shape)}")
    _check_mesh_covers(mesh)
    for m in modules:
        if isinstance(m, TorchFSDPModule):  # ours or FSDP2's
            raise ValueError(f"fully_shard: {type(m).__name__} is already sharded; call fully_shard once per "
                             "module")
    tps = [tensor_parallel(name, p, mesh) for name, _, _, p in params]
    check_one_tp_mesh(type(modules[-1]).__name__, tps)
    for name, _, _, p in params:
        if not p.dtype.is_floating_point:
            raise ValueError(f"fully_shard: parameter {name!r} has dtype {p.dtype}; only floating "
                             "parameters can be sharded")
    dtypes = sorted({str(p.dtype) for *_, p in params})
    if len(dtypes) > 1:
        by_dtype = {d: [n for n, *_, p in params if str(p.dtype) == d][:3] for d in dtypes}
        raise ValueError(f"fully_shard: one unit holds one dtype, but its parameters have {by_dtype}; "
                         "cast the module or shard the parts separately")
    return tps


def fully_shard(module: nn.Module | list[nn.Module], *, mesh: DeviceMesh | None = None,
                reshard_after_forward: bool | int | None = None,
                shard_placement_fn: Callable[[nn.Parameter], object] | None = None,
                mp_policy: object = None, offload_policy: object = None,
                ignored_params: set[nn.Parameter] | None = None, dp_mesh_dims: object = None,
                granularity: GranularityArg = None) -> nn.Module | list[nn.Module]:
    """Shard ``module``'s parameters over ``mesh`` as one unit with a planned, zero-copy flat buffer.

    Mechanism: the unit's parameters are planned into one global buffer (``plan_module``) so that no
    shard boundary cuts a block of ``granularity``; each rank keeps one contiguous shard of it, and every
    sharded parameter is a ``RaggedShard`` DTensor viewing that shard. Before forward a pre-hook
    all-gathers the shard into the unsharded buffer (one collective) whose views are the parameters;
    after forward they are freed when ``reshard_after_forward``. In backward, gradients accumulate into
    an unsharded gradient buffer; one reduce-scatter writes the local gradient shard, which the sharded
    parameters' ``.grad`` view (HSDP: then one all-reduce across replicas). The next unit is prefetched.
    Call it bottom-up (each layer, then the root), as with FSDP2. The keywords are FSDP2's (torch 2.11
    to 2.13), plus ``granularity``.

    Args:
        module: a module, or a list of modules sharded as one unit (e.g. ``[model.norm, model.output]``).
        mesh: a 1-D mesh or a 2-D ``(replicate, shard)`` mesh for HSDP; default: every rank of the default
            process group on its device type. Parameters that tensor parallelism made DTensors
            (``Shard(d)`` or ``Replicate`` on a 1-D TP mesh cut from the same mesh, torchtitan's recipe:
            ``fully_shard(block, mesh=mesh["dp"])`` after ``parallelize_module(model, mesh["tp"], ...)``)
            are sharded by their TP-local tensors; the sharded parameter is a DTensor on the joined
            ``(dp, tp)`` mesh (``_tensor_parallel.py``).
        reshard_after_forward: free the unsharded parameters after forward (all-gather again in
            backward); None (default): True for every unit but the root. An int ``N`` is FSDP2's group
            size to reshard to: each rank keeps 1/N of the unsharded unit after forward and backward
            gathers it over N consecutive ranks (1 means False, the shard dim's size True).
        shard_placement_fn: FSDP2's per-parameter placement: ``None`` or ``Shard(0)`` (whole rows; the
            planner's default granularity, or ``granularity``) are accepted; ``Shard(d)`` for ``d > 0``
            and per-parameter meshes raise (see docs/fully_shard.md).
        mp_policy: ``MixedPrecisionPolicy``, ours or ``torch.distributed.fsdp``'s; default: none.
        offload_policy: torch's ``OffloadPolicy()`` (default) or ``CPUOffloadPolicy(pin_memory=...)``.
        ignored_params: parameters left out of the unit: not sharded, not moved, never reduced.
        dp_mesh_dims: FSDP2's SPMD mesh (torch 2.13); not supported (raises when given).
        granularity: see ``plan_module`` (default: whole rows of matrices, 1-D element-wise).

    Returns:
        ``module``, its class extended with ``FSDPModule`` (each module of a list).

    Raises:
        ValueError / TypeError / NotImplementedError: bad module, mesh, option or parameters, raised on
        every rank before communicating.

    Example:
        >>> for layer in model.layers:
        ...     fully_shard(layer, mesh=mesh)
        >>> fully_shard([model.norm, model.output], mesh=mesh)
        >>> fully_shard(model, mesh=mesh)
    """
    modules = _as_list(module)
    if dp_mesh_dims is not None:
        raise NotImplementedError("fully_shard: dp_mesh_dims (FSDP2's SPMD mesh) is not supported: pass the "
                                  "data-parallel mesh (1-D, or 2-D (replicate, shard) for HSDP), cut from "
                                  "the same mesh as a TP mesh if the parameters are TP DTensors")
    mesh = mesh or _default_mesh()
    ignored = _ids(ignored_params)
    params = _managed(modules, ignored)
    tps = _check(modules, params, mesh)
    reshard_after_forward = _resolve_reshard_after_forward(reshard_after_forward, mesh)
    _check_placements(shard_placement_fn, params)
    mp_policy = as_mp_policy(mp_policy)
    offload, pin_memory = offloads_to_cpu(offload_policy)
    unit = None
    if params:
        layout = plan_module(modules, mesh.size(mesh.ndim - 1), granularity, ignored_params=ignored_params)
        shared: dict[int, list[tuple[nn.Module, str]]] = {}
        for name, owner, attr, p in _uses(modules, ignored):
            if name is None:
                shared.setdefault(id(p), []).append((owner, attr))
        refs = [ParamRef(n, owner, attr, tuple(shared.get(id(p), ()))) for n, owner, attr, p in params]
        unit = Unit(layout.name, layout, refs, [p for *_, p in params], mesh, mp_policy,
                    offload=offload, pin_memory=pin_memory, tensor_parallel=tps)
        if not isinstance(reshard_after_forward, bool | None):
            group, index = _post_forward_group(mesh, reshard_after_forward)
            unit.set_post_forward_group(group, index, reshard_after_forward)
    FSDPState(tuple(modules), unit, reshard_after_forward, mp_policy)  # hooks and attaches to them
    if unit is not None:
        owners = {id(owner): owner for _, owner, _, _ in _uses(modules, ignored)}.values()
        for m in owners:
            if isinstance(m, nn.Embedding) and m.max_norm is not None:
                EmbeddingRenorm(m, unit)
        for owner in owners:  # as FSDP2 does (a post-hook per owner), for a load into any submodule
            owner.register_load_state_dict_post_hook(functools.partial(_adopt_loaded, unit))
    for sub in (s for m in modules for s in m.modules()):  # FSDP2's flags for dynamo: parameters are graph
        sub._is_fsdp_managed_module = sub._fsdp_use_orig_params = True  # inputs (swapped at each (un)shard)
    for m in modules:
        m.register_state_dict_post_hook(_offset_free_values)
        m.__class__ = _sharded_class(m.__class__)
    for top in modules:
        _name_units(top)
    return module


def _adopt_loaded(unit: Unit, module: nn.Module, incompatible_keys: object) -> None:
    """After ``load_state_dict``: ``assign=True`` put new DTensor parameters on the modules (accelerate's
    ``cpu_ram_efficient_loading`` loads so); the unit copies their values into its flat shard and keeps
    them as views of it (``Unit.adopt_sharded``), or its all-gathers would read the old values. A load
    that copied in place left the unit's own parameters registered: nothing to do then."""
    if all(getattr(ref.module, ref.attr) is p for ref, p in zip(unit.refs, unit.sharded)):
        return
    unit.adopt_sharded()


def _offset_free_values(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """State-dict values of sharded parameters as DTensors whose wrapper has storage offset 0.

    Their locals are views into the unit's flat shard; DCP's async staging (``dcp.async_save``) reads a
    DTensor wrapper's storage when its offset is not 0 (see ``offset_free``). Same memory, no copy.
    """
    for key, value in state_dict.items():
        if key.startswith(prefix) and isinstance(value, DTensor) and value.storage_offset() != 0:
            state_dict[key] = offset_free(value)


# One sharded class per original class, as FSDP2 keeps (its ``cls_to_fsdp_cls``): identical blocks share
# a type, so torch.compile reuses one graph for all of them instead of recompiling per block.
_SHARDED_CLASSES: dict[type, type] = {}


def _sharded_class(cls: type) -> type:
    if cls not in _SHARDED_CLASSES:
        _SHARDED_CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {"__module__": cls.__module__})
    return _SHARDED_CLASSES[cls]


def _ids(params: set[nn.Parameter] | None) -> frozenset[int]:
    return frozenset(id(p) for p in params or ())


def _resolve_reshard_after_forward(value: bool | int | None, mesh: DeviceMesh) -> bool | int | None:
    """FSDP2's rules: a bool or None as is; an int is a group size to reshard to after forward."""
    if value is None or isinstance(value, bool):
        return value
    shard_size = mesh.size(mesh.ndim - 1)
    if not isinstance(value, int) or value < 1 or shard_size % value:
        raise ValueError(f"fully_shard: reshard_after_forward should be a bool or an int that divides the "
                         f"shard dim's size {shard_size}, not {value!r}")
    if value in (1, shard_size):
        return value == shard_size  # FSDP2: 1 keeps the whole unit (False), the full size reshards (True)
    if dist.is_initialized() and mesh.mesh.numel() != dist.get_world_size():
        raise NotImplementedError(
            f"fully_shard: reshard_after_forward={value} needs a mesh over every rank of the process group "
            "(its groups are built by every rank alike); this mesh was cut from a larger one")
    return value


# Post-forward groups by mesh and size: each DeviceMesh makes new communicators (on NCCL, new NCCL
# communicators and their memory), so the units of one mesh share them. Every rank shards the same units
# in the same order, so every rank builds a mesh's groups at the same call.
_POST_FORWARD_GROUPS: weakref.WeakKeyDictionary[DeviceMesh, dict[int, tuple[dist.ProcessGroup, int]]] = (
    weakref.WeakKeyDictionary())


def _post_forward_group(mesh: DeviceMesh, size: int) -> tuple[dist.ProcessGroup, int]:
    """FSDP2's post-forward mesh: the shard dim's ranks in consecutive groups of ``size``; this rank's
    group and its index there (built once per mesh and size)."""
    by_size = _POST_FORWARD_GROUPS.setdefault(mesh, {})
    if size not in by_size:
        groups = DeviceMesh(mesh.device_type, mesh.mesh.reshape(-1, size))
        by_size[size] = groups.get_group(1), groups.get_local_rank(1)
    return by_size[size]


def _check_placements(shard_placement_fn: Callable[[nn.Parameter], object] | None, params: list) -> None:
    """FSDP2's ``shard_placement_fn`` where the ragged layout can honor it, a clear error otherwise.

    ``Shard(0)`` cuts a parameter between rows, which is what the planner's default granularity does
    (shards are ragged rather than padded, the same arithmetic); ``Shard(d)`` for a later dim gives each
    rank a strided slice (every row's d-th block), which is not a contiguous run of the flat buffer.
    """
    if shard_placement_fn is None:
        return
    for name, _, _, p in params:
        placement = shard_placement_fn(p)
        if placement is None:
            continue
        if not isinstance(placement, Shard):
            raise NotImplementedError(
                f"fully_shard: shard_placement_fn returned {placement!r} for parameter {name!r}; only None "
                "or Shard(0) are supported (a per-parameter mesh would split the unit's one flat buffer over "
                "several meshes; shard such parameters in their own fully_shard call on that mesh)")
        if placement.dim not in (0, -p.ndim) and math.prod(p.shape[:placement.dim % p.ndim]) != 1:
            raise NotImplementedError(
                f"fully_shard: shard_placement_fn returned {placement} for parameter {name!r} of shape "
                f"{tuple(p.shape)}: each rank's piece of a parameter is a contiguous run of its flattened "
                f"elements (whole rows by default), and Shard({placement.dim}) would give each rank a "
                "strided slice of every row; return Shard(0) or None, or use granularity= for finer blocks")


def _name_units(top: nn.Module) -> None:
    """Rename every unit under ``top`` by FQNs under ``top`` (offsets untouched; outer calls win)."""
    fqns = _fqns(top)
    for state in states_under([top]):
        unit = state.unit
        if unit is None or any(id(m) not in fqns for m in state.modules):
            continue
        names = {ref.name: _join(fqns[id(ref.module)], ref.attr) for ref in unit.refs}
        unit.rename(fqns[id(state.modules[-1])], names)


def units(module: nn.Module) -> list[Unit]:
    """The units of every sharded module under ``module`` (itself included), in module order."""
    return [s.unit for s in states_under([module]) if s.unit is not None]


@contextlib.contextmanager
def unsharded(module: nn.Module) -> Iterator[None]:
    """Unshard every unit under ``module``; what the block writes into the parameters is kept.

    Used for meta-device initialisation: ``with unsharded(model): model.init_weights(seed)`` runs the
    model's own initialisation on full tensors (the same on every rank, so the same values as a
    single-process run with the same seed) and each rank keeps its slice when the block exits.
    """
    states = states_under([module])
    for s in states:
        if s.unit is not None:
            s.unit.unshard()
    try:
        yield
    finally:
        for s in states:
            if s.unit is not None:
                s.unit.reshard()


@torch.no_grad()
def clip_grad_norm_(module: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip the gradients of every unit under ``module`` by their total norm, over the gradient buffers.

    One norm kernel per unit (over its gradient shard; padding is zero), one all-reduce for the whole
    model over the sharding group, one in-place scale per unit. Same result as
    ``torch.nn.utils.clip_grad_norm_`` on the unsharded gradients. With tensor parallelism, the
    parameters TP shards are normed one by one and their sum is first all-reduced over the TP group
    (each TP rank holds a different part of them; TP-replicated ones are counted once).

    Returns:
        The total norm (a scalar tensor, the same on every rank).

    Raises:
        ValueError: a non-positive or infinite ``norm_type``, or units on different TP meshes.
    """
    if not (0 < norm_type < math.inf):
        raise ValueError(f"clip_grad_norm_: norm_type={norm_type} must be a positive finite number")
    live = [u for u in units(module) if any(p.grad is not None for p in u.sharded)]
    if not live:
        return torch.zeros(())
    # On the collectives' device (offloaded gradients live on the host, NCCL reduces device tensors).
    device = live[0].device
    tp_groups = {id(u.tp_group): u.tp_group for u in live if u.tp_group is not None}
    if len(tp_groups) > 1:
        raise ValueError(f"clip_grad_norm_: the units under {type(module).__name__} use {len(tp_groups)} "
                         "different TP meshes; their norms cannot be summed over one TP group")
    dtype = functools.reduce(torch.promote_types, (norm_dtype(u.main_grad.dtype) for u in live))
    zero = torch.zeros((), dtype=dtype, device=device)
    replicated, tp_sharded = [zero], [zero]  # p-th powers of local norms
    for u in live:
        if u.tp_group is None:
            replicated.append(u.main_grad.norm(norm_type).to(device) ** norm_type)
            continue
        for ref, tp in zip(u.refs, u.tensor_parallel):
            norm = torch.linalg.vector_norm(u.main_grad.shard_view(ref.name), norm_type, dtype=dtype)
            (tp_sharded if tp is not None and tp.sharded else replicated).append(norm.to(device) ** norm_type)
    total = torch.stack(replicated).sum()
    if tp_groups:
        across_tp = torch.stack(tp_sharded).sum()
        all_reduce(across_tp, next(iter(tp_groups.values())), label="clip_grad_norm_ (TP)").wait()
        total = total + across_tp
    all_reduce(total, live[0].shard_group, label="clip_grad_norm_").wait()
    total = total ** (1.0 / norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for u in live:
        u.main_grad.scale_(coef.to(u.main_grad.shard.device))
    return total
