"""experiments.calibrate_layer writes what ``ragged simulate --calibration`` takes: measured on gloo ranks
on this CPU, described by a hardware profile file (profiles are data), the calibrated model reproduces the
measured times. The CUDA path is the same code with CUDA events and NCCL (the calibrate stage of
experiments/gpu_check.sh).

``main`` runs in this process: its ranks fork from this process's forkserver, which has torch imported
already, where a process of the script's own imported torch and started a forkserver of its own (seconds
each on 2 cores); ``main`` keeps no state between runs."""

import json

import pytest

from experiments.calibrate_layer import main
from ragged.models import model_shapes, model_units, trained_llama
from ragged.simulate import calibrate, load_calibration, load_hardware
from ragged.simulate._step import unit_times
from ragged.simulate._workload import unit_costs

# A rough CPU as a profile: the measured times only need to land within the efficiencies calibrate solves
# for ((0, 1.5] of these peaks), four decades wide.
CPU = {"name": "cpu-gloo", "peak_flops": 1e11, "hbm_bytes": 24e9, "hbm_bandwidth": 1e10,
       "nvlink_bandwidth": 1e9, "network_bandwidth": 1e9, "gpus_per_node": 8, "intra_latency": 1e-5,
       "inter_latency": 1e-5}


@pytest.mark.parametrize("world", [1, 2])
def test_measured_times_calibrate_the_simulator_to_themselves(tmp_path, world):
    main(["--model", "llama-tiny", "--world", str(world), "--device", "cpu", "--dtype", "fp32", "--batch",
          "1", "--seq-len", "32", "--warmup", "1", "--repeat", "3", "--hardware", "cpu-gloo", "--out",
          str(tmp_path / "cal.json")])
    cal = load_calibration(tmp_path / "cal.json")
    assert (cal.model, cal.unit, cal.gpus, cal.dtype) == ("llama-tiny", "layers.0", world, "fp32")
    # one rank's collectives move nothing: only compute is measured there
    pieces = {"forward", "backward"} | ({"all_gather", "reduce_scatter"} if world > 1 else set())
    assert set(cal.measured_ms) == pieces and all(v > 0 for v in cal.measured_ms.values())
    (tmp_path / "cpu.json").write_text(json.dumps(CPU))
    hw = load_hardware(tmp_path / "cpu.json")
    c, _ = trained_llama("llama-tiny")
    eff = calibrate(cal, model_shapes("llama-tiny"), c, hw)
    config = cal.config()
    specs = model_units("llama-tiny")
    cost = unit_costs(specs, "ours", world, c, tokens=config.tokens_per_device, seq_len=config.seq_len,
                      compute_bytes=4)[[u.name for u in specs].index("layers.0")]
    t = unit_times(cost, hw, config, eff)
    got = {k: 1e3 * getattr(t, k) for k in pieces}
    want = cal.measured_ms
    for k in pieces - {"forward", "backward"}:
        assert got[k] == pytest.approx(want[k], rel=1e-3), k  # calibrate solves to 1e-6; the file rounds
    # forward and backward inform one compute efficiency: their sum is reproduced
    assert got["forward"] + got["backward"] == pytest.approx(want["forward"] + want["backward"], rel=1e-3)


def test_cpu_without_a_profile_name_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="--hardware"):
        main(["--device", "cpu", "--out", str(tmp_path / "x.json")])
    assert not (tmp_path / "x.json").exists()
