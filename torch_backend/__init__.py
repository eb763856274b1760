"""torch_backend: ragged-fsdp on PyTorch (the RaggedShard DTensor placement and the FSDP runtime).

Importing the package patches nothing in torch: the first ``RaggedShard`` constructed installs the DTensor
patches (``placement/_dtensor_patches``) that make it work with ``distribute_tensor``, ``redistribute``,
``full_tensor``, ops and torch.distributed.checkpoint.
"""

from ragged.checkpoint import CheckpointError  # the one checkpoint error (DCP and neutral, both stacks)
from torch_backend._collectives import CollectiveError
from torch_backend._debug import DebugCounter, debug_counter
from torch_backend.fsdp import (
    FSDPModule,
    MixedPrecisionPolicy,
    clip_grad_norm_,
    fully_shard,
    load_dcp_checkpoint,
    load_neutral_checkpoint,
    plan_module,
    register_fsdp_forward_method,
    save_dcp_checkpoint,
    save_neutral_checkpoint,
    unsharded,
)
from torch_backend.placement import RaggedShard, UnsupportedRaggedOp

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
    "load_dcp_checkpoint",
    "plan_module",
    "register_fsdp_forward_method",
    "save_dcp_checkpoint",
    "unsharded",
]
