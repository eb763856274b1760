"""The torch llama-tiny, the MoE decoders, and the function that applies ragged-fsdp to them."""

from torch_backend.models.llama import Llama, cross_entropy
from torch_backend.models.moe import MoEDecoder, moe_loss
from torch_backend.models.parallelize import parallelize

__all__ = ["Llama", "MoEDecoder", "cross_entropy", "moe_loss", "parallelize"]
