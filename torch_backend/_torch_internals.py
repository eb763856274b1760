"""Every torch private API torch_backend reaches, in one place, checked against torch 2.11 to 2.13.

torch accepts a custom ``Placement`` only in ``DTensor.from_local`` / ``to_local``, so the RaggedShard
patches (``placement/_dtensor_patches``, installed on the first RaggedShard) wrap torch's private DTensor
machinery; the FSDP runtime uses the few autograd and DTensor internals FSDP2 itself uses. Each is
imported or wrapped here and nowhere else. Importing this module only reads torch (it patches nothing)
and checks it (``_check_torch``): a torch older than 2.11, or one that lacks an internal, raises here at
import instead of failing later inside a patch or a backward; a torch newer than 2.13 warns.

Runs on 2.13 here; against 2.11.0 (the GPU image's) it was checked by reading that release's source:
every name below exists, and the functions the patches wrap or rebind have the same signatures and
decorators, except two that grew on 2.13: ``DTensor.from_local`` gained ``grad_placements`` (which
nothing here passes) and ``_ToTorchTensor.backward`` accepts ``None`` (the patch tests for it first).
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Callable

import torch
import torch.distributed.tensor._api as dt_api
import torch.distributed.tensor._redistribute as dt_redistribute
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
from torch.autograd import Variable
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema, OutputSharding
from torch.distributed.tensor._ops._math_ops import _NormPartial as NormPartial
from torch.distributed.tensor._sharding_prop import LocalLRUCache, ShardingPropagator
from torch.distributed.tensor._utils import (
    _compute_local_shape_and_global_offset as compute_local_shape_and_global_offset,
)
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import return_and_correct_aliasing

__all__ = [
    "DTensorSpec",
    "DataDependentOutputException",
    "DynamicOutputShapeException",
    "LocalLRUCache",
    "NormPartial",
    "OpSchema",
    "OutputSharding",
    "ShardingPropagator",
    "TensorMeta",
    "compute_local_shape_and_global_offset",
    "current_mesh",
    "dt_api",
    "dt_redistribute",
    "is_view_op",
    "loss_parallel_active",
    "mutates_self",
    "offset_free",
    "preserve_version_counter",
    "pytree",
    "queue_backward_callback",
    "return_and_correct_aliasing",
    "source_mesh",
    "set_local_tensor",
    "set_parameter",
    "state_dict_utils",
    "version_of",
]

SUPPORTED = ((2, 11), (2, 13))

# ``with preserve_version_counter(t):`` restores ``t``'s autograd version counter on exit (a collective
# that refills saved memory with the same values must not invalidate what autograd saved).
preserve_version_counter = torch.autograd._unsafe_preserve_version_counter


def version_of(tensor: torch.Tensor) -> int:
    """``tensor``'s autograd version counter (bumped by every in-place write)."""
    return tensor._version


def current_mesh() -> DeviceMesh:
    """The mesh of the innermost ``with mesh:`` block (DTensor's default when none is passed)."""
    return dt_api._mesh_resources.get_current_mesh()


def source_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh ``mesh`` was cut from (itself when it was not cut from another; torch's "root mesh")."""
    return mesh._get_root_mesh()


def set_local_tensor(dt: DTensor, local: torch.Tensor) -> None:
    """Make ``local`` (same shape and dtype) the storage of ``dt`` in place, keeping the object."""
    dt._local_tensor = local


def offset_free(dt: DTensor) -> DTensor:
    """A DTensor over the same local tensor whose wrapper has storage offset 0.

    DTensor's constructor copies its local tensor's storage offset onto the wrapper, whose storage is
    empty, so a DTensor over a view into a flat shard reports ``data_ptr() != 0``; DCP's async staging
    then reads the wrapper's (invalid) storage. Built over a memoryless stub of the local's shape (an
    expanded 0-d tensor, offset 0), then given the real local: the values are the same memory.
    """
    local = dt._local_tensor
    stub = torch.empty((), dtype=local.dtype, device=local.device).expand(local.shape)
    out = DTensor(stub, dt._spec, requires_grad=False)
    set_local_tensor(out, local)
    return out


def set_parameter(module: torch.nn.Module, name: str, param: torch.nn.Parameter) -> None:
    """Register ``param`` as ``module.<name>`` in place of the parameter registered there.

    What ``nn.Module.__setattr__`` does for a registered parameter, without its per-call checks and
    global hooks (FSDP2's ``unsafe_setattr_param``): it runs for every parameter at every unshard/reshard.
    """
    module._parameters[name] = param


def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the backward pass now running ends (FSDP2's end-of-backward callback)."""
    Variable._execution_engine.queue_callback(callback)


def mutates_self(op: torch._ops.OpOverload) -> bool:
    """Whether ``op`` writes its first argument (an in-place op)."""
    alias = op._schema.arguments[0].alias_info if op._schema.arguments else None
    return bool(alias is not None and alias.is_write)


def is_view_op(op: torch._ops.OpOverload) -> bool:
    return op._schema._is_view_op()


def loss_parallel_active() -> bool:
    """Whether code runs under ``torch.distributed.tensor.parallel.loss_parallel()``: while it is entered,
    DTensor dispatches the cross-entropy ops to its own handlers."""
    return torch.ops.aten._log_softmax.default in DTensor._op_dispatcher._custom_op_handlers


def state_dict_utils() -> types.ModuleType | None:
    """``torch.distributed._state_dict_utils`` (None on a torch without it)."""
    try:
        import torch.distributed._state_dict_utils as module
    except ImportError:
        return None
    return module


# The torch functions whose function objects the DTensor patches rebind (their code is swapped, so every
# caller reaches the patch): each must be a plain function without a closure.
REBINDABLE = (
    (dt_redistribute, "redistribute_local_tensor"),
    (dt_api, "distribute_tensor"),
    (dt_api, "_dtensor_init_helper"),
)


def _check_torch() -> None:
    """Refuse torch < 2.11, warn above 2.13, and fail loudly if an internal used here has moved."""
    version = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    if version < SUPPORTED[0]:
        raise RuntimeError(
            f"torch_backend needs torch >= 2.11 (DTensor's C++ dispatch); found {torch.__version__}"
        )
    if version > SUPPORTED[1]:
        warnings.warn(
            f"torch_backend's use of torch internals is tested on torch 2.11..2.13, not {torch.__version__}",
            stacklevel=3,
        )
    missing = [
        name
        for name, owner in (
            # patched or called by placement/_dtensor_patches
            ("compute_global_tensor_info", dt_api),
            ("_ToTorchTensor", dt_api),
            ("_mesh_resources", dt_api),
            ("propagate_op_sharding_non_cached", ShardingPropagator),
            ("_propagate_tensor_meta_non_cached", ShardingPropagator),
            ("_custom_op_handlers", DTensor._op_dispatcher),  # and read by loss_parallel_active
            ("_dispatch_get_local_results_slow_path", DTensor._op_dispatcher),
            ("__create_write_items__", DTensor),
            ("__create_chunk_list__", DTensor),
            ("__get_tensor_shard__", DTensor),
            # read by the FSDP runtime
            ("_get_root_mesh", DeviceMesh),
            ("queue_callback", Variable._execution_engine),
        )
        if not hasattr(owner, name)
    ]
    missing += [
        f"{owner.__name__}.{name} (a plain function)"
        for owner, name in REBINDABLE
        if not isinstance(getattr(owner, name, None), types.FunctionType) or getattr(owner, name).__closure__
    ]
    if missing:
        raise RuntimeError(
            f"torch {torch.__version__} lacks the internals {missing} that torch_backend relies on"
        )


_check_torch()
