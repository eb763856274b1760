"""The torch llama-tiny, the MoE decoders, and the functions that apply ragged-fsdp (and expert
parallelism) to them."""

from torch_backend.models.expert_parallel import expert_parallel
from torch_backend.models.llama import Llama, cross_entropy
from torch_backend.models.moe import MoEDecoder, moe_loss
from torch_backend.models.parallelize import parallelize

__all__ = ["Llama", "MoEDecoder", "cross_entropy", "expert_parallel", "moe_loss", "parallelize"]
