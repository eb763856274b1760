"""jax_backend's tensor-parallel rules for the llama split each tensor as the core's memory plan assumes
(``ragged.models.LLAMA_TP_SPLIT``): the same dim of every parameter, whole norms alike."""

from jax_backend._tensor_parallel import _rule_dim
from jax_backend.models.parallelize import TENSOR_RULES
from ragged.models import LLAMA_TINY, llama_shapes, tp_split_dim


def test_tensor_rules_are_the_cores_split():
    names = [n for u in llama_shapes("llama-tiny", LLAMA_TINY).units for n, _ in u.tensors]
    assert {n: _rule_dim(n, TENSOR_RULES)[1] for n in names} == {n: tp_split_dim(n) for n in names}
