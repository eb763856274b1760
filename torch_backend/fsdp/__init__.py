"""torch_backend.fsdp: the FSDP runtime (``fully_shard``, its units, hooks, DBuffers and checkpoints)."""

from torch_backend.fsdp._api import MixedPrecisionPolicy
from torch_backend.fsdp._fully_shard import (
    FSDPModule,
    clip_grad_norm_,
    fully_shard,
    plan_module,
    register_fsdp_forward_method,
    unsharded,
)
from torch_backend.fsdp._neutral_checkpoint import load_neutral_checkpoint, save_neutral_checkpoint
from torch_backend.fsdp._state_dict import CheckpointError, load_checkpoint, save_checkpoint

__all__ = [
    "CheckpointError",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "clip_grad_norm_",
    "fully_shard",
    "load_checkpoint",
    "load_neutral_checkpoint",
    "plan_module",
    "register_fsdp_forward_method",
    "save_checkpoint",
    "save_neutral_checkpoint",
    "unsharded",
]
