"""ragged.simulate: the collective model against brute-force rings and closed forms, the simulated bytes
against the layouts', the simulated memory against the memory plan, the schedule against hand sums."""

import json
import math

import numpy as np
import pytest

from ragged import RaggedError, plan_model
from ragged._baselines import allgather_bytes
from ragged.bench import baseline_layouts
from ragged.cli import main
from ragged.models import memory_plan, model_shapes, model_units, trained_llama
from ragged.simulate import (
    PROFILES,
    Calibration,
    Efficiency,
    Link,
    StepConfig,
    UnitTimes,
    advise_step_time,
    calibrate,
    collective_time,
    hardware,
    hierarchical_time,
    load_calibration,
    load_hardware,
    ring_link,
    ring_time,
    simulate,
    timeline_svg,
)
from ragged.simulate._schedule import COMM, COMPUTE, build_step, schedule
from ragged.simulate._workload import layer_flops

H800 = PROFILES["h800"]
TABLE1 = {"all_gather": 43.71, "ag_copy_out": 5.22, "reduce_scatter": 94.24, "rs_copy_in": 12.37}


# ----- collectives ---------------------------------------------------------------------------------
def _ring_all_gather(chunks: list[np.ndarray]) -> tuple[list[list], int, int]:
    """Brute force: each step every rank forwards the chunk it got last step to rank + 1."""
    p = len(chunks)
    held = [{r: chunks[r]} for r in range(p)]
    sending = list(range(p))  # the chunk index each rank sends next
    steps = max_step_bytes = 0
    while any(len(h) < p for h in held):
        step_bytes = 0
        received = []
        for r in range(p):
            c = sending[r]
            held[(r + 1) % p][c] = chunks[c]
            received.append(((r + 1) % p, c))
            step_bytes = max(step_bytes, chunks[c].nbytes)
        for dst, c in received:
            sending[dst] = c
        steps += 1
        max_step_bytes = max(max_step_bytes, step_bytes)
    return [[h[c] for c in range(p)] for h in held], steps, max_step_bytes


def _ring_reduce_scatter(inputs: list[np.ndarray]) -> tuple[list[np.ndarray], int]:
    """Brute force: the partial sum of chunk ``(r - s - 1) mod p`` travels round the ring for p-1 steps."""
    p = len(inputs)
    parts = [np.array_split(x, p) for x in inputs]
    acc = [parts[r][(r - 1) % p].copy() for r in range(p)]  # rank r starts the sum of chunk r-1
    for s in range(1, p):
        acc = [acc[(r - 1) % p] + parts[r][(r - s - 1) % p] for r in range(p)]
    return acc, p - 1  # rank r ends with the full sum of chunk (r - p) mod p = r


@pytest.mark.parametrize("p", [2, 3, 8])
def test_ring_all_gather_matches_brute_force(p):
    rng = np.random.default_rng(p)
    chunks = [rng.standard_normal(5).astype(np.float32) for _ in range(p)]
    out, steps, step_bytes = _ring_all_gather(chunks)
    assert all(np.array_equal(np.concatenate(o), np.concatenate(chunks)) for o in out)
    link = Link(alpha=2e-6, beta=1e9)
    assert ring_time("all_gather", p, chunks[0].nbytes, link) == pytest.approx(
        steps * (link.alpha + step_bytes / link.beta), rel=1e-12)


@pytest.mark.parametrize("p", [2, 4, 7])
def test_ring_reduce_scatter_and_all_reduce_match_brute_force(p):
    rng = np.random.default_rng(p)
    inputs = [rng.standard_normal(6 * p) for _ in range(p)]
    out, steps = _ring_reduce_scatter(inputs)
    total = np.array_split(np.sum(inputs, axis=0), p)
    assert all(np.allclose(out[r], total[r]) for r in range(p))
    link = Link(alpha=5e-6, beta=2e9)
    shard = total[0].nbytes
    step = link.alpha + shard / link.beta
    assert ring_time("reduce_scatter", p, shard, link) == pytest.approx(steps * step)
    # all-reduce = reduce-scatter then all-gather of the same shards: 2 (p-1) steps of m/p bytes
    m = shard * p
    assert ring_time("all_reduce", p, m, link) == pytest.approx(2 * steps * step)


def test_ring_time_trivial_group_and_bad_kind():
    assert ring_time("all_gather", 1, 1e9, Link(1e-6, 1e9)) == 0.0
    with pytest.raises(RaggedError, match="not one of"):
        ring_time("broadcast", 4, 1, Link(1e-6, 1e9))


