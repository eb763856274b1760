"""Expert parallelism (EP) for the flax ``MoEDecoder``, composed with ragged FSDP (torchtitan's arrangement).

On a mesh ``(replica?, ep, fsdp)``, EP rank ``i`` (its ``ep`` index) keeps experts ``[i E/ep, (i+1) E/ep)`` of
every MoE layer: one FSDP unit per layer, sharded over the rank's ``fsdp`` devices; every other
parameter is sharded over all ``ep * fsdp`` devices, and ``replica`` (HSDP) replicates both. The core
plans every buffer (``ragged.models.plan_expert_parallel``: one EP rank's experts planned over ``fsdp``,
composed side by side over ``ep x fsdp``), so each device holds one shard of every unit and the step
gathers an experts unit over ``fsdp`` alone.

Token routing, per MoE layer, inside the step's ``shard_map`` and whatever the data: each device numbers
its ``N k`` (token, expert) assignments per expert in token order and writes assignment number ``c`` of
expert ``e`` into row ``c`` of a ``(E, C, dim)`` send buffer; assignments numbered ``C`` or more are dropped
(their expert adds nothing to the token) and counted. One ``all_to_all`` over ``ep`` hands each EP rank the
rows of its experts from every EP rank, the experts unit runs on them (``(E/ep, ep C, dim)``: each expert
on its own rows, empty rows included), and the reverse ``all_to_all`` brings the outputs back, where each
token adds its experts' outputs weighted by the router. Shapes are static (``ragged_all_to_all``, which
would send only the rows in use, has no CPU implementation). ``capacity_factor=None`` sets ``C = N``: a
token chooses an expert at most once, so nothing is dropped; a factor ``f`` sets
``C = min(N, ceil(f N k / E))`` (``f = 1``: an expert's fair share) and drops the rest.

Gradients: the step divides each device's loss by the number of data-parallel devices, and an expert's
gradient on EP rank ``i`` sums the tokens of every EP rank sent to it; the reduce-scatter over ``fsdp`` and
the all-reduce over ``replica`` then complete the sum over every device, so it is the mean over all tokens
with no EP-specific scale (torch's ``1/ep`` corrects an average over ``fsdp`` ranks, which this step does
not take).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import Mesh

import ragged
from jax_backend._buffers import LayoutMismatchError, check_mesh
from jax_backend._model import _unit_tensors
from jax_backend._names import fqn
from jax_backend._nnx_model import NnxModel
from jax_backend._step import FSDP
from jax_backend._units import MixedPrecisionPolicy
from jax_backend.models.moe import MoE, MoEDecoder, load_balancing_loss
from ragged import Granularity, GranularityRule
from ragged.models import ExpertParallelUnit, plan_expert_parallel


class DroppedAssignments(nnx.Variable):
    """(token, expert) assignments this device dropped in the MoE layer's last forward (over capacity)."""


