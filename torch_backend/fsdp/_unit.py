"""One FSDP unit: its DBuffers, its sharded and unsharded parameters, unshard/reshard and gradient reduce.

A unit holds the parameters of the module(s) given to one ``fully_shard`` call. Its master weights live
in one DBuffer (``master``); each sharded parameter is a RaggedShard DTensor whose local tensor is a view
into ``master.shard``. Unsharding all-gathers the local shard straight into the unsharded buffer, whose
views are the unsharded parameters; their ``.grad`` are views into an unsharded gradient buffer, so
autograd accumulates into it in place, one reduce-scatter writes the local gradient shard and each
sharded parameter's ``.grad`` is a DTensor view into that shard. Nothing is packed or unpacked.
"""

from __future__ import annotations

import enum
import itertools
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate

from ragged import Layout, TensorSlot
from torch_backend._collectives import Pending, all_gather, all_reduce, reduce_scatter, side_stream
from torch_backend._debug import record_copy
from torch_backend._torch_internals import (
    preserve_version_counter,
    set_local_tensor,
    set_parameter,
    version_of,
)
from torch_backend.fsdp._api import MixedPrecisionPolicy
from torch_backend.fsdp._dbuffer import DBuffer
from torch_backend.fsdp._tensor_parallel import TensorParallel, joined_mesh
from torch_backend.placement import RaggedShard, make_dtensor


class UnitState(enum.Enum):
    SHARDED = "sharded"  # only local shards exist; the modules hold the sharded DTensor parameters
    UNSHARDED = "unsharded"  # the unsharded buffer is filled; the modules hold the views into it
    # reshard_after_forward=N: this rank keeps its 1/N of the unsharded buffer, gathered back over a group
    # of N ranks in backward; the modules hold the sharded parameters
    GROUPED = "grouped"


@dataclass(frozen=True)
class ParamRef:
    """Where one parameter of the unit is registered: ``module.<attr>``, named ``name`` in the layout.

    ``shared`` lists the other ``(module, attr)`` that hold the same parameter (tied weights): every use
    is given the same sharded or unsharded parameter.
    """

    name: str
    module: nn.Module
    attr: str
    shared: tuple[tuple[nn.Module, str], ...] = ()


_UIDS = itertools.count()


