"""torch_backend.fsdp: the FSDP runtime (``fully_shard``, its units, hooks, DBuffers and checkpoints).

Beside what ``torch_backend`` exports, ``units(model)`` lists the ``Unit``s (one flat ``DBuffer`` each,
in a ``UnitState``) that tests and benchmarks inspect.
"""

from torch_backend.fsdp._api import MixedPrecisionPolicy
from torch_backend.fsdp._dbuffer import DBuffer
from torch_backend.fsdp._dcp_checkpoint import load_dcp_checkpoint, save_dcp_checkpoint
from torch_backend.fsdp._fully_shard import (
    GranularityArg,
    clip_grad_norm_,
    fully_shard,
    plan_module,
    units,
    unsharded,
)
from torch_backend.fsdp._module import FSDPModule, UnshardHandle, register_fsdp_forward_method
from torch_backend.fsdp._neutral_checkpoint import load_neutral_checkpoint, save_neutral_checkpoint
from torch_backend.fsdp._unit import Unit, UnitState

__all__ = [
    "DBuffer",
    "FSDPModule",
    "GranularityArg",
    "MixedPrecisionPolicy",
    "Unit",
    "UnitState",
    "UnshardHandle",
    "clip_grad_norm_",
    "fully_shard",
    "load_dcp_checkpoint",
    "load_neutral_checkpoint",
    "plan_module",
    "register_fsdp_forward_method",
    "save_dcp_checkpoint",
    "save_neutral_checkpoint",
    "units",
    "unsharded",
]