def test_ring_links_inside_and_across_nodes():
    # inside a node: NVLink at its latency
    assert ring_link(H800, 8, 1, 0.5) == Link(H800.intra_latency, 0.5 * 200e9)
    # an FSDP group over 8 nodes: 8 channels, one per NIC: min(NVLink, 8 x 50 GB/s) = NVLink
    assert ring_link(H800, 64, 1, 1.0) == Link(H800.inter_latency, 200e9)
    # A100: 8 x 25 GB/s = 200 GB/s < NVLink 300 GB/s
    assert ring_link(PROFILES["a100"], 16, 1, 1.0).beta == 200e9
    # an HSDP replica group (one GPU per node): one NIC
    assert ring_link(H800, 4, 64, 1.0) == Link(H800.inter_latency, 50e9)
    # two GPUs per node (ranks 4 apart): two NICs
    assert ring_link(H800, 8, 4, 1.0).beta == 100e9


def test_groups_must_fill_nodes_evenly():
    with pytest.raises(RaggedError, match="group of 12 ranks 1 apart does not fill nodes of 8"):
        collective_time("all_gather", H800, 12, 1e6)
    # a group inside one node, even one that does not divide it
    want = 5 * (H800.intra_latency + 1e6 / 200e9)
    assert collective_time("all_gather", H800, 6, 1e6) == pytest.approx(want)
    assert collective_time("all_reduce", H800, 1, 1e6, stride=3) == 0.0
    with pytest.raises(RaggedError, match="group of 4 ranks 12 apart"):
        collective_time("all_reduce", H800, 4, 1e6, stride=12)
    assert ring_link(H800, 16, 4, 1.0).beta == 100e9  # ranks 0, 4, 8, ...: two per node


def test_collective_time_takes_the_faster_algorithm():
    n = 100e6  # bandwidth-bound: the flat ring at NVLink speed beats inter-node rings on one NIC
    flat = 63 * (H800.inter_latency + n / 200e9)
    two_level = 7 * (H800.inter_latency + n / 50e9) + 7 * (H800.intra_latency + 8 * n / 200e9)
    assert hierarchical_time("all_gather", H800, 64, 1, n, 1.0) == pytest.approx(two_level)
    assert flat < two_level
    assert collective_time("all_gather", H800, 64, n) == pytest.approx(flat)
    n = 1e3  # latency-bound at 1024 ranks: 127 + 7 steps beat 1023
    flat = 1023 * (H800.inter_latency + n / 200e9)
    two_level = 127 * (H800.inter_latency + n / 50e9) + 7 * (H800.intra_latency + 128 * n / 200e9)
    assert two_level < flat
    assert collective_time("all_gather", H800, 1024, n) == pytest.approx(two_level)


# ----- hardware ------------------------------------------------------------------------------------
def test_every_profile_says_where_its_numbers_come_from():
    for hw in PROFILES.values():
        assert {"peak_flops", "hbm_bytes", "hbm_bandwidth", "nvlink_bandwidth", "network_bandwidth"} <= set(
            hw.sources)


def test_hardware_from_a_json_file(tmp_path):
    data = PROFILES["h100"].to_dict() | {"name": "h100-96gb", "hbm_bytes": 96e9, "hbm_bandwidth": 2.4e12}
    path = tmp_path / "h100.json"
    path.write_text(json.dumps(data))
    hw = hardware(str(path))
    assert hw == load_hardware(path) and hw.hbm_bytes == 96e9 and hw.peak_flops == PROFILES["h100"].peak_flops
    path.write_text(json.dumps(data | {"nvlink_bw": 1}))
    with pytest.raises(RaggedError, match="unknown fields.*nvlink_bw"):
        load_hardware(path)
    path.write_text(json.dumps(data | {"hbm_bandwidth": -1}))
    with pytest.raises(RaggedError, match="hbm_bandwidth must be a number > 0"):
        load_hardware(path)
    with pytest.raises(RaggedError, match="unknown hardware"):
        hardware("tpu")


# ----- bytes and memory against the layouts and the memory plan -------------------------------------
@pytest.mark.parametrize("model,gpus,replicas", [("llama-tiny", 8, 1), ("llama-tiny", 8, 2),
                                                 ("gpt-oss-120b", 256, 1), ("mixtral-8x7b", 64, 4)])
