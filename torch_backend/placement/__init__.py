"""torch_backend.placement: the RaggedShard DTensor placement (its ops, redistribution and DTensor patches).

Constructing the first ``RaggedShard`` installs the DTensor patches (``_dtensor_patches``) that make it
work with ``distribute_tensor``, ``redistribute``, ``full_tensor``, ops and torch.distributed.checkpoint;
importing the package patches nothing. ``make_dtensor`` (the FSDP runtime's parameters) and
``start_all_to_all`` (Muon's gathers) are what the rest of torch_backend builds on.
"""

from torch_backend.placement._dtensor import make_dtensor
from torch_backend.placement._ops import UnsupportedRaggedOp
from torch_backend.placement._placement import RaggedShard, ragged_mesh_dim
from torch_backend.placement._redistribute import start_all_to_all

__all__ = ["RaggedShard", "UnsupportedRaggedOp", "make_dtensor", "ragged_mesh_dim", "start_all_to_all"]
