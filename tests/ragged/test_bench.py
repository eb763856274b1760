"""The padding sweep: aggregation against per-unit planning, granularity fitting."""

import pytest

from ragged import Granularity, TensorSpec, plan
from ragged.bench import baseline_layouts
from ragged.bench._sweep import fit_granularity, sweep_model, sweep_units
from ragged.models import model_shapes


@pytest.mark.parametrize("shape, wanted, expect", [
    ((576, 7168), "rows:128", "rows:64"),        # deepseek-v3 kv_a_proj: 576 = 64 * 9
    ((128, 5760), "rows:128", "rows:128"),       # divides: unchanged
    ((8, 4096), "rows:16", "rows:8"),            # mixtral router
    ((96, 48), "tiles:32x32", "tiles:32x16"),    # last dim 48: tile width gcd(32, 48) = 16
    ((4, 8, 6), "rows:64", "rows:32"),           # 2-D view has 32 rows
    ((10,), "element", "element"),
])
def test_fit_granularity(shape, wanted, expect):
    fitted = fit_granularity(shape, Granularity.parse(wanted))
    assert str(fitted) == expect
    TensorSpec("t", shape, fitted)  # it divides


def test_sweep_model_sums_every_unit():
    # Every unit planned on its own (no dedupe), summed by hand, must match the deduplicated sweep.
    rows = {r.method: r for r in sweep_model("llama-tiny", 4, "rows:16")}
    assert list(rows) == ["ours", "fsdp1", "fsdp2", "zero3", "megatron"]
    padding = buffer = 0
    base = {k: [0, 0, 0] for k in ("fsdp1", "fsdp2", "zero3", "megatron")}
    worst = 0.0
    for u in model_shapes("llama-tiny").units:
        specs = [TensorSpec(n, s, "rows:16" if len(s) >= 2 else "element") for n, s in u.tensors]
        layout = plan(specs, 4)
        padding += layout.padding
        buffer += 4 * layout.shard_size
        worst = max(worst, layout.padding / (4 * layout.shard_size))
        for b in baseline_layouts(specs, 4, align=layout.align):
            base[b.method][0] += b.padding
            base[b.method][1] += 4 * b.shard_size
            base[b.method][2] += b.split_blocks
    ours = rows["ours"]
    assert (ours.padding, ours.buffer_numel, ours.split_blocks) == (padding, buffer, 0)
    assert ours.padding_ratio == pytest.approx(padding / buffer)
    assert ours.worst_unit_ratio == pytest.approx(worst)
    assert ours.allgather_bytes == 3 * buffer // 4 * 4  # (m - 1) shards of S, 4-byte elements
    for k, (p, t, split) in base.items():
        assert (rows[k].padding, rows[k].buffer_numel, rows[k].split_blocks) == (p, t, split)
    whole = [(rows[k].padding_ratio, k) for k in base if rows[k].split_blocks == 0]  # Megatron never cuts
    assert (ours.best_whole_ratio, ours.best_whole_method) == min(whole, key=lambda w: w[0])


def test_sweep_units_counts_reduced_tensors():
    units, reduced = sweep_units("mixtral-8x7b", "rows:16")
    assert reduced == 32  # one router [8, 4096] per layer
    router = units[1].tensors[4]
    assert router.name == "layers.0.feed_forward.gate.weight" and router.block == 8 * 4096
