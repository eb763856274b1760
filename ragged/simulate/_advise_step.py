"""The HSDP group size and unit merging that minimise the simulated step time within memory.

``ragged.advise`` ranks options by padding alone; this ranks the same options (FSDP group sizes dividing
N that fill nodes evenly, times merge factors of adjacent decoder layers) by ``simulate``'s step time
for our layout, and recommends the fastest one whose peak memory fits the GPU.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ragged import Granularity, RaggedError
from ragged.advise._advise import merge_layers
from ragged.models import LlamaConfig, ModelShapes, model_units
from ragged.simulate._collectives import group_shape
from ragged.simulate._efficiency import Efficiency
from ragged.simulate._hardware import Hardware
from ragged.simulate._step import StepConfig, simulate


@dataclass(frozen=True)
class StepOption:
    """One HSDP configuration and its simulated step (our layout)."""

    group_size: int
    replicas: int
    merge: int
    padding_ratio: float
    step_s: float
    tokens_per_s_per_gpu: float
    peak_bytes: float
    fits: bool


def advise_step_time(shapes: ModelShapes, c: LlamaConfig, hw: Hardware, gpus: int, *,
                     merge_factors: Iterable[int] = (1, 2, 4), batch_per_device: int = 1, seq_len: int = 4096,
                     granularity: Granularity | int | str = "rows:1", optimizer: str = "adamw",
                     activation_checkpointing: bool = True, efficiency: Efficiency | None = None
                     ) -> tuple[list[StepOption], StepOption | None]:
    """Every option, fastest first, and the fastest one that fits (None when none fits).

    Raises:
        RaggedError: ``gpus`` < 1, or no FSDP group size fills ``hw``'s nodes evenly.
    """
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise RaggedError(f"gpus must be an int >= 1, got {gpus!r}")
    units = model_units(shapes, granularity)
    matrix = str(Granularity.parse(granularity))
    options = []
    for g in (d for d in range(1, gpus + 1) if gpus % d == 0):
        if not _fills_nodes(hw, g, gpus // g):
            continue
        config = StepConfig(gpus, gpus // g, batch_per_device, seq_len, matrix, optimizer=optimizer,
                            activation_checkpointing=activation_checkpointing)
        for k in sorted(set(merge_factors)):
            r = simulate(merge_layers(units, k), c, hw, config, methods=["ours"], efficiency=efficiency,
                         name=shapes.name)[0]
            options.append(StepOption(g, gpus // g, k, r.padding_ratio, r.step_s, r.tokens_per_s_per_gpu,
                                      r.peak_bytes, r.fits(hw)))
    if not options:
        raise RaggedError(f"no FSDP group size divides {gpus} GPUs and fills nodes of {hw.gpus_per_node} "
                          "evenly")
    options.sort(key=lambda o: o.step_s)
    return options, next((o for o in options if o.fits), None)


def _fills_nodes(hw: Hardware, group: int, replicas: int) -> bool:
    try:
        group_shape(hw, group, 1)
        group_shape(hw, replicas, group)
    except RaggedError:
        return False
    return True
