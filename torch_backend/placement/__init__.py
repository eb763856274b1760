"""torch_backend.placement: the RaggedShard DTensor placement (its ops, redistribution and DTensor hooks).

Importing it installs the DTensor hooks (``_dtensor_hooks``) that make ``RaggedShard`` work with
``distribute_tensor``, ``redistribute``, ``full_tensor``, ops and torch.distributed.checkpoint.
"""

from torch_backend.placement import _dtensor_hooks  # noqa: F401  (importing it installs the DTensor hooks)
from torch_backend.placement._ops import UnsupportedRaggedOp
from torch_backend.placement._placement import RaggedShard

__all__ = ["RaggedShard", "UnsupportedRaggedOp"]
