"""What both halves of ``experiments/muon_bench.py`` optimize: a small llama's decoder-layer matrices,
one FSDP unit per layer, every matrix planned in whole rows (``rows:1``)."""

from __future__ import annotations

import ragged
import ragged.models

CONFIG = ragged.models.LlamaConfig(vocab_size=256, dim=192, n_layers=4, n_heads=6, n_kv_heads=2, head_dim=32,
                            ffn_dim=512)
LR, MOMENTUM = 0.02, 0.95


def matrices() -> list[tuple[str, tuple[int, int]]]:
    """The 2-D tensors of CONFIG's decoder layers (the ones Muon orthogonalizes)."""
    shapes = ragged.models.llama_shapes("bench", CONFIG)
    return [(n, s) for u in shapes.units if u.name.startswith("layers.") for n, s in u.tensors if len(s) == 2]


def layouts(world_size: int) -> tuple[ragged.Layout, ...]:
    """One planned unit per decoder layer (the matrices of ``layers.i``)."""
    units: dict[str, list[ragged.TensorSpec]] = {}
    for n, s in matrices():
        units.setdefault(n.rsplit(".", 3)[0], []).append(ragged.TensorSpec(n, s, "rows:1"))
    return tuple(ragged.plan(specs, world_size, name=u) for u, specs in units.items())