def test_simulated_bytes_equal_the_layouts_bytes(model, gpus, replicas):
    c, _ = trained_llama(model)
    g = gpus // replicas
    sim = simulate(model_shapes(model), c, PROFILES["h100"], StepConfig(gpus, replicas))
    results = {r.method: r for r in sim}
    ours = plan_model(model_shapes(model), g)  # an independent path to our layouts
    base = [baseline_layouts(u.tensors, g, align=lay.align) for u, lay in zip(model_units(model), ours)]
    for method, layouts in (("ours", ours), ("fsdp2", [b[1] for b in base]),
                            ("megatron", [b[3] for b in base])):
        r = results[method]
        assert [u.shard_numel for u in r.units] == [lay.shard_size for lay in layouts]
        assert [u.allgather_received_bytes for u in r.units] == [allgather_bytes(lay.shard_size, g, 2)
                                                                 for lay in layouts]
        # forward and backward, but the last unit stays gathered from forward to backward
        assert r.allgather_bytes == (2 * sum(allgather_bytes(lay.shard_size, g, 2) for lay in layouts)
                                     - allgather_bytes(layouts[-1].shard_size, g, 2))
        assert [u.rs_shard_bytes for u in r.units] == [4 * lay.shard_size for lay in layouts]


@pytest.mark.parametrize("model,gpus,replicas,ac", [("llama-tiny", 4, 1, False), ("llama3-70b", 256, 2, True),
                                                    ("gpt-oss-120b", 128, 1, True)])
def test_simulated_memory_of_ours_is_the_memory_plan(model, gpus, replicas, ac):
    c, _ = trained_llama(model)
    cfg = StepConfig(gpus, replicas, batch_per_device=2, seq_len=1024, activation_checkpointing=ac)
    ours, fsdp2, _ = simulate(model_shapes(model), c, H800, cfg, name=model)
    plan = memory_plan(model, c, gpus, replicas=replicas, batch_per_device=2, seq_len=1024,
                       activation_checkpointing=ac, shapes=model_shapes(model))
    assert ours.memory == plan and ours.held_bytes == ours.peak_bytes == plan.total
    # FSDP2: its own shards (padding included) and the flat all-gather output held during copy-out
    shard = sum(u.shard_numel for u in fsdp2.units)
    assert fsdp2.memory.params == 4 * shard
    assert fsdp2.transient_bytes == 2 * max(u.buffer_numel for u in fsdp2.units)
    assert fsdp2.peak_bytes == pytest.approx(fsdp2.held_bytes * 1.12)


def test_fsdp2_pads_gpt_oss_experts_at_256_and_needs_more_memory():
    c, _ = trained_llama("gpt-oss-120b")
    ours, fsdp2, _ = simulate(model_shapes("gpt-oss-120b"), c, H800, StepConfig(256))
    # 128 experts over 256 ranks: FSDP2 pads the fused expert tensors' dim 0 to 256, about doubling them
    assert fsdp2.padding_ratio > 0.45 > ours.padding_ratio
    assert fsdp2.allgather_bytes > 1.9 * ours.allgather_bytes
    assert fsdp2.held_bytes > ours.held_bytes


# ----- compute and the schedule -------------------------------------------------------------------
def test_unit_flops_add_up_to_flops_per_token():
    from ragged.models import flops_per_token

    c, _ = trained_llama("llama3-8b")
    r = simulate(model_shapes("llama3-8b"), c, H800, StepConfig(8, seq_len=2048), methods=["ours"])[0]
    fwd = sum(u.gemm_flops + u.attention_flops for u in r.units) / r.config.tokens_per_device
    norms = 2 * c.n_layers * c.dim + c.dim  # flops_per_token counts norm weights as matmul parameters
    assert 3 * fwd + 6 * norms == flops_per_token(c, 2048)
    gemm, attn, _ = layer_flops(c, 2048)
    assert gemm == 2 * (4096 * 4096 * 2 + 4096 * 1024 * 2 + 3 * 4096 * 14336)
    assert attn == 4 * 4096 * 2048


