"""Tensor parallelism for the torch ``Llama``, torchtitan's plan: apply it before ``parallelize`` (FSDP).

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
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1) if loss_parallel else
                                  Replicate(), use_local_output=not loss_parallel),
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
