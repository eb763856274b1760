"""Apply ragged-fsdp to a finished ``Llama``: FSDP bottom-up, as torchtitan does with FSDP2."""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh

from torch_backend.fsdp import GranularityArg, MixedPrecisionPolicy, fully_shard
from torch_backend.models.llama import Llama


def parallelize(model: Llama, mesh: DeviceMesh, *, reshard_after_forward: bool | None = None,
                mp_policy: MixedPrecisionPolicy | None = None, granularity: GranularityArg = None) -> Llama:
    """Shard ``model`` in place: ``tok_embeddings``, each layer, ``[norm, output]``, then the root.

    The units match the core preset's (``ragged.models.model_shapes("llama-tiny")``): the same tensors in the
    same order under the same FQNs, so the layouts equal the JAX backend's for the same granularity.

    Args:
        model: a ``Llama`` (built anywhere, the meta device included).
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