def test_recomputation_policies_against_hand_counts():
    """Full recomputation adds one forward to backward; torchtitan's selective op policy (every second
    matmul of a layer's forward, counted from 1, recomputed: Llama-3-8B's wk, wo, w3) adds those matmuls'
    FLOPs and the layer's elementwise kernels; none adds nothing."""
    c, _ = trained_llama("llama3-8b")
    tokens = 2 * 1024

    def layer(ac):
        config = StepConfig(8, 1, 2, 1024, activation_checkpointing=ac)
        r = simulate(model_shapes("llama3-8b"), c, H800, config, methods=["ours"])[0]
        i = [u.name for u in r.units].index("layers.0")
        return r.units[i], r.times[i]

    u, none = layer(False)
    assert u.selective_op_gemm_flops == tokens * 2 * (4096 * 1024 + 4096 * 4096 + 4096 * 14336)
    eff = Efficiency()
    _, full = layer("full")
    _, selective = layer("selective-op")
    assert none.backward == pytest.approx(2 * none.forward)
    assert full.backward == pytest.approx(3 * full.forward)
    extra = (u.selective_op_gemm_flops / (eff.gemm * H800.peak_flops)
             + u.elementwise_bytes / (eff.elementwise * H800.hbm_bandwidth))
    assert selective.backward == pytest.approx(2 * selective.forward + extra)
    assert none.backward < selective.backward < full.backward
    with pytest.raises(RaggedError, match="activation_checkpointing"):
        StepConfig(8, activation_checkpointing="sometimes")


def _times(name, ag=0.0, rs=0.0, fwd=0.0, bwd=0.0, co=0.0):
    return UnitTimes(name, ag, rs, 0.0, 0.0, co, 0.0, 0.0, fwd, bwd)


def test_schedule_closed_forms():
    # no communication: the step is all the compute plus the optimizer
    units = [_times(f"u{i}", fwd=1.0 + i, bwd=2.0 * (1 + i)) for i in range(4)]
    assert schedule(build_step(units, 0.5)) == pytest.approx(3 * sum(1.0 + i for i in range(4)) + 0.5)
    # no compute: the step is all the communication (the last unit is not gathered again)
    units = [_times(f"u{i}", ag=1.0, rs=2.0) for i in range(3)]
    assert schedule(build_step(units, 0.0)) == pytest.approx(3 * (2 * 1.0 + 2.0) - 1.0)
    # one unit: all-gather, copy-out, forward, backward, reduce-scatter, optimizer, in series
    one = [_times("u", ag=1.0, rs=3.0, fwd=2.0, bwd=4.0, co=0.5)]
    assert schedule(build_step(one, 0.25)) == pytest.approx(1 + 0.5 + 2 + 4 + 3 + 0.25)


def test_schedule_overlaps_prefetch_and_respects_dependencies():
    # compute-bound: every all-gather after the first hides under the previous unit's compute
    units = [_times(f"u{i}", ag=0.1, rs=0.1, fwd=1.0, bwd=2.0) for i in range(6)]
    ops = build_step(units, 0.0)
    step = schedule(ops)
    # only the first all-gather and the last reduce-scatter stick out
    assert step == pytest.approx(0.1 + 6 * 3.0 + 0.1)
    for stream in (COMPUTE, COMM):
        mine = [o for o in ops if o.stream == stream]
        assert all(a.end <= b.start + 1e-12 for a, b in zip(mine, mine[1:]))
    assert all(ops[d].end <= o.start + 1e-12 for o in ops for d in o.deps)


# ----- calibration --------------------------------------------------------------------------------
def _table1(**kw):
    return Calibration(source="the paper's Table 1", hardware="h800", model="gpt-oss-120b", method="fsdp2",
                       gpus=64, unit="layers.0", measured_ms=kw or TABLE1)


def test_calibration_reproduces_its_own_measurements(tmp_path):
    c, _ = trained_llama("gpt-oss-120b")
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(_table1().to_dict()))
    cal = load_calibration(path)
    eff = calibrate(cal, model_shapes("gpt-oss-120b"), c, H800)
    fsdp2 = simulate(model_shapes("gpt-oss-120b"), c, H800, cal.config(), methods=["fsdp2"],
                     efficiency=eff)[0]
    t = fsdp2.times[1]
    got = {"all_gather": t.all_gather, "ag_copy_out": t.ag_copy_out, "reduce_scatter": t.reduce_scatter,
           "rs_copy_in": t.rs_copy_in}
    assert {k: 1e3 * v for k, v in got.items()} == pytest.approx(TABLE1, rel=1e-9)
    assert "Table 1" in eff.source("all_gather") and "assumed" in eff.source("gemm")
    assert eff.gemm == Efficiency().gemm


