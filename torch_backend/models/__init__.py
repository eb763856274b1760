"""The torch llama-tiny and the function that applies ragged-fsdp to it."""

from torch_backend.models.llama import Llama, cross_entropy
from torch_backend.models.parallelize import parallelize

__all__ = ["Llama", "cross_entropy", "parallelize"]
