"""torch_backend: ragged-fsdp on PyTorch (the RaggedShard DTensor placement and the FSDP runtime).

Importing the package installs the DTensor hooks (``_dtensor_hooks``) that make ``RaggedShard`` work
with ``distribute_tensor``, ``redistribute``, ``full_tensor``, ops and torch.distributed.checkpoint.
"""

from torch_backend import _dtensor_hooks  # noqa: F401  (importing it installs the DTensor hooks)
from torch_backend._api import MixedPrecisionPolicy
from torch_backend._collectives import CollectiveError
from torch_backend._debug import DebugCounter, debug_counter
from torch_backend._fully_shard import (
    FSDPModule,
    clip_grad_norm_,
    fully_shard,
    plan_module,
    register_fsdp_forward_method,
    unsharded,
)
from torch_backend._neutral_checkpoint import load_neutral_checkpoint, save_neutral_checkpoint
from torch_backend._ops import UnsupportedRaggedOp
from torch_backend._placement import RaggedShard
from torch_backend._state_dict import CheckpointError, load_checkpoint, save_checkpoint

__all__ = [
    "RaggedShard",
    "UnsupportedRaggedOp",
    "load_neutral_checkpoint",
    "save_neutral_checkpoint",
    "CheckpointError",
    "CollectiveError",
    "DebugCounter",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "clip_grad_norm_",
    "debug_counter",
    "fully_shard",
    "load_checkpoint",
    "plan_module",
    "register_fsdp_forward_method",
    "save_checkpoint",
    "unsharded",
]