def test_calibration_rejects_bad_input(tmp_path):
    with pytest.raises(RaggedError, match="unknown pieces.*copyout"):
        _table1(copyout=1.0)
    with pytest.raises(RaggedError, match="time > 0"):
        _table1(all_gather=-3.0)
    c, _ = trained_llama("gpt-oss-120b")
    with pytest.raises(RaggedError, match="faster than the model"):
        calibrate(_table1(all_gather=0.01), model_shapes("gpt-oss-120b"), c, H800)
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(_table1().to_dict() | {"gpu": 3}))
    with pytest.raises(RaggedError, match="unknown fields.*gpu"):
        load_calibration(path)


# ----- the command and the picture ----------------------------------------------------------------
def test_cli_simulate_json_and_svg(tmp_path, capsys):
    out, svg = tmp_path / "sim.json", tmp_path / "sim.svg"
    assert main(["simulate", "--model", "llama-tiny", "--gpus", "8", "--hsdp", "2", "--hardware", "a100",
                 "--seq-len", "256", "--json", str(out), "--svg", str(svg)]) == 0
    data = json.loads(out.read_text())
    assert [r["method"] for r in data["results"]] == ["ours", "fsdp2", "megatron"]
    assert all(r["group_size"] == 4 and r["replicas"] == 2 for r in data["results"])
    text = svg.read_text()
    units = len(model_shapes("llama-tiny").units)
    assert text.startswith("<svg") and text.count('data-kind="all_reduce"') == 3 * units
    assert "FSDP2" in capsys.readouterr().out


def test_cli_simulate_errors(tmp_path, capsys):
    shapes = tmp_path / "s.json"
    unit = {"name": "layers.0", "tensors": [{"name": "w", "shape": [8, 8]}]}
    shapes.write_text(json.dumps({"units": [unit]}))
    assert main(["simulate", "--shapes", str(shapes), "--gpus", "2"]) == 2
    assert "--like" in capsys.readouterr().err
    assert main(["simulate", "--model", "llama-tiny", "--gpus", "6", "--hsdp", "4"]) == 2
    assert "replicas must divide" in capsys.readouterr().err
    args = ["simulate", "--shapes", str(shapes), "--like", "llama-tiny", "--gpus", "2", "--json", "-"]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["results"][0]["gpus"] == 2
    # a trained llama that is not a shape preset gets its llama's shapes
    args = ["simulate", "--model", "llama3.2-1b", "--gpus", "8", "--methods", "ours", "--json", "-"]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["results"][0]["padding_ratio"] < 0.01
    args = ["simulate", "--model", "llama3-8b", "--gpus", "8", "--methods", "fsdp2", "--json", "-"]
    steps = {}
    for ac in ("none", "selective-op", "full"):
        assert main([*args, "--activation-checkpointing", ac]) == 0
        steps[ac] = json.loads(capsys.readouterr().out)["results"][0]["step_s"]
    assert steps["none"] < steps["selective-op"] < steps["full"]
    assert main(["simulate", "--model", "gpt-5", "--gpus", "8"]) == 2
    assert "unknown model" in capsys.readouterr().err


def test_timeline_svg_draws_every_op():
    c, _ = trained_llama("llama-tiny")
    results = simulate(model_shapes("llama-tiny"), c, H800, StepConfig(4, seq_len=128))
    text = timeline_svg(results)
    drawn = sum(1 for r in results for o in r.ops if o.seconds > 0)
    assert text.count("<rect class=") == drawn and math.isfinite(results[0].step_s)


# ----- advise by step time ------------------------------------------------------------------------
def test_advise_by_step_time_ranks_the_simulated_options():
    from ragged.advise._advise import merge_layers

    c, _ = trained_llama("llama-tiny")
    hw = PROFILES["a100"]
    options, best = advise_step_time(model_shapes("llama-tiny"), c, hw, 8, merge_factors=(1, 2), seq_len=256)
    assert sorted((o.group_size, o.merge) for o in options) == [(g, k) for g in (1, 2, 4, 8) for k in (1, 2)]
    assert [o.step_s for o in options] == sorted(o.step_s for o in options)
    assert best is not None and best.fits
    for o in options:  # each option is the simulator's own step for that configuration
        r = simulate(merge_layers(model_units("llama-tiny"), o.merge), c, hw,
                     StepConfig(8, o.replicas, seq_len=256), methods=["ours"])[0]
        assert (r.step_s, r.peak_bytes) == (o.step_s, o.peak_bytes)


def test_cli_advise_by_step_time(capsys):
    assert main(["advise", "--model", "llama-tiny", "--gpus", "8", "--hardware", "h800", "--json", "-"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["recommended"] == min((o for o in data["options"] if o["fits"]), key=lambda o: o["step_s"])
