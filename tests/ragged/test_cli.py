"""The ``ragged`` command, run in process through ``ragged.cli.main`` (plus one installed-script check)."""

import json
import math
import os
import re
import shutil
import subprocess
import sys
from dataclasses import asdict

import pytest

from ragged import Layout
from ragged.bench import padding_sweep
from ragged.cli import main
from ragged.models import LLAMA_TINY, llama_tp_shapes, memory_plan, model_shapes, trained_model


def _check_unit_json(unit, world_size):
    """An independent check of one unit's JSON layout: the paper's constraints, element by element."""
    s = unit["shard_size"]
    assert s >= 1 and s % unit["align"] == 0
    owner_end = 0
    for t in sorted(unit["tensors"], key=lambda t: t["offset"]):
        numel, block, off = t["numel"], t["block"], t["offset"]
        assert numel == math.prod(t["shape"]) and numel % block == 0
        assert off >= owner_end and off + numel <= world_size * s and off % unit["align"] == 0
        owner_end = off + numel
        # local_units[d] = blocks of this tensor inside device d's shard; every block on one device.
        held = [max(0, min((d + 1) * s, off + numel) - max(d * s, off)) for d in range(world_size)]
        assert all(h % block == 0 for h in held)
        if numel:
            assert t["local_units"] == [h // block for h in held]


def test_plan_model_json_schema_and_layout(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "llama-tiny", "--world-size", "3", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert set(data) == {"world_size", "units"} and data["world_size"] == 3
    preset = model_shapes("llama-tiny")
    assert [u["name"] for u in data["units"]] == [u.name for u in preset.units]
    for unit, shapes in zip(data["units"], preset.units):
        assert {"name", "shard_size", "tensors"} <= set(unit)
        assert [(t["name"], tuple(t["shape"])) for t in unit["tensors"]] == list(shapes.tensors)
        for t in unit["tensors"]:
            assert {"name", "shape", "numel", "block", "offset", "local_units"} <= set(t)
            # Default rule: whole rows of matrices, element-wise 1-D tensors.
            assert t["block"] == (t["shape"][-1] if len(t["shape"]) >= 2 else 1)
        _check_unit_json(unit, 3)
        assert Layout.from_dict(unit, world_size=3).shard_size == unit["shard_size"]  # docs/cli.md's recipe
    table = capsys.readouterr().out
    assert "total" in table and "fsdp2" in table and "megatron" in table and "layers.3" in table


def test_plan_table_figures(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "llama-tiny", "--world-size", "3", "--json", str(out)]) == 0
    rows = {line.split()[1]: line for line in capsys.readouterr().out.splitlines() if line.startswith("│")}
    for unit in json.loads(out.read_text())["units"]:  # our S and padding, recomputed from the layout
        buffer = 3 * unit["shard_size"]
        padding = (buffer - sum(t["numel"] for t in unit["tensors"])) / buffer
        row = rows[unit["name"]]
        assert f"{unit['shard_size']:,}" in row and f"{100 * padding:.2f}%" in row
    # Embedding [256, 64] on 3 devices, closed forms: FSDP2 pads dim 0 to 258 rows (2/258 = 0.78%);
    # FSDP1 pads 16384 to 3 x 5464 (8 elements, 0.05%) and cuts the rows at 5464 and 10928 (2 blocks).
    cells = [c.strip() for c in rows["tok_embeddings"].split("│")]
    assert cells[6:8] == ["0.05% (2 cut)", "0.78%"]
    assert "= layers.0" in rows["layers.3"]  # repeated layers are planned once


def test_plan_shapes_file_granularity_rules(tmp_path):
    shapes = {"units": [{"name": "block", "tensors": [
        {"name": "w", "shape": [32, 8]},                              # command line's rows:4 -> 32
        {"name": "experts", "shape": [4, 8, 6], "granularity": "rows:8"},  # its own value wins -> 48
        {"name": "bias", "shape": [10]},                              # 1-D stays element-wise -> 1
        {"name": "scale", "shape": [12], "granularity": "whole"},      # unless it says otherwise -> 12
    ]}]}
    src, out = tmp_path / "shapes.json", tmp_path / "out.json"
    src.write_text(json.dumps(shapes))
    assert main(["plan", "--shapes", str(src), "--world-size", "4", "--granularity", "rows:4",
                 "--json", str(out)]) == 0
    unit = json.loads(out.read_text())["units"][0]
    assert [t["block"] for t in unit["tensors"]] == [32, 48, 1, 12]
    _check_unit_json(unit, 4)


def test_plan_json_to_stdout_only(capsys):
    assert main(["plan", "--model", "llama-tiny", "--world-size", "2", "--json", "-"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["world_size"] == 2 and len(data["units"]) == 6


def _write(tmp_path, text):
    p = tmp_path / "bad.json"
    p.write_text(text)
    return str(p)


@pytest.mark.parametrize("args, message", [
    (["--model", "gpt-5", "--world-size", "8"], "unknown model 'gpt-5'"),
    (["--model", "llama-tiny", "--world-size", "0"], "--world-size must be >= 1, got 0"),
    (["--model", "llama-tiny", "--world-size", "8", "--granularity", "rows:x"], "granularity 'rows:x'"),
    (["--model", "llama-tiny", "--world-size", "8", "--granularity", "rows:3"],
     "tok_embeddings.weight: granularity rows:3 does not divide"),
    (["--shapes", "/nonexistent/shapes.json", "--world-size", "8"], "cannot read it"),
])
def test_plan_bad_input_exit_2_one_line(args, message, capsys):
    assert main(["plan", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ragged: error: ") and message in err
    assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("text, message", [
    ("{not json", "not valid JSON"),
    ('{"unit": []}', "missing 'units'"),
    ('{"units": []}', "'units' is empty"),
    ('{"units": [{"name": "u", "tensors": [{"name": "w", "shape": [4, -1]}]}]}',
     "units[0].tensors[0] (w): 'shape' must be a list of non-negative ints"),
    ('{"units": [{"name": "u", "tensors": [{"name": "w", "shape": "4x4"}]}]}', "'shape' must be a list"),
    ('{"units": [{"name": "u", "tensors": [{"shape": [4]}]}]}', "units[0].tensors[0]: missing 'name'"),
    ('{"units": [{"name": "u", "tensors": [{"name": "w", "shape": [6, 4], "granularity": "rows:4"}]}]}',
     "w: granularity rows:4 does not divide the tensor"),
    ('{"units": [{"name": "u", "tensors": [{"name": "w", "shape": [6], "granularity": "tiles"}]}]}',
     "granularity 'tiles' is not one of"),
])
def test_malformed_shapes_file(tmp_path, text, message, capsys):
    assert main(["plan", "--shapes", _write(tmp_path, text), "--world-size", "2"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_argparse_errors_exit_2(capsys):
    assert main(["plan", "--model", "llama-tiny"]) == 2  # --world-size missing
    assert main(["plan", "--model", "llama-tiny", "--shapes", "x.json", "--world-size", "2"]) == 2
    assert main(["nope"]) == 2
    assert "--world-size" in capsys.readouterr().err


def test_advise_json(capsys):
    assert main(["advise", "--model", "llama-tiny", "--gpus", "4", "--max-padding", "1%", "--all-groups",
                 "--json", "-"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["gpus"] == 4 and data["max_padding"] == 0.01
    tried = {(o["group_size"], o["merge"]) for o in data["options"]}
    assert tried == {(g, k) for g in (4, 2, 1) for k in (1, 2, 4)}
    assert data["recommended"] in data["options"]


def test_advise_table_and_errors(capsys):
    assert main(["advise", "--model", "llama-tiny", "--gpus", "2", "--merge-factors", "1"]) == 0
    out = capsys.readouterr().out
    assert "recommended: FSDP group of" in out and "all-gather/device/step" in out
    assert main(["advise", "--model", "llama-tiny", "--gpus", "2", "--max-padding", "150%"]) == 2
    assert "--max-padding" in capsys.readouterr().err
    assert main(["advise", "--model", "llama-tiny", "--gpus", "0"]) == 2
    assert main(["advise", "--model", "llama-tiny", "--gpus", "2", "--merge-factors", "0"]) == 2


def test_sweep_bad_options(capsys):
    assert main(["sweep", "--models", "llama-huge"]) == 2
    assert main(["sweep", "--models", "llama-tiny", "--world-sizes", "8,x"]) == 2
    err = capsys.readouterr().err
    assert "unknown model(s) ['llama-huge']" in err and "'x' is not an int >= 1" in err


def test_console_script_installed():
    script = shutil.which("ragged", path=os.path.dirname(sys.executable))
    assert script is not None, "the ragged console script is not installed next to this Python"
    ok = subprocess.run([script, "plan", "--model", "llama-tiny", "--world-size", "2", "--json", "-"],
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and json.loads(ok.stdout)["world_size"] == 2
    bad = subprocess.run([script, "plan", "--model", "nope", "--world-size", "2"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.startswith("ragged: error: unknown model 'nope'")


def test_sweep_json_rows_equal_padding_sweep(capsys):
    assert main(["sweep", "--models", "llama-tiny", "--world-sizes", "2,8", "--granularities", "rows:16",
                 "--json", "-"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    want = padding_sweep(["llama-tiny"], [2, 8], ["rows:16"])
    strip = lambda r: {k: v for k, v in r.items() if k != "plan_seconds"}  # noqa: E731 (timing differs)
    assert [strip(r) for r in rows] == [strip(asdict(r)) for r in want]


def test_plan_with_tp_plans_each_tp_ranks_tensors(capsys):
    assert main(["plan", "--model", "llama-tiny", "--world-size", "2", "--tp", "2", "--json", "-"]) == 0
    data = json.loads(capsys.readouterr().out)
    local = llama_tp_shapes("llama-tiny", 2)
    for unit, shapes in zip(data["units"], local.units):
        assert [(t["name"], tuple(t["shape"])) for t in unit["tensors"]] == list(shapes.tensors)
        _check_unit_json(unit, 2)
    assert main(["plan", "--model", "llama-tiny", "--world-size", "2", "--tp", "2"]) == 0
    assert "llama-tiny (TP 2: each TP rank's tensors): m=2" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--model", "llama-tiny", "--tp", "4"], "TP 4 must divide n_kv_heads=2"),
    (["--model", "deepseek-v3", "--tp", "2"], "llama presets"),
    (["--shapes", "s.json", "--tp", "2"], "a shapes file gives each TP rank's local shapes itself"),
    (["--model", "llama-tiny", "--tp", "0"], "--tp must be >= 1"),
])
def test_plan_tp_errors(args, message, capsys):
    assert main(["plan", "--world-size", "2", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_advise_with_tp(capsys):
    assert main(["advise", "--model", "llama-tiny", "--gpus", "8", "--tp", "2", "--all-groups", "--json",
                 "-"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["tp"] == 2 and {o["group_size"] for o in data["options"]} == {4, 2, 1}
    assert main(["advise", "--model", "llama-tiny", "--gpus", "8", "--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert "= TP 2 x 4 data-parallel" in out and "x TP 2, 1 layer(s) per unit" in out
    assert main(["advise", "--model", "llama-tiny", "--gpus", "8", "--tp", "2", "--hardware", "h800"]) == 2
    assert "drop --tp" in capsys.readouterr().err


def test_memory_one_degree_prints_the_memory_plan(capsys):
    assert main(["memory", "--model", "llama3-70b", "--gpus", "64", "--tp", "8", "--batch", "8",
                 "--seq-len", "8192", "--activation-checkpointing"]) == 0
    out = capsys.readouterr().out
    c, _ = trained_model("llama3-70b")
    plan = memory_plan("llama3-70b", c, 64, tp=8, batch_per_device=1, seq_len=8192,
                       activation_checkpointing=True)
    assert plan.describe() in out and "\nfits in 80 GiB" in out


def test_memory_compares_tp_degrees_at_one_global_batch(capsys):
    args = ["memory", "--model", "llama-tiny", "--gpus", "4", "--tp", "1,2", "--batch", "8",
            "--seq-len", "64"]
    assert main([*args, "--json", "-"]) == 0
    data = json.loads(capsys.readouterr().out)
    for p, tp in zip(data["plans"], (1, 2)):  # 8 sequences over 4 / tp data-parallel ranks
        ref = memory_plan("llama-tiny", LLAMA_TINY, 4, tp=tp, batch_per_device=8 // (4 // tp), seq_len=64)
        assert p["tp"] == tp and p["total"] == ref.total and p["fits"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "TP 1 (1 x 4)" in out and "TP 2 (1 x 2)" in out
    assert "smallest TP degree that fits in 80 GiB: 1" in out
    assert main([*args, "--memory-gib", "0.001"]) == 0
    assert "no TP degree fits in 0.001 GiB" in capsys.readouterr().out


def test_memory_counts_the_logits_gathered_without_loss_parallel(capsys):
    args = ["memory", "--model", "llama-tiny", "--gpus", "4", "--tp", "1,2", "--batch", "8",
            "--seq-len", "64"]
    found = {}
    for flag in ([], ["--no-loss-parallel"]):
        assert main([*args, *flag, "--json", "-"]) == 0
        found[bool(flag)] = json.loads(capsys.readouterr().out)["plans"]
    split, gathered = found[False], found[True]
    assert [p["loss_parallel"] for p in split + gathered] == [True, True, False, False]
    assert gathered[0]["logits"] == split[0]["logits"]  # TP 1: nothing to split
    assert gathered[1]["logits"] == 2 * split[1]["logits"]  # TP 2: the full vocabulary on both TP ranks
    assert gathered[1]["total"] - split[1]["total"] == split[1]["logits"]
    assert main([*args, "--no-loss-parallel"]) == 0
    assert re.search(r"loss parallel \(logits vocab / TP\) +│ +- │ +off │", capsys.readouterr().out)


@pytest.mark.parametrize("args, message", [
    (["--model", "llama-tiny", "--gpus", "8", "--tp", "3"], "--tp 3 must divide the 8 devices"),
    (["--model", "llama-tiny", "--gpus", "8", "--batch", "4"],
     "--batch 4: the global batch must split evenly over the 8 data-parallel ranks of TP 1"),
    (["--model", "llama-tiny", "--gpus", "8", "--tp", "2,x"], "--tp: 'x' is not an int >= 1"),
    (["--model", "llama-tiny", "--gpus", "8", "--tp", "4"], "TP 4 must divide n_kv_heads=2"),
    (["--model", "mixtral-tiny", "--gpus", "6", "--ep", "3"], "ep=3 must divide the 8 experts"),
    (["--model", "gpt-5", "--gpus", "8"], "unknown model 'gpt-5'"),
])
def test_memory_errors(args, message, capsys):
    assert main(["memory", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
