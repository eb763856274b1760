"""Tensor parallelism (TP) of the llamas, encoded once in the core: Megatron's split and its rules.

Weights are ``[out, in]``. The column-parallel projections split their out dim (``wq wk wv`` by whole
heads, ``w1 w3`` by hidden units), the row-parallel ones their in dim (``wo w2``), the embedding and the
head split the vocabulary (dim 0), the norms stay whole on every TP rank. This is the split both runtimes
apply: torchtitan's plan in ``torch_backend/models/tensor_parallel.py`` and ``jax_backend.models.
TENSOR_RULES`` (their tests check that they agree with ``LLAMA_TP_SPLIT``). FSDP then shards each TP
rank's local tensors over the data-parallel devices: every TP rank has the same local shapes, so the
planner plans them once (``tp_local_shapes``), as the runtimes do.
"""

from __future__ import annotations

import fnmatch

from ragged._errors import RaggedError
from ragged._units import ModelShapes, UnitShapes
from ragged.models._presets import LLAMA_CONFIGS, LlamaConfig, llama_shapes

# fnmatch pattern of a llama FQN -> the dim TP splits; a tensor no pattern matches (a norm) stays whole.
LLAMA_TP_SPLIT: dict[str, int] = {
    "tok_embeddings.weight": 0,
    "layers.*.attention.w[qkv].weight": 0,
    "layers.*.attention.wo.weight": 1,
    "layers.*.feed_forward.w[13].weight": 0,
    "layers.*.feed_forward.w2.weight": 1,
    "output.weight": 0,
}


class TensorParallelError(RaggedError):
    """A tensor-parallel degree that does not split a tensor evenly (names the tensor and the rule)."""


def tp_split_dim(fqn: str) -> int | None:
    """The dim of llama tensor ``fqn`` that TP splits, None for a tensor every TP rank holds whole."""
    return next((dim for pattern, dim in LLAMA_TP_SPLIT.items() if fnmatch.fnmatchcase(fqn, pattern)), None)


def check_tensor_parallel(c: LlamaConfig, tp: int) -> None:
    """Check that ``tp`` splits llama ``c`` as Megatron does: whole heads, hidden units and vocabulary rows.

    Raises:
        TensorParallelError: ``tp`` below 1, or not dividing the count a tensor is split by; the message
            names the tensor, its rule and both numbers.
    """
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise TensorParallelError(f"tensor parallelism: the degree must be an int >= 1, got {tp!r}")
    rules = (("layers.*.attention.wq.weight, wo", "whole query heads", "n_heads", c.n_heads),
             ("layers.*.attention.wk.weight, wv", "whole key/value heads", "n_kv_heads", c.n_kv_heads),
             ("layers.*.feed_forward.w1.weight, w2, w3", "hidden units", "ffn_dim", c.ffn_dim),
             ("tok_embeddings.weight, output.weight", "vocabulary rows", "vocab_size", c.vocab_size))
    for tensors, rule, field, count in rules:
        if count % tp:
            raise TensorParallelError(f"{tensors}: tensor parallelism splits them by {rule}: TP {tp} must "
                                      f"divide {field}={count}; choose a TP degree that divides it")


def tp_local_shape(fqn: str, shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
    """The shape every TP rank holds of llama tensor ``fqn`` (full shape ``shape``) under TP ``tp``.

    Raises:
        TensorParallelError: ``tp`` does not divide the split dim.
    """
    dim = tp_split_dim(fqn)
    if dim is None or tp == 1:
        return tuple(shape)
    if shape[dim] % tp:
        raise TensorParallelError(f"{fqn} (shape {tuple(shape)}): tensor parallelism splits dim {dim} "
                                  f"({shape[dim]}) evenly; TP {tp} does not divide it")
    return (*shape[:dim], shape[dim] // tp, *shape[dim + 1:])


def tp_local_shapes(shapes: ModelShapes, tp: int) -> ModelShapes:
    """``shapes`` (a llama's units) with every tensor replaced by its TP-local shape under TP ``tp``.

    Raises:
        TensorParallelError: a tensor that is not a llama's (no split rule and not a norm: the split is
            encoded for the llama's FQNs only), or ``tp`` not dividing a split dim.
    """
    for u in shapes.units:
        for n, _ in u.tensors:
            if tp_split_dim(n) is None and not n.endswith("norm.weight"):
                raise TensorParallelError(f"{n} in {shapes.name}: tensor parallelism is encoded for the "
                                          "llama's tensors (ragged.models.LLAMA_TP_SPLIT and the norms); "
                                          "this tensor has no rule")
    return ModelShapes(shapes.name, tuple(
        UnitShapes(u.name, tuple((n, tp_local_shape(n, s, tp)) for n, s in u.tensors)) for u in shapes.units))


def llama_tp_shapes(name: str, tp: int) -> ModelShapes:
    """The TP-local units of llama preset ``name`` under TP ``tp`` (what each TP rank's FSDP plans).

    Raises:
        TensorParallelError: ``name`` is not a llama preset, or ``tp`` does not split it
            (``check_tensor_parallel``).
    """
    if name not in LLAMA_CONFIGS:
        raise TensorParallelError(f"tensor parallelism is encoded for the llama presets "
                                  f"({', '.join(LLAMA_CONFIGS)}), not {name!r}")
    check_tensor_parallel(LLAMA_CONFIGS[name], tp)
    return tp_local_shapes(llama_shapes(name, LLAMA_CONFIGS[name]), tp)
