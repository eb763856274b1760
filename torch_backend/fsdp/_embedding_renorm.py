"""``nn.Embedding(max_norm=...)`` inside a unit: the rows every rank's forward uses are renormed."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from torch_backend._collectives import all_reduce
from torch_backend._debug import record_host_sync
from torch_backend.fsdp._hooks import eager
from torch_backend.fsdp._unit import Unit


class EmbeddingRenorm:
    """``nn.Embedding(max_norm=...)`` in a unit renorms, in place, the rows used in any rank's forward.

    The module renorms the rows its own rows of the batch use, in the unsharded weight; single-process
    training renorms every row the whole batch uses. A pre-hook, before the module's forward and so
    before anything reads the weight (a tied head), MAX all-reduces the used-row mask (num_embeddings
    ints) over the unit's ranks and renorms the rows other ranks use and this one does not; the module
    then renorms its own. Every rank holds the single-process weight and keeps its slice of it when
    resharding (a write the version counter shows); no row is renormed twice (that would round
    differently). One small collective and one host read per call: the unit must run on every rank.
    """

    def __init__(self, module: nn.Embedding, unit: Unit) -> None:
        self.module = module
        self.unit = unit
        module.register_forward_pre_hook(eager(self._sync))

    @torch.no_grad()
    def _sync(self, module: nn.Embedding, args: tuple) -> None:
        unit = self.unit
        used = torch.zeros(module.num_embeddings, dtype=torch.int32, device=unit.device)
        used[args[0].reshape(-1).to(unit.device)] = 1
        union = used.clone()
        for group in (unit.shard_group, unit.replicate_group):
            if group is not None:
                all_reduce(union, group, label=f"max_norm rows of {unit.name}", op=dist.ReduceOp.MAX).wait()
        record_host_sync(f"max_norm rows of {unit.name}")
        rows = ((union > 0) & (used == 0)).nonzero().squeeze(1)
        if rows.numel():
            weight = module.weight
            torch.embedding_renorm_(weight, rows.to(weight.device), module.max_norm, module.norm_type)
