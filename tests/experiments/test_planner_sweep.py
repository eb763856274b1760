"""The planner sweep's report (experiments/planner_sweep.py): files written, targets stated."""

import csv

from experiments.planner_sweep import run_sweep, summary
from ragged.bench import SweepRow


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
