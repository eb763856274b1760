"""Apply ragged-fsdp to a finished ``Llama`` or ``MoEDecoder``: FSDP bottom-up, as torchtitan does."""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh

from torch_backend.fsdp import GranularityArg, MixedPrecisionPolicy, fully_shard
from torch_backend.models.llama import Llama
from torch_backend.models.moe import MoEDecoder


def parallelize(model: Llama | MoEDecoder, mesh: DeviceMesh, *, reshard_after_forward: bool | None = None,
                mp_policy: MixedPrecisionPolicy | None = None, granularity: GranularityArg = None
                ) -> Llama | MoEDecoder:
    """Shard ``model`` in place: ``tok_embeddings``, each layer, ``[norm, output]``, then the root.

    The units match the core's (``ragged.models.trained_shapes``): the same tensors in the same order under
    the same FQNs, so the layouts equal the JAX backend's for the same granularity. An MoE layer's router and
    experts are in the layer's unit: which experts run depends on each rank's tokens, and the runtime
    keeps a unit's collectives independent of that (an expert sharded alone would not be; see
    docs/fully_shard.md).

    Args:
        model: a ``Llama`` or an ``MoEDecoder`` (built anywhere, the meta device included).
        mesh: a 1-D mesh, or a 2-D ``(replicate, shard)`` mesh for HSDP.
        reshard_after_forward: passed to every ``fully_shard`` call but the root's, which keeps FSDP2's
            default (the root stays unsharded after forward: its backward starts at once).
        mp_policy, granularity: passed to every ``fully_shard`` call.

    Returns:
        ``model``, now an FSDP module.
    """
    kwargs = dict(mesh=mesh, mp_policy=mp_policy, granularity=granularity)
    fully_shard(model.tok_embeddings, reshard_after_forward=reshard_after_forward, **kwargs)
    for layer in model.layers:
        fully_shard(layer, reshard_after_forward=reshard_after_forward, **kwargs)
    fully_shard([model.norm, model.output], reshard_after_forward=reshard_after_forward, **kwargs)
    fully_shard(model, **kwargs)
    return model
