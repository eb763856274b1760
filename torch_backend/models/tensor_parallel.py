"""Tensor parallelism for the torch ``Llama``, torchtitan's plan: apply it before ``parallelize`` (FSDP).
A second plan does the same for a HuggingFace ``LlamaForCausalLM`` (by its attribute names).

Megatron's split, with sequence parallelism between the blocks: the embedding is split by rows of the
vocabulary and leaves activations split along the sequence (``Shard(1)``); each block gathers the
sequence before attention and the feed-forward network (``PrepareModuleInput``), splits ``wq wk wv`` and
``w1 w3`` by output features (heads, hidden units) and ``wo w2`` by input features, whose partial sums
are reduce-scattered back along the sequence; the norms run on the sequence shards with replicated
weights (``SequenceParallel``); the head is split by vocabulary. With loss parallelism (torchtitan's
default) the logits stay split by vocabulary, a DTensor ``Shard(-1)`` whose local part is ``vocab / tp``
wide, and the cross entropy runs on the parts under torch's ``loss_parallel()`` (a max and a sum of
exponentials all-reduced per token); without it the head gathers the logits to the full vocabulary on
every TP rank.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from torch_backend.models.llama import Llama


def apply_tensor_parallel(model: Llama, tp_mesh: DeviceMesh, loss_parallel: bool = True) -> Llama:
    """Split ``model``'s weights over the 1-D ``tp_mesh`` in place (torchtitan's llama3 plan).

    The TP degree must divide the vocabulary, the head counts, ``ffn_dim`` and the sequence length of
    the inputs. Then ``parallelize(model, mesh["dp"])`` (or ``mesh["replicate", "dp"]``) shards each
    TP rank's local weights with ``fully_shard``.

    Args:
        loss_parallel: keep the logits split by vocabulary (``model(x)`` returns a DTensor ``Shard(-1)``
            on ``tp_mesh``); the loss and its backward must then run under
            ``torch.distributed.tensor.parallel.loss_parallel()`` (``cross_entropy`` accepts the DTensor).
            False gathers the logits to a plain ``(B, T, vocab)`` tensor on every TP rank.

    Returns:
        ``model``, whose weights are now DTensors on ``tp_mesh``.
    """
    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": _head(loss_parallel, input_layouts=Shard(1)),
    })
    gather_sequence = dict(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    for layer in model.layers:
        parallelize_module(layer, tp_mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(**gather_sequence),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(**gather_sequence),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        })
    return model


def apply_hf_llama_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool = True
                                   ) -> nn.Module:
    """Split a HuggingFace ``LlamaForCausalLM``'s weights over the 1-D ``tp_mesh`` in place.

    torchtitan's split of the projections (Megatron's: ``q k v gate up`` by output features, ``o down``
    by input features, the embedding and the head by vocabulary), without sequence parallelism: HF builds
    its causal mask and positions from the embedding output, which must stay a whole (replicated) tensor,
    so the norms keep plain replicated weights. Keyed by the attribute names alone: transformers is not
    imported here. ``loss_parallel`` as ``apply_tensor_parallel``'s (``model(x).logits`` split by
    vocabulary).

    Returns:
        ``model``, whose projection, embedding and head weights are now DTensors on ``tp_mesh``.
    """
    parallelize_module(model, tp_mesh, {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "lm_head": _head(loss_parallel),
    })
    for layer in model.model.layers:
        parallelize_module(layer, tp_mesh, {
            "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(),
        })
    return model


def _head(loss_parallel: bool, **layouts) -> ColwiseParallel:
    """The head's plan: its output kept split by vocabulary (a DTensor, for ``loss_parallel()``) or
    gathered to the full vocabulary as a plain tensor."""
    if loss_parallel:
        return ColwiseParallel(output_layouts=Shard(-1), use_local_output=False, **layouts)
    return ColwiseParallel(output_layouts=Replicate(), **layouts)
