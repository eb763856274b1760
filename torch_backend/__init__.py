"""torch_backend: ragged-fsdp on PyTorch (the RaggedShard DTensor placement and the FSDP runtime)."""

from torch_backend._placement import RaggedShard

__all__ = [
    "RaggedShard",
]
