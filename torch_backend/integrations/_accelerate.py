"""Make HF accelerate (and ``transformers.Trainer``, which prepares models through it) shard with ours."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed.fsdp

from torch_backend.fsdp import fully_shard


@contextlib.contextmanager
def use_in_accelerate() -> Iterator[None]:
    """Inside this context, accelerate's FSDP2 path shards with ``torch_backend.fully_shard``.

    accelerate has no option to choose the sharding function: ``accelerate.utils.fsdp_utils.
    fsdp2_prepare_model``, which ``Accelerator.prepare`` runs for ``FullyShardedDataParallelPlugin(
    fsdp_version=2)`` (and so ``Trainer`` with ``fsdp_config={"version": 2}``), imports ``fully_shard`` from
    ``torch.distributed.fsdp`` each time it prepares a model. For the duration of the context that public
    attribute is ours, so accelerate's own wrapping (each ``transformer_layer_cls_to_wrap`` layer, the
    input embedding, the final norm with the head, then the root), its mesh, ``reshard_after_forward``,
    mixed precision and offload policies go to our ``fully_shard`` unchanged; on exit the attribute is
    what it was. Everything else (``isinstance(m, FSDPModule)``, DCP state dicts, gradient clipping over
    DTensors) already works with our modules. Code that imports ``fully_shard`` from
    ``torch.distributed.fsdp`` inside the context gets ours too.

    Example::

        from torch_backend.integrations import use_in_accelerate

        with use_in_accelerate():
            trainer.train()  # Trainer(..., args=TrainingArguments(fsdp="full_shard", fsdp_config={...}))
    """
    previous = torch.distributed.fsdp.fully_shard
    torch.distributed.fsdp.fully_shard = fully_shard
    try:
        yield
    finally:
        torch.distributed.fsdp.fully_shard = previous
