"""The flax llama-tiny and the function that applies ragged-fsdp to it."""

from jax_backend.models.llama import Llama, cross_entropy
from jax_backend.models.parallelize import model_params, parallelize

__all__ = ["Llama", "cross_entropy", "model_params", "parallelize"]