class ExpertParallelMoE(nnx.Module):
    """The ``MoE`` of one layer with this EP rank's ``E/ep`` experts and all-to-all dispatch (module doc).

    Runs only inside a ``shard_map`` with the ``ep`` axis (the FSDP step). Its parameters keep the MoE's
    names; the experts keep their local index (``experts.0`` is expert ``i E/ep`` on EP rank ``i``).
    """

    def __init__(self, moe: MoE, ep: int, capacity_factor: float | None, axis: str):
        n_experts = moe.router.weight.shape[0]
        self.router, self.shared_expert = moe.router, moe.shared_expert
        self.experts = _first_experts(moe.experts, n_experts // ep)
        self.n_experts, self.ep, self.capacity_factor, self.axis = n_experts, ep, capacity_factor, axis
        self.dropped = DroppedAssignments(jnp.zeros((), jnp.int32))

    def capacity(self, n_tokens: int) -> int:
        """Rows per (source device, expert) for ``n_tokens`` tokens on the device."""
        if self.capacity_factor is None:
            return n_tokens
        k = self.router.top_k
        return max(1, min(n_tokens, math.ceil(self.capacity_factor * n_tokens * k / self.n_experts)))

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        b, t, d = x.shape
        n, e, ep = b * t, self.n_experts, self.ep
        tokens = x.reshape(n, d)  # (N, dim)
        weights, chosen, probs = self.router(tokens)  # (N, k), (N, k), (N, E)
        k, cap = chosen.shape[1], self.capacity(n)
        expert = chosen.reshape(n * k)  # (N k,) token-major, as numbered
        one_hot = jax.nn.one_hot(expert, e, dtype=jnp.int32)  # (N k, E)
        slot = jnp.sum((jnp.cumsum(one_hot, axis=0) - 1) * one_hot, axis=1)  # (N k,) number within expert
        self.dropped[...] = jnp.sum(slot >= cap, dtype=jnp.int32)
        rows = tokens[jnp.repeat(jnp.arange(n), k)]  # (N k, dim)
        send = jnp.zeros((e, cap, d), x.dtype).at[expert, slot].set(rows, mode="drop")  # slot >= C: dropped
        # (ep, E/ep, C, dim): block i goes to EP rank i, which receives one block per source rank
        recv = lax.all_to_all(send.reshape(ep, e // ep, cap, d), self.axis, 0, 0)
        outputs = self.experts(recv.transpose(1, 0, 2, 3).reshape(e // ep, ep * cap, d))  # (E/ep, ep C, dim)
        back = lax.all_to_all(outputs.reshape(e // ep, ep, cap, d).transpose(1, 0, 2, 3), self.axis, 0, 0)
        y = back.reshape(e, cap, d).at[expert, slot].get(mode="fill", fill_value=0)  # (N k, dim)
        out = jnp.sum(weights.reshape(n, k, 1).astype(y.dtype) * y.reshape(n, k, d), axis=1)
        if self.shared_expert is not None:
            out = out + self.shared_expert(tokens)
        return out.reshape(b, t, d), load_balancing_loss(probs, chosen)


def _first_experts(experts: nnx.Module, n_local: int) -> nnx.Module:
    """A copy of ``experts`` (``ExpertList`` or ``FusedExperts``) with its first ``n_local`` experts: the
    structure of one EP rank's share (the step fills in each rank's own values from its buffers)."""
    local = nnx.clone(experts)
    if isinstance(local, nnx.List):
        del local[n_local:]
    else:
        for name, param in list(vars(local).items()):
            if isinstance(param, nnx.Param):
                setattr(local, name, nnx.Param(param[...][:n_local]))
    return local


def expert_parallel(model: MoEDecoder, ep: int, *, capacity_factor: float | None = None,
                    axis: str = "ep") -> MoEDecoder:
    """A copy of ``model`` whose MoE layers are ``ExpertParallelMoE``s with ``E/ep`` experts each.

    Raises:
        ValueError: ``ep`` does not divide the number of experts, or a capacity factor that is not positive.
    """
    c = model.config
    if ep < 1 or c.n_experts % ep:
        raise ValueError(f"expert_parallel: ep={ep} must divide the {c.n_experts} experts of each MoE layer")
    if capacity_factor is not None and not capacity_factor > 0:
        raise ValueError(f"expert_parallel: capacity_factor={capacity_factor} must be positive (None: no "
                         "drops)")
    out = nnx.clone(model)
    for layer in out.layers:
        if isinstance(layer.feed_forward, MoE):
            layer.feed_forward = ExpertParallelMoE(layer.feed_forward, ep, capacity_factor, axis)
    return out


@dataclass(frozen=True)
class ExpertParallel:
    """An MoE decoder's FSDP runtime under EP (``parallelize_moe``), with conversions from the full model.

    ``fsdp`` runs the step (``fsdp.init``, ``fsdp.train_step``; the step takes and returns the model state,
    which holds each device's ``DroppedAssignments`` per MoE layer); ``experts`` are the core's plans of
    the MoE layers' experts; ``model`` is the EP model the step runs (``expert_parallel``).
    """

    fsdp: FSDP
    experts: tuple[ExpertParallelUnit, ...]
    model: MoEDecoder

    def shard_params(self, params: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        """The full model's ``{fqn: array}`` (every expert) -> ``{unit: buffer}`` on the mesh."""
        sources = {src.fqn for unit in self.experts for src in unit.sources}
        composed = {k: v for k, v in params.items() if k not in sources}
        for unit in self.experts:
            for slot, src in zip(unit.layout.tensors, unit.sources):
                composed[slot.name] = params[src.fqn] if src.lo is None else params[src.fqn][src.lo:src.hi]
        return self.fsdp.shard_params(composed)

    def full_params(self, buffers: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        """``{unit: buffer}`` -> the full model's ``{fqn: array}`` (fused experts' rows joined)."""
        out = self.fsdp.full_params(buffers)
        for unit in self.experts:
            rows: dict[str, list[jax.Array]] = {}
            for slot, src in zip(unit.layout.tensors, unit.sources):
                value = out.pop(slot.name)
                rows.setdefault(src.fqn, []).append(value)
            out.update({name: parts[0] if len(parts) == 1 else jnp.concatenate(parts)
                        for name, parts in rows.items()})
        return out

    def init_model_state(self) -> nnx.State:
        """The step's model state (every MoE layer's drop count, one per data-parallel device)."""
        return self.fsdp.shard_model_state(self.model)

    @staticmethod
    def dropped(model_state: nnx.State) -> dict[str, np.ndarray]:
        """``{MoE layer's counter: assignments each data-parallel device dropped in the last step}``."""
        leaves = jax.tree_util.tree_flatten_with_path(model_state)[0]
        return {fqn(p): np.asarray(v) for p, v in leaves}


def parallelize_moe(model: MoEDecoder, mesh: Mesh, *, ep_axis: str = "ep", axis: str = "fsdp",
                    replica_axis: str | None = None, capacity_factor: float | None = None,
                    granularity: GranularityRule | Granularity | int | str = "rows:1",
                    mp_policy: MixedPrecisionPolicy | None = None, reshard_after_forward: bool = True
                    ) -> ExpertParallel:
    """EP over ``ep_axis`` composed with ragged FSDP over ``(ep_axis, axis)``, HSDP over ``replica_axis``.

    Units: the embedding, each layer's attention, each MoE layer's experts (sharded over ``axis`` only);
    everything else (norms, routers, shared experts, dense feed-forwards, the head) is the root unit.
    ``reshard_after_forward`` is ``shard_model``'s (default True, as there: every unit but the root is
    re-gathered in its backward; kept gathered, `experiments/moe_vs_fsdp2.py --part jax` held 1.00 to 1.09x
    GSPMD's temporary memory, resharded 0.83 to 0.87x).

    Example:
        >>> mesh = make_mesh((2, 4), ("ep", "fsdp"))
        >>> ep = parallelize_moe(MoEDecoder(MOE_CONFIGS["mixtral-tiny"], rngs=nnx.Rngs(0)), mesh)
        >>> buffers, state = ep.shard_params(model_params(model)), ep.init_model_state()
        >>> step = ep.fsdp.train_step(optax.adamw(1e-3), loss_fn)
        >>> buffers, opt_state, loss, state = step(buffers, opt_state, x, y, state)
        >>> ep.dropped(state)  # {layer: dropped assignments}: 0 when capacity_factor is None

    Raises:
        LayoutMismatchError: the mesh lacks an axis; ValueError: ``ep`` does not divide the experts.
    """
    check_mesh(mesh, (), (ep_axis, axis), replica_axis)
    c, ep, fsdp = model.config, mesh.shape[ep_axis], mesh.shape[axis]
    local_model = expert_parallel(model, ep, capacity_factor=capacity_factor, axis=ep_axis)
    wrapped = NnxModel(local_model, ["tok_embeddings", "layers.*.attention", "layers.*.feed_forward.experts"],
                       "root")
    itemsize = max(jnp.dtype(dt).itemsize for _, dt in wrapped.shapes.values())
    experts = plan_expert_parallel(c, ep, fsdp, granularity, itemsize=itemsize)
    by_name = {u.name: u for u in experts}
    tensors = _unit_tensors(wrapped, None)  # no tensor axis under expert parallelism
    for unit, local in [(by_name[u], t) for u, t in tensors if u in by_name]:
        if sorted(local) != sorted((s.name, s.shape) for s in unit.local.tensors):
            raise LayoutMismatchError(f"{unit.name}: the model's experts {sorted(local)[:2]} ... differ from "
                                      f"the core's plan {[s.name for s in unit.local.tensors[:2]]} ...")
    planned = iter(ragged.plan_model([(u, t) for u, t in tensors if u not in by_name], ep * fsdp, granularity,
                                     itemsize=itemsize))
    layouts = [by_name[u].layout if u in by_name else next(planned) for u, _ in tensors]
    fsdp_runtime = FSDP(mesh, tuple(layouts), wrapped, axis=(ep_axis, axis), replica_axis=replica_axis,
                        mp_policy=mp_policy or MixedPrecisionPolicy(),
                        expert_layouts={u.name: u.local for u in experts}, expert_axis=axis,
                        reshard_after_forward=reshard_after_forward)
    return ExpertParallel(fsdp_runtime, experts, local_model)
