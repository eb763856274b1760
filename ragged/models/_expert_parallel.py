"""Expert parallelism (EP) composed with ragged FSDP: each EP rank's experts as one planned unit.

The data-parallel devices form an ``ep x fsdp`` grid; device ``(i, j)`` is device ``i * fsdp + j`` of the
combined axis. EP rank ``i`` keeps experts ``[i E/ep, (i+1) E/ep)`` of every MoE layer. Those experts form
one FSDP unit per MoE layer, sharded over the ``fsdp`` devices of the rank (torchtitan's EP + FSDP
arrangement; every other unit is sharded over all ``ep * fsdp`` devices).

The plan: one EP rank's experts (``E/ep`` of them, under the names the EP model gives them: ``experts.0``
.. , or fused tensors of ``E/ep`` rows) are planned once over ``fsdp`` devices (``local``, an ordinary
``Layout``: no block cut, every tensor contiguous). Every EP rank lays its experts out the same way, and
the composed ``layout`` puts EP rank ``i``'s buffer at shards ``[i fsdp, (i+1) fsdp)`` of one buffer over
all ``ep * fsdp`` devices: each device holds one shard of ``S`` elements, as for every other unit, and
gathering over ``fsdp`` alone rebuilds its EP rank's buffer. The composed layout names each tensor after
what it holds in the full model: ``experts.{g}.w1.weight`` (global expert ``g``) for per-expert modules,
``experts.gate_up_proj[lo:hi]`` (rows ``lo`` to ``hi`` of the fused tensor) for fused ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from ragged._errors import PlanningError
from ragged._granularity import Granularity
from ragged._layout import Layout, TensorSlot
from ragged._model_plan import GranularityRule, plan_model
from ragged.models._moe import MoeConfig, expert_shapes


class ExpertSource(NamedTuple):
    """What a tensor of a composed expert layout holds: ``fqn[lo:hi]`` of the full model (dim 0), or the
    whole ``fqn`` when ``lo`` is None."""

    fqn: str
    lo: int | None = None
    hi: int | None = None


@dataclass(frozen=True)
class ExpertParallelUnit:
    """One MoE layer's experts under EP: the EP rank's plan and its composition over ``ep x fsdp``.

    Attributes:
        local: one EP rank's experts over its ``fsdp`` devices, under the EP model's (local) names.
        layout: ``ep`` copies of ``local`` side by side, over ``ep * fsdp`` devices, under full-model names.
        ep: the EP degree.
        sources: for each tensor of ``layout`` (same order), the full-model tensor (rows) it holds.
    """

    local: Layout
    layout: Layout
    ep: int
    sources: tuple[ExpertSource, ...]

    @property
    def name(self) -> str:
        return self.layout.name


def _sources(prefix: str, c: MoeConfig, ep_rank: int, n_local: int) -> list[ExpertSource]:
    """The full-model tensors (rows) EP rank ``ep_rank``'s local expert tensors hold, in local order."""
    lo = ep_rank * n_local
    if c.experts == "fused":
        return [ExpertSource(fqn, lo, lo + n_local) for fqn, _ in expert_shapes(prefix, c, c.n_experts)]
    return [ExpertSource(fqn) for fqn, _ in expert_shapes(prefix, c, c.n_experts)[3 * lo:3 * (lo + n_local)]]


def compose_over_ep(local: Layout, names: Sequence[Sequence[str]], name: str) -> Layout:
    """``len(names)`` copies of ``local`` side by side, copy ``i`` named ``names[i]``: a Layout over
    ``len(names) * local.world_size`` devices whose copy ``i`` fills shards ``[i m, (i+1) m)``."""
    tensors = [TensorSlot(n, t.shape, t.block, i * local.total_numel + t.offset)
               for i, rank_names in enumerate(names) for n, t in zip(rank_names, local.tensors, strict=True)]
    return Layout(len(names) * local.world_size, local.shard_size, tuple(tensors), local.align, name)


def _composed_name(s: ExpertSource) -> str:
    return s.fqn if s.lo is None else f"{s.fqn}[{s.lo}:{s.hi}]"


def plan_expert_parallel(c: MoeConfig, ep: int, fsdp: int,
                         granularity: Granularity | int | str | GranularityRule = "rows:1", *,
                         itemsize: int = 4) -> tuple[ExpertParallelUnit, ...]:
    """Plan the experts of every MoE layer of ``c`` for EP degree ``ep`` over ``fsdp`` devices per EP rank.

    Each unit is named ``layers.{L}.feed_forward.experts``; its local tensors are ``expert_shapes`` of
    ``E/ep`` experts under that prefix. The MoE layers' experts have equal shapes, so one plan serves all.

    Example:
        >>> units = plan_expert_parallel(MOE_CONFIGS["mixtral-tiny"], ep=2, fsdp=4)
        >>> units[0].layout.world_size, units[0].layout.tensors[12].name
        (8, 'layers.0.feed_forward.experts.4.w1.weight')

    Raises:
        PlanningError: ``ep`` or ``fsdp`` below 1, or ``ep`` not dividing the number of experts.
    """
    if ep < 1 or fsdp < 1 or c.n_experts % ep:
        raise PlanningError(f"plan_expert_parallel: ep={ep} must divide the {c.n_experts} experts of each "
                            f"MoE layer, with fsdp={fsdp} >= 1 devices per EP rank")
    n_local = c.n_experts // ep
    prefixes = [f"layers.{i}.feed_forward.experts" for i in range(c.n_layers) if c.is_moe(i)]
    locals_ = plan_model([(p, expert_shapes(p, c, n_local)) for p in prefixes], fsdp, granularity,
                         itemsize=itemsize)
    units = []
    for p, local in zip(prefixes, locals_):
        per_rank = [_sources(p, c, i, n_local) for i in range(ep)]
        layout = compose_over_ep(local, [[_composed_name(s) for s in rank] for rank in per_rank], p)
        units.append(ExpertParallelUnit(local, layout, ep, tuple(s for rank in per_rank for s in rank)))
    return tuple(units)