def _uid(param: nn.Parameter) -> int:
    """A number that names ``param`` for as long as the process lives (tied weights: the same number).

    Not ``id()``: a parameter created after ``param`` is freed may get its id and look tied to it.
    """
    if not hasattr(param, "_ragged_fsdp_uid"):
        param._ragged_fsdp_uid = next(_UIDS)
    return param._ragged_fsdp_uid


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """The device this rank's buffers live on: the mesh's device type, current index for accelerators."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, torch.get_device_module(mesh.device_type).current_device())


class Unit:
    """One FSDP unit (FSDP2's param group) over a 1-D (shard) or 2-D (replicate, shard) mesh.

    Args:
        name: the unit's name (errors, debug counter).
        layout: the planned global buffer of the unit's parameters.
        refs: where each parameter is registered, in layout order.
        params: the original parameters, in layout order (meta tensors are allowed: no values copied).
        mesh: a 1-D mesh (FSDP) or a 2-D mesh ``(replicate, shard)`` (HSDP).
        mp_policy: mixed precision policy.
        offload: FSDP2's CPU offload: the sharded parameters and gradients (so the optimizer state and
            step) live on the host; the all-gather input is copied to the device, the reduced shard back.
        pin_memory: pin the host buffers (only where the mesh is an accelerator's: host memory is all a
            CPU mesh has).
        tensor_parallel: per parameter, its TP split (``_tensor_parallel``) or None for a plain one. The
            layout then holds TP-local shapes; the sharded parameter lives on the joined (dp, tp) mesh
            and the unsharded one is a DTensor on the TP mesh, a view into the unsharded buffer as ever.
    """

    name: str
    layout: Layout
    state: UnitState
    device: torch.device  # where the collectives and the compute buffers live (the mesh's device)
    master: DBuffer  # master dtype; shard = the sharded weights (on the host when offloading)
    compute: DBuffer  # compute dtype on ``device`` (``master`` itself without mixed precision or offload);
    #                   full = unsharded weights
    grads: DBuffer  # compute dtype; full = unsharded gradients (no shard)
    reduce: DBuffer  # reduce dtype (``grads`` itself when equal); full = reduce-scatter input (no shard)
    main_grad: DBuffer  # master dtype, beside ``master``; shard = the sharded gradients
    requires_grad_sync: bool  # reduce this backward's gradients (False: keep accumulating them unsharded)
    requires_all_reduce: bool  # HSDP: all-reduce over the replicas (False: keep the partial sum, no .grad)
    reshard_after_backward: bool  # False: stay unsharded after backward (the next forward gathers nothing)
    gradient_divide_factor: float | None  # the reduced sum is divided by it (None: the mesh size)
    all_reduce_hook: Callable[[torch.Tensor], None] | None  # called on the reduced shard (FSDP2's hook)
    all_reduce_hook_stream: torch.cuda.Stream | None  # where the hook runs (None: the current stream)
    reduce_group: dist.ProcessGroup  # the reduce-scatter's group: the shard group or a copy of it
    ag_stream: torch.cuda.Stream | None  # set by the root on CUDA
    rs_stream: torch.cuda.Stream | None

    def __init__(self, name: str, layout: Layout, refs: list[ParamRef], params: list[nn.Parameter],
                 mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy, *, offload: bool = False,
                 pin_memory: bool = False,
                 tensor_parallel: list[TensorParallel | None] | None = None) -> None:
        self.name = name
        self.layout = layout
        self.refs = refs
        self.mesh = mesh
        self.shard_group = mesh.get_group(mesh.ndim - 1)
        self.replicate_group = mesh.get_group(0) if mesh.ndim == 2 else None
        self.rank = mesh.get_local_rank(mesh.ndim - 1)
        self.world = mesh.size()  # gradients are averaged over every rank of the mesh
        self.mp_policy = mp_policy
        self.device = mesh_device(mesh)
        self.offload = offload
        self._pin = pin_memory and offload and self.device.type != "cpu"
        self.original_uids = tuple(_uid(p) for p in params)  # per ref: FSDP2 allows one unit per parameter
        self.requires_grad_sync = self.requires_all_reduce = self.reshard_after_backward = True
        self.gradient_divide_factor = self.all_reduce_hook = self.all_reduce_hook_stream = None
        self.reduce_group = self.shard_group
        self.post_forward_group: dist.ProcessGroup | None = None  # reshard_after_forward=N's group
        self._group_index = self._group_size = 0
        self._grouped: torch.Tensor | None = None  # 1-D [total / N]: this rank's part in GROUPED state
        self._partial: torch.Tensor | None = None  # HSDP sum of reduce-scatters not all-reduced yet
        self.ag_stream = self.rs_stream = None
        self.state = UnitState.SHARDED
        self.tensor_parallel = tensor_parallel or [None] * len(refs)
        tp_meshes = [tp.mesh for tp in self.tensor_parallel if tp is not None]
        self.tp_group = tp_meshes[0].get_group() if tp_meshes else None  # one TP mesh per unit (checked)
        self._sharded_specs = [self._sharded_spec(ref, tp) for ref, tp in zip(refs, self.tensor_parallel)]
        self._build_buffers(params[0].dtype, self.device)
        self.sharded: list[nn.Parameter] = []
        for i, (ref, orig, tp) in enumerate(zip(refs, params, self.tensor_parallel)):
            if not orig.is_meta:
                self._copy_into_shard(ref.name, (orig.to_local() if tp else orig).detach())
            local = self.master.shard_view(ref.name)
            self.sharded.append(nn.Parameter(self._sharded_form(i, local),
                                             requires_grad=orig.requires_grad))
        self._register(self.sharded)

        self._pending_all_gather: Pending | None = None
        self._pending_reduce: Pending | None = None
        self._pending_all_reduce: Pending | None = None  # HSDP's, issued once the reduce-scatter is done
        self._reduce_out: torch.Tensor | None = None
        self._accumulate_into_grads = False
        self._grads_ready = False  # unsharded .grad views are set for this backward
        self._unsynced_grads = False  # the unsharded gradient buffer holds grads of unsynced backwards
        self._waiting: set[int] = set()  # params whose gradient has not landed yet in this backward
        self._landed: set[int] = set()  # indices of the params that received a gradient since the reduce
        self._reduced: set[int] | None = None  # those of them in the last reduce; None: not reduced yet
        self._reduced_in_backward = False  # this backward issued the unit's reduce-scatter
        self._version = -1  # the unsharded buffer's version once filled (to detect user writes)
        self._gathered_from = -1  # the master shard's version the unsharded buffer was gathered from
        self._keep_version: preserve_version_counter | None = None
        self.post_backward_callback = None  # set by the hooks: called when all gradients landed

    def _sharded_spec(self, ref: ParamRef, tp: TensorParallel | None
                      ) -> tuple[DeviceMesh, tuple[Placement, ...], tuple[int, ...]]:
        """(mesh, placements, global shape) of a sharded parameter and its gradient.

        RaggedShard on the shard dim (Replicate before it for HSDP), then the TP placements on the joined
        mesh: the RaggedShard cuts the TP rank's box, whose flat storage is what the layout packed.
        """
        placements = ((Replicate(),) if self.mesh.ndim == 2 else ()) + (
            RaggedShard.from_core(self.layout.placement(ref.name)),)
        if tp is None:
            return self.mesh, placements, self.layout.slot(ref.name).shape
        return joined_mesh(self.mesh, tp.mesh), placements + tp.placements, tp.shape

    def _sharded_form(self, i: int, local: torch.Tensor) -> DTensor:
        """Parameter ``i``'s sharded form (parameter or gradient) over ``local``, a view into a shard."""
        mesh, placements, shape = self._sharded_specs[i]
        return make_dtensor(local, mesh, placements, shape)

    def _unsharded_form(self, i: int, view: torch.Tensor) -> torch.Tensor:
        """What forward sees of parameter ``i``: the view, or (TP) a DTensor on the TP mesh over the view."""
        tp = self.tensor_parallel[i]
        return view if tp is None else make_dtensor(view, tp.mesh, tp.placements, tp.shape)

    def _build_buffers(self, master_dtype: torch.dtype, device: torch.device) -> None:
        """(Re)create every DBuffer, the unsharded parameters and the sharded gradient views.

        ``device`` is where the compute buffers live; the master and its gradients live there too, or on
        the host when offloading.
        """
        layout, rank = self.layout, self.rank
        self.device = device
        host = torch.device("cpu") if self.offload else device
        compute_dtype = self.mp_policy.compute_dtype(master_dtype)
        reduce_dtype = self.mp_policy.reduction_dtype(master_dtype)
        self.master = DBuffer(layout, rank, master_dtype, host, pin_memory=self._pin)
        self.compute = self.master if compute_dtype == master_dtype and not self.offload else DBuffer(
            layout, rank, compute_dtype, device)
        self.grads = DBuffer(layout, rank, compute_dtype, device, with_shard=False)
        self.reduce = self.grads if reduce_dtype == compute_dtype else DBuffer(
            layout, rank, reduce_dtype, device, with_shard=False)
        self.main_grad = DBuffer(layout, rank, master_dtype, host, pin_memory=self._pin)
        self.unsharded: list[nn.Parameter] = []
        unit = weakref.ref(self)
        self._sharded_grads: list[DTensor] = []
        # Made once: autograd accumulates into these views of the unsharded gradient buffer.
        self._unsharded_grads = [self._unsharded_form(i, self.grads.full_view(ref.name))
                                 for i, ref in enumerate(self.refs)]
        for i, ref in enumerate(self.refs):
            self._sharded_grads.append(self._sharded_form(i, self.main_grad.shard_view(ref.name)))
            # Hooks on every parameter: ``requires_grad`` may be switched on after wrapping.
            unsharded = nn.Parameter(self._unsharded_form(i, self.compute.full_view(ref.name)))
            unsharded.register_hook(self._on_first_grad)
            # A weak reference: torch's garbage collector does not see this hook, so a strong one would
            # keep the unit, its mesh and its process group alive until exit (gloo threads included).
            unsharded.register_post_accumulate_grad_hook(lambda _, i=i: unit()._on_grad_accumulated(i))
            self.unsharded.append(unsharded)
        self.main_grad.free_shard()  # views are made; the storage comes back with the first reduce

    def _copy_into_shard(self, name: str, full: torch.Tensor) -> None:
        start, stop = self.master.local_range(name)
        src = full.reshape(-1)[start:stop]
        with torch.no_grad():
            record_copy(self.master.shard_view(name), src)
            self.master.shard_view(name).copy_(src)

    @torch.no_grad()
    def adopt_sharded(self) -> None:
        """Make the registered sharded parameters views into ``master.shard`` again.

        ``nn.Module._apply`` (``to_empty``, ``to``, ``float()``...) swaps each DTensor parameter's
        contents for new local tensors; their values are copied into the unit's shard (a new one when
        the device or dtype changed) and each local becomes a view of it again, so the parameter objects
        (and an optimizer's references) stay the same.
        """
        self.reshard()
        params = [getattr(ref.module, ref.attr) for ref in self.refs]
        locals_ = [p.to_local() for p in params]  # under no_grad: the local tensor itself
        if any(t.is_meta for t in locals_):
            return  # ``to("meta")``: nothing to keep; the buffers stay as they are
        first = locals_[0]
        # Offloaded, the master stays on the host whatever ``to(device)`` did (FSDP2 moves it back too).
        device = self.device if self.offload else first.device
        if (first.dtype, device) != (self.master.dtype, self.device):
            self._build_buffers(first.dtype, device)
        for ref, p, local in zip(self.refs, params, locals_):
            view = self.master.shard_view(ref.name)
            # Compare storages, not data_ptr(): an empty view's data_ptr() is 0 whatever its storage.
            if (local.untyped_storage().data_ptr(), local.storage_offset()) != (
                    view.untyped_storage().data_ptr(), view.storage_offset()):
                record_copy(view, local)
                view.copy_(local.reshape(-1))
            set_local_tensor(p, view)
        self.sharded = params
        self._register(self.sharded)

    # ----- registration ---------------------------------------------------------------------------
    def _register(self, params: list[nn.Parameter]) -> None:
        for ref, p in zip(self.refs, params):
            set_parameter(ref.module, ref.attr, p)
            for module, attr in ref.shared:
                set_parameter(module, attr, p)

    def rename(self, name: str, names: dict[str, str]) -> None:
        """Name the unit and its tensors (e.g. by FQNs once the root is known); no offset moves."""
        old = self.layout
        slots = tuple(TensorSlot(names[t.name], t.shape, t.block, t.offset) for t in old.tensors)
        layout = Layout(old.world_size, old.shard_size, slots, align=old.align, name=name)
        buffers = (self.master, self.compute, self.grads, self.reduce, self.main_grad)
        for buf in {id(b): b for b in buffers}.values():
            buf.relabel(layout)
        self.refs = [ParamRef(names[r.name], r.module, r.attr, r.shared) for r in self.refs]
        self.layout = layout
        self.name = name

    # ----- unshard / reshard ----------------------------------------------------------------------
    @property
    def needs_gather(self) -> bool:
        """``unshard`` would issue an all-gather: not unsharded (or unsharded from weights an optimizer
        step has since changed, e.g. an evaluation forward between backward and step) nor gathering."""
        if self._pending_all_gather is not None:
            return False
        return self.state is not UnitState.UNSHARDED or version_of(self.master.shard) != self._gathered_from

    @property
    def gather_group(self) -> dist.ProcessGroup:
        """The group ``unshard`` gathers over (``reshard_after_forward=N``'s group after forward)."""
        return self.post_forward_group if self.state is UnitState.GROUPED else self.shard_group

    def unshard(self, async_op: bool = False, after: torch.Event | None = None) -> None:
        """Issue the one all-gather that fills the unsharded buffer (waits unless ``async_op``).

        On CUDA the all-gather stream first waits for the current stream, or only for ``after``.
        """
        if not self.needs_gather:
            if not async_op:
                self.wait_for_unshard()
            return
        if self.state is UnitState.UNSHARDED:  # stale: the optimizer stepped since it was gathered
            self._register(self.sharded)
            self.state = UnitState.SHARDED
        with side_stream(self.ag_stream, after):
            self.compute.alloc_full()
            source, group = self.compute.shard, self.shard_group
            if self.state is UnitState.GROUPED:
                source, group = self._grouped, self.post_forward_group
            elif self.compute is not self.master:  # the mixed-precision cast and/or the host-to-device copy
                self.compute.copy_(self.master.shard, non_blocking=self._pin)
            # The all-gather refills memory that autograd saved in forward (reshard_after_forward) with
            # the same values, so the version counter guarding saved tensors must not move: remember it
            # now and restore it once the collective is done (gloo bumps it when the work completes).
            self._keep_version = preserve_version_counter(self.compute.full)
            self._pending_all_gather = all_gather(self.compute.full, source, group, label=self.name)
        if not async_op:
            self.wait_for_unshard()

    def wait_for_unshard(self) -> None:
        """Finish an issued all-gather and register the unsharded parameters on the modules."""
        if self._pending_all_gather is not None:
            pending, self._pending_all_gather = self._pending_all_gather, None
            pending.wait()
            with self._keep_version:  # restores the version remembered at issue
                pass
            self._version = self._written_version()
            self._gathered_from = version_of(self.master.shard)
            self._grouped = None  # gathered from: no longer needed
        if self.state is not UnitState.UNSHARDED:
            for sharded, unsharded in zip(self.sharded, self.unsharded):
                unsharded.requires_grad_(sharded.requires_grad)  # a switch after wrapping takes effect
            self._register(self.unsharded)
            self.state = UnitState.UNSHARDED

    def reshard(self, to_group: bool = False) -> None:
        """Register the sharded parameters again and free the unsharded buffer.

        If the unsharded parameters were written to since the all-gather (``with unsharded(model):``
        around an initialisation or an edit), this rank first keeps its slice of what was written.

        Args:
            to_group: after forward with ``reshard_after_forward=N``: keep this rank's 1/N of the
                unsharded buffer (one copy), which backward gathers over the N ranks of its group.
        """
        if self._pending_all_gather is not None:
            self.wait_for_unshard()  # never free memory a collective is still writing
        if self.state is UnitState.GROUPED and not to_group:
            self._grouped = None
            self.state = UnitState.SHARDED
        if self.state is not UnitState.UNSHARDED:
            return
        if self._written_version() != self._version:
            lo, hi = self.layout.shard_range(self.rank)
            self.master.copy_(self.compute.full[lo:hi])
        self._register(self.sharded)
        self.state = UnitState.SHARDED
        if to_group and self.post_forward_group is not None:
            n = self.layout.total_numel // self._group_size
            part = self.compute.full[self._group_index * n:(self._group_index + 1) * n]
            self._grouped = torch.empty_like(part)
            record_copy(self._grouped, part)
            self._grouped.copy_(part)
            self.state = UnitState.GROUPED
        self.compute.free_full()

    def _written_version(self) -> int:
        """A number that grows with every in-place write into the unsharded parameters.

        The buffer's version counter sees writes into its views; a write into a TP parameter (a DTensor
        over a view) runs on the local view below autograd and bumps only the DTensor's own counter.
        """
        return version_of(self.compute.full) + sum(
            version_of(p) for p, tp in zip(self.unsharded, self.tensor_parallel) if tp is not None)

    def set_post_forward_group(self, group: dist.ProcessGroup, index: int, size: int) -> None:
        """``reshard_after_forward=size``: this rank is ``index`` in ``group`` (consecutive shard ranks)."""
        self.post_forward_group, self._group_index, self._group_size = group, index, size

    # ----- gradients ------------------------------------------------------------------------------
    def _on_first_grad(self, grad: torch.Tensor) -> None:
        # Runs before autograd accumulates a gradient of this unit: the buffer is allocated only now,
        # after the backward ops that produced it released their inputs (lower peak memory).
        self.prepare_gradients()

    def prepare_gradients(self) -> None:
        """Point every unsharded parameter's ``.grad`` at its view of the (zeroed) gradient buffer."""
        if self._grads_ready:
            return
        if self._reduced_in_backward:
            # A gradient after the unit's reduce-scatter would be lost, and reducing again on this rank
            # only would pair with another unit's collective on the others.
            raise RuntimeError(
                f"fully_shard: unit {self.name!r} received a gradient after its reduce-scatter in this "
                "backward: its backward had ended (its inputs' gradients were computed); a parameter of the "
                "unit is used by a computation that does not depend on the unit's inputs and runs later")
        if not self._unsynced_grads:
            self.grads.alloc_full()
            self.grads.full.zero_()
        self._waiting = set()
        for i, (p, grad) in enumerate(zip(self.unsharded, self._unsharded_grads)):
            if p.requires_grad:
                p.grad = grad
                self._waiting.add(i)
        self._grads_ready = True

    @property
    def grads_ready(self) -> bool:
        """The unsharded ``.grad`` views are set for this backward (its gradients may still be landing)."""
        return self._grads_ready

    @property
    def all_grads_landed(self) -> bool:
        """Every gradient of this backward has landed in the unsharded gradient buffer."""
        return self._grads_ready and not self._waiting

    @property
    def trains(self) -> bool:
        """Some parameter requires a gradient: the unit takes part in every backward's reduce-scatters."""
        return any(p.requires_grad for p in self.sharded)

    def _on_grad_accumulated(self, index: int) -> None:
        if torch.is_grad_enabled():  # accumulated with create_graph: .grad was replaced, not added into
            raise RuntimeError(
                f"fully_shard: backward(create_graph=True) accumulated a gradient into parameter "
                f"{self.refs[index].name!r} of unit {self.name!r} with a graph; its .grad then stops being a "
                "view into the unit's gradient buffer. Take the inner gradient with torch.autograd.grad(..., "
                "create_graph=True) and call .backward() (without create_graph) on the final loss")
        self._landed.add(index)
        if index in self._waiting:  # once per parameter and backward (a retained graph may run twice)
            self._waiting.remove(index)
            if not self._waiting and self.post_backward_callback is not None:
                self.post_backward_callback()

    @property
    def will_reduce(self) -> bool:
        """``reduce_gradients`` would issue a reduce-scatter now."""
        return self.requires_grad_sync and (self._grads_ready or self.trains)

    def reduce_gradients(self) -> bool:
        """Reduce-scatter this backward's gradients (issued, not waited). Returns True if it reduced.

        Called for every training unit that ran forward, on every rank, in the same order, whether or
        not a gradient reached it on this rank: a rank where no parameter of the unit was used (an
        expert that got no tokens) contributes zeros, so the collectives never depend on the data.
        """
        if self.reshard_after_backward:
            self.reshard()
        if not self._grads_ready:
            if not (self.trains and self.requires_grad_sync):
                return False
            self.prepare_gradients()  # zeros (or what unsynced backwards accumulated)
        self._grads_ready = False
        for p in self.unsharded:
            p.grad = None
        if not self.requires_grad_sync:
            self._unsynced_grads = True  # keep accumulating unsharded gradients until a synced backward
            return False
        self._unsynced_grads = False
        self._reduced_in_backward = True
        if self._all_reduces:
            self._reduced, self._landed = self._landed, set()
        else:  # an HSDP partial step: no .grad until the all-reduce, which reports every landed gradient
            self._reduced = set()
        self._accumulate_into_grads = any(p.grad is not None for p in self.sharded)
        direct = (not self._accumulate_into_grads and self.reduce.dtype == self.main_grad.dtype
                  and self._all_reduces and self._partial is None  # a partial sum lives on in scratch
                  and not self.offload)  # reduced on the device, then copied to the host
        with side_stream(self.rs_stream):
            self.main_grad.alloc_shard()
            if self.reduce is not self.grads:
                self.reduce.alloc_full()
                record_copy(self.reduce.full, self.grads.full)
                self.reduce.full.copy_(self.grads.full)  # reduce in reduce_dtype
            # Straight into the sharded gradients, unless they must be added to or cast: then a scratch
            # shard that lives until the reduce is finished.
            self._reduce_out = self.main_grad.shard if direct else torch.empty(
                self.layout.shard_size, dtype=self.reduce.dtype, device=self.device)
            self._pending_reduce = reduce_scatter(self._reduce_out, self.reduce.full, self.reduce_group,
                                                  label=self.name)
        return True

    @property
    def _all_reduces(self) -> bool:
        """This reduce ends with the gradients given out (not an HSDP step that skips the all-reduce)."""
        return self.replicate_group is None or self.requires_all_reduce

    def landed_mask(self, out: torch.Tensor) -> None:
        """Write into ``out`` (one int per parameter, zeroed) 1 for each parameter that got a gradient on
        this rank since the previous reduce."""
        out[sorted(self._reduced or ())] = 1

    def end_backward(self, used_anywhere: list[int] | None) -> None:
        """Give the sharded parameters their ``.grad`` views once the reduce is finished.

        ``used_anywhere`` (the landed masks, maxed over every rank of the mesh) says which parameters
        got a gradient on some rank: those get the averaged shard on every rank, including the ranks
        that did not use them; a parameter no rank used keeps ``.grad`` None, as in single-process
        training (optimizers skip it). None: the unit did not reduce in this backward.
        """
        self._reduced_in_backward = False
        if used_anywhere is None:
            return
        for p, g, used in zip(self.sharded, self._sharded_grads, used_anywhere):
            if p.grad is None and used:
                p.grad = g

    def release_unused_gradients(self) -> None:
        """Free the sharded gradient shard if no sharded parameter holds its gradient (after zero_grad)."""
        if all(p.grad is None for p in self.sharded):
            self.main_grad.free_shard()

    def discard_step(self) -> None:
        """Forget an aborted step: wait for issued collectives (dropping their errors), drop this step's
        unsharded gradients and partial sums, and reshard."""
        for name in ("_pending_all_gather", "_pending_reduce", "_pending_all_reduce"):
            pending = getattr(self, name)
            setattr(self, name, None)
            if pending is not None:
                try:
                    pending.wait()
                except Exception:  # noqa: BLE001 - the step is discarded; its next collectives will raise
                    pass
        for p in self.unsharded:
            p.grad = None
        self._reduce_out = self._partial = None
        self._grads_ready = self._unsynced_grads = self._reduced_in_backward = False
        self._waiting, self._landed = set(), set()
        self.grads.free_full()
        self.reduce.free_full()
        self.reshard()

    @property
    def reduce_scatter_running(self) -> bool:
        """The reduce-scatter is issued and not advanced past (HSDP's all-reduce not issued yet)."""
        return self._pending_reduce is not None

    def try_finish_reduce(self) -> bool:
        """Finish the reduce if its collectives have completed (issuing HSDP's all-reduce once the
        reduce-scatter has); returns whether it is finished. Never waits for a peer: one whose unit got
        no gradient issues its reduce-scatter only at the end of its backward, and may need this rank's
        next all-gathers first."""
        if self._pending_reduce is not None:
            if not self._pending_reduce.done:
                return False
            self.advance_reduce()
        if self._pending_all_reduce is not None and not self._pending_all_reduce.done:
            return False
        self.finish_reduce()
        return True

    def advance_reduce(self) -> None:
        """Wait for the reduce-scatter and free the unsharded gradients; HSDP then issues the all-reduce
        over the replicas on the reduce-scatter stream, finished by ``finish_reduce`` later, so it runs
        while the next units' backward computes."""
        if self._pending_reduce is None:
            return
        pending, self._pending_reduce = self._pending_reduce, None
        pending.wait()
        self.grads.free_full()
        self.reduce.free_full()
        out = self._reduce_out
        if not self._all_reduces:  # FSDP2's partial reduce: summed here, all-reduced by a later backward
            self._partial = out if self._partial is None else self._partial.add_(out)
            self._reduce_out = None
            return
        if self._partial is not None:
            out.add_(self._partial)
            self._partial = None
        if self.replicate_group is not None:
            with side_stream(self.rs_stream):
                self._pending_all_reduce = all_reduce(out, self.replicate_group, label=self.name)

    def finish_reduce(self) -> None:
        """Finish the reduce (the reduce-scatter, HSDP's all-reduce), divide, run the hook, and write the
        sharded gradients (on the host when offloading: asynchronously from pinned memory)."""
        self.advance_reduce()
        out, self._reduce_out = self._reduce_out, None
        if out is None:
            return
        if self._pending_all_reduce is not None:
            pending, self._pending_all_reduce = self._pending_all_reduce, None
            pending.wait()
        out.div_(self.world if self.gradient_divide_factor is None else self.gradient_divide_factor)
        if self.all_reduce_hook is not None:
            _on_stream(self.all_reduce_hook_stream, self.all_reduce_hook, out)
        if out is self.main_grad.shard:
            return
        if self._accumulate_into_grads:
            if self.offload:
                record_copy(self.main_grad.shard, out)
                out = out.to(self.main_grad.shard.device)  # device to host, then added there
            for ref, p in zip(self.refs, self.sharded):
                if p.grad is None:
                    self.main_grad.shard_view(ref.name).zero_()
            self.main_grad.add_(out)
        else:  # offloaded (into pinned memory the copy is asynchronous: the root syncs once) or a cast
            self.main_grad.copy_(out, non_blocking=self._pin)


def _on_stream(stream: torch.cuda.Stream | None, hook: Callable[[torch.Tensor], None],
               tensor: torch.Tensor) -> None:
    """``hook(tensor)`` on ``stream`` (after the current stream's work; the current stream then waits
    for it, so ``tensor`` is not freed or read before the hook is done), or as is without one."""
    if stream is None:
        hook(tensor)
        return
    current = torch.cuda.current_stream(tensor.device)
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        hook(tensor)
    current.wait_stream(stream)
