"""The padding sweep: aggregation against per-unit planning, granularity fitting, the written report."""

import csv

import pytest

from ragged import Granularity, TensorSpec, baseline_layouts, model_shapes, plan, run_sweep
from ragged._sweep import SweepRow, fit_granularity, summary, sweep_model, sweep_units


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


def test_run_sweep_writes_csv_png_and_summary(tmp_path):
    rows, paths = run_sweep(["llama-tiny"], [2, 8], ["rows:1", "rows:16"], tmp_path)
    names = sorted(p.name for p in paths)
    assert names == ["planner_sweep.csv", "planner_sweep.md", "planner_sweep_llama-tiny.png"]
    with open(tmp_path / "planner_sweep.csv") as f:
        table = list(csv.DictReader(f))
    assert len(table) == len(rows) == 1 * 2 * 2 * 5
    assert {(r["world_size"], r["granularity"]) for r in table} == {(m, g) for m in ("2", "8")
                                                                    for g in ("rows:1", "rows:16")}
    assert (tmp_path / "planner_sweep_llama-tiny.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (tmp_path / "planner_sweep.md").read_text()
    assert "Against the best baseline that keeps blocks whole" in md and "| llama-tiny | rows:16 |" in md


def _row(model, m, g, ratio, method="ours", **kw):
    return SweepRow(model, m, g, method, int(ratio * 1000), 1000, ratio, ratio, 0, 0, 0, **kw)


def test_summary_states_the_targets():
    rows = [_row("deepseek-v3", 256, "rows:16", 0.05, plan_seconds=0.1, units_worse=2, best_whole_ratio=0.01,
                 best_whole_method="fsdp2"),
            _row("deepseek-v3", 256, "rows:16", 0.04, "megatron"),
            _row("gpt-oss-120b", 8, "rows:1", 0.001, plan_seconds=0.1, units_worse=0),
            _row("gpt-oss-120b", 8, "rows:1", 0.002, "megatron"),
            _row("deepseek-v3", 1024, "rows:1", 0.02, plan_seconds=0.1, units_worse=0, best_whole_ratio=0.5,
                 best_whole_method="megatron")]
    md = summary(rows, {("deepseek-v3", 1024, "rows:1"): 0.5})
    assert "at most 5.00% (deepseek-v3, rows:16, m=256; target <= 3.00%: NOT met)" in md
    assert "At m=1024: deepseek-v3 rows:1 2.00%" in md
    assert ("more padding in 1 of 3 configurations (against fsdp2), by at most 4.00 points (deepseek-v3 "
            "rows:16 m=256: 5.00% vs fsdp2 1.00%); per unit, in 2 unit(s) over 1 configuration(s)") in md
    assert "Against Megatron-style" in md and "more padding in 1 of 3 configurations." in md
    assert "0.500 s (target <= 0.3 s: NOT met)" in md


def test_sweep_units_counts_reduced_tensors():
    units, reduced = sweep_units("mixtral-8x7b", "rows:16")
    assert reduced == 32  # one router [8, 4096] per layer
    router = units[1].tensors[4]
    assert router.name == "layers.0.feed_forward.gate.weight" and router.block == 8 * 4096
