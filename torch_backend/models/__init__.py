"""The torch llama-tiny, the MoE decoders, and the functions that apply ragged-fsdp (and expert or tensor
parallelism) to them."""

from torch_backend.models.expert_parallel import expert_parallel
from torch_backend.models.llama import Llama, cross_entropy
from torch_backend.models.moe import MoEDecoder, moe_loss
from torch_backend.models.parallelize import parallelize
from torch_backend.models.tensor_parallel import apply_hf_llama_tensor_parallel, apply_tensor_parallel

__all__ = ["Llama", "MoEDecoder", "apply_hf_llama_tensor_parallel", "apply_tensor_parallel", "cross_entropy",
           "expert_parallel", "moe_loss", "parallelize"]
