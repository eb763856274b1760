"""The core's tensor-parallel split of the llamas (ragged/models/_tensor_parallel.py) against Megatron's rule
written out here from the config: column-parallel projections split their out dim, row-parallel ones
their in dim, the embedding and head the vocabulary, the norms stay whole."""

import math

import pytest

from ragged.models import (
    LLAMA_TINY,
    LlamaConfig,
    TensorParallelError,
    check_tensor_parallel,
    llama_shapes,
    llama_tp_shapes,
    model_shapes,
    tp_local_shapes,
    tp_split_dim,
)


def megatron_local(c: LlamaConfig, tp: int) -> dict[str, tuple[int, ...]]:
    """Layer 0's and the embedding/head's TP-local shapes, from the config (Megatron's table)."""
    d, q, kv = c.dim, c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    return {"tok_embeddings.weight": (c.vocab_size // tp, d), "output.weight": (c.vocab_size // tp, d),
            "norm.weight": (d,),
            "layers.0.attention.wq.weight": (q // tp, d), "layers.0.attention.wk.weight": (kv // tp, d),
            "layers.0.attention.wv.weight": (kv // tp, d), "layers.0.attention.wo.weight": (d, q // tp),
            "layers.0.feed_forward.w1.weight": (c.ffn_dim // tp, d),
            "layers.0.feed_forward.w2.weight": (d, c.ffn_dim // tp),
            "layers.0.feed_forward.w3.weight": (c.ffn_dim // tp, d),
            "layers.0.attention_norm.weight": (d,), "layers.0.ffn_norm.weight": (d,)}


@pytest.mark.parametrize("tp", [1, 2])
def test_local_shapes_are_megatrons_split(tp):
    local = {n: s for u in tp_local_shapes(llama_shapes("t", LLAMA_TINY), tp).units for n, s in u.tensors}
    for name, shape in megatron_local(LLAMA_TINY, tp).items():
        assert local[name] == shape, name


@pytest.mark.parametrize("name, tp", [("llama-tiny", 2), ("llama3-8b", 2), ("llama3-8b", 8),
                                      ("llama3-70b", 8)])
def test_the_tp_ranks_pieces_rebuild_each_tensor(name, tp):
    """TP ranks' pieces of a split tensor tile it along the split dim (so their numel adds up to the
    tensor's), a whole tensor (a norm) is held by every rank."""
    full = model_shapes(name)
    local = llama_tp_shapes(name, tp)
    for fu, lu in zip(full.units, local.units):
        for (n, s), (_, ls) in zip(fu.tensors, lu.tensors):
            k = tp_split_dim(n)
            if k is None:
                assert ls == s and n.endswith("norm.weight"), n
            else:
                assert (*ls[:k], tp * ls[k], *ls[k + 1:]) == s, n  # tp pieces side by side along dim k
                assert tp * math.prod(ls) == math.prod(s)


@pytest.mark.parametrize("c, tp, match", [
    (LLAMA_TINY, 3, r"wq.weight, wo: .*whole query heads: TP 3 must divide n_heads=4"),
    (LLAMA_TINY, 4, r"wk.weight, wv: .*whole key/value heads: TP 4 must divide n_kv_heads=2"),
    (LlamaConfig(256, 64, 1, 4, 4, 16, 98), 4, r"feed_forward.w1.weight, w2, w3: .*TP 4 must divide "
                                               r"ffn_dim=98"),
    (LlamaConfig(251, 64, 1, 2, 2, 32, 64), 2, r"tok_embeddings.weight, output.weight: .*vocabulary rows: "
                                               r"TP 2 must divide vocab_size=251"),
    (LLAMA_TINY, 0, r"degree must be an int >= 1, got 0"),
])
def test_errors_name_the_tensor_and_the_rule(c, tp, match):
    with pytest.raises(TensorParallelError, match=match):
        check_tensor_parallel(c, tp)


def test_shape_level_errors():
    with pytest.raises(TensorParallelError, match=r"layers.0.feed_forward.w1.weight \(shape \(98, 64\)\): "
                                                  r"tensor parallelism splits dim 0 \(98\)"):
        tp_local_shapes(llama_shapes("odd", LlamaConfig(256, 64, 1, 4, 4, 16, 98)), 4)
    with pytest.raises(TensorParallelError, match=r"q_a_proj.weight in deepseek-v3: .* has no rule"):
        tp_local_shapes(model_shapes("deepseek-v3"), 2)
    with pytest.raises(TensorParallelError, match=r"llama presets .* not 'mixtral-8x7b'"):
        llama_tp_shapes("mixtral-8x7b", 2)
