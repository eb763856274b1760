"""Neutral checkpoints across frameworks: torch -> neutral -> JAX (resharded) -> neutral -> torch, and both
stacks training on from one checkpoint under tensor parallelism and on the MoE decoders (FSDP and expert
parallelism).

The cross-stack training runs JAX here (the suite's 8 host devices) and torch in one launch of 4 gloo
ranks (``_cross_stack_workers.py``, started by forkserver: the pytest process, which holds jax, is never
forked). JAX writes the checkpoints torch reads before the launch; the tests read torch's after it. Data and
recipe are the demo's (``experiments.demo``: the same global batch per step, AdamW), and so is the loss
bound, ``LOSS_RTOL``: a step's loss is a mean over ``BATCH * SEQ`` tokens that the two stacks sum in
another order, at most ``(n - 1)`` fp32 unit roundoffs apart; the parameters' differences after these few
steps add far less (the demo measures 3e-7). Checkpoints load bit for bit: a comparison of equal values.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
import torch
from flax import nnx

import jax_backend
import ragged
import ragged.checkpoint
import ragged.models
import torch_backend
from experiments._distributed import WORKER_PRELOAD_ENV
from experiments.demo import LOSS_RTOL, LR, WEIGHT_DECAY, batch
from jax_backend import (
    LayoutMismatchError,
    full_params,
    load_neutral_params,
    make_mesh,
    save_neutral_params,
    shard_params,
)
from jax_backend._names import fqn
from jax_backend.models import Llama, cross_entropy, model_params, parallelize
from jax_backend.models.expert_parallel import ExpertParallel, parallelize_moe
from jax_backend.models.moe import MoEDecoder, moe_loss
from ragged import plan_model
from ragged.models import MOE_CONFIGS
from tests.jax_backend import _cross_stack_workers as W
from tests.jax_backend.jax_reference import float64, float64_bound, rel_err
from tests.torch_backend._dist import case_results, launch
from torch_backend.models import Llama as TorchLlama
from torch_backend.models import MoEDecoder as TorchMoEDecoder

UNITS = ragged.models.model_shapes("llama-tiny").units


def torch_state_dict(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The torch llama-tiny's state dict, with a NaN and a -0.0 planted (bits are tested, not values)."""
    model = TorchLlama()
    model.init_weights(0)
    sd = {k: v.detach().to(dtype) for k, v in model.state_dict().items()}
    sd["norm.weight"][:2] = torch.tensor([float("nan"), -0.0])
    return sd


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_jax_torch_round_trip_is_bit_exact_with_resharding(tmp_path, dtype):
    sd = torch_state_dict(dtype)
    torch_backend.save_neutral_checkpoint(tmp_path / "from_torch", sd, layouts=plan_model(UNITS, 4))
    # Load into JAX at 3 devices (the torch run planned for 4), save, and reload at 8.
    layouts3, mesh3 = plan_model(UNITS, 3), make_mesh((3,), ("fsdp",))
    buffers = jax_backend.load_neutral_checkpoint(tmp_path / "from_torch", layouts3, mesh3, "fsdp")
    assert {b.dtype.name for b in buffers.values()} == {str(dtype).removeprefix("torch.")}
    jax_backend.save_neutral_checkpoint(tmp_path / "from_jax", buffers, layouts3)
    layouts8, mesh8 = plan_model(UNITS, 8), make_mesh((8,), ("fsdp",))
    loaded = jax_backend.load_neutral_checkpoint(tmp_path / "from_jax", layouts8, mesh8, "fsdp")
    resharded = full_params(loaded, layouts8)
    back = torch_backend.load_neutral_checkpoint(tmp_path / "from_jax")
    assert list(back) == list(sd)
    for name, value in sd.items():
        assert back[name].dtype == dtype and back[name].shape == value.shape
        assert bits(back[name]) == bits(value), name
        assert np.asarray(resharded[name]).tobytes() == bits(value), name
    assert ragged.checkpoint.load_neutral_checkpoint(tmp_path / "from_jax").layouts == layouts3


def test_torch_weights_give_the_same_logits_in_flax(tmp_path, x64):
    """Same architecture: the torch model's weights, through a checkpoint, give flax the same logits, both
    computed in float64 from the fp32 weights: within float64_bound of one step (measured 3e-16; in fp32
    the bound was 1e-5, ~80 eps)."""
    torch_model = TorchLlama()
    torch_model.init_weights(0)
    torch_backend.save_neutral_checkpoint(tmp_path / "ck", torch_model)
    fsdp = parallelize(Llama(rngs=nnx.Rngs(1)), make_mesh((2,), ("fsdp",)))
    params = fsdp.full_params(
        jax_backend.load_neutral_checkpoint(tmp_path / "ck", fsdp.layouts, fsdp.mesh, fsdp.axis))
    tokens = np.random.default_rng(0).integers(0, 256, size=(2, 16))
    model = Llama(rngs=nnx.Rngs(1))
    graphdef, state = nnx.split(model, nnx.Param)
    names = [fqn(path) for path, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
    state = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(state), [params[n] for n in names])
    assert all(np.asarray(v).dtype == np.float32 for v in params.values())  # the checkpoint's fp32
    got = np.asarray(nnx.merge(graphdef, float64(state))(tokens))
    want = torch_model.double()(torch.from_numpy(tokens)).detach().numpy()
    assert got.dtype == want.dtype == np.float64
    assert rel_err(got, want) <= float64_bound(1), rel_err(got, want)


def test_load_into_torch_module_and_dtensor(tmp_path):
    """Loading into a module copies plain tensors and re-shards DTensors with their own placements."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    model = torch.nn.Sequential(torch.nn.Linear(4, 6, bias=False), torch.nn.Linear(6, 2))
    want = {k: torch.randn(v.shape) for k, v in model.state_dict().items()}
    torch_backend.save_neutral_checkpoint(tmp_path / "ck", want)
    torch_backend.load_neutral_checkpoint(tmp_path / "ck", model)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in want.items())
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        for layer in model:
            for name, p in list(layer.named_parameters()):
                dt = distribute_tensor(torch.zeros_like(p), mesh, [Shard(0)])
                layer.register_parameter(name, torch.nn.Parameter(dt))
        torch_backend.load_neutral_checkpoint(tmp_path / "ck", model)
        assert all(p.placements == (Shard(0),) for p in model.parameters())
        got = {k: v.full_tensor() for k, v in model.state_dict().items()}
        torch_backend.save_neutral_checkpoint(tmp_path / "ck2", model)  # gathers DTensors with full_tensor
    finally:
        dist.destroy_process_group()
    assert all(torch.equal(got[k], v) for k, v in want.items())
    back = torch_backend.load_neutral_checkpoint(tmp_path / "ck2")
    assert all(torch.equal(back[k], v) for k, v in want.items())


def test_torch_load_names_saved_tensors_the_module_has_no_place_for(tmp_path):
    model = torch.nn.Linear(4, 2)
    extra = {**model.state_dict(), "extra.weight": torch.ones(3)}
    torch_backend.save_neutral_checkpoint(tmp_path / "ck", extra)
    with pytest.raises(ragged.checkpoint.CheckpointError,
                       match=r"nothing to load 1 saved tensors into: \['extra.weight'\]"):
        torch_backend.load_neutral_checkpoint(tmp_path / "ck", model)


def test_checkpoint_that_does_not_match_the_layouts_is_named(tmp_path):
    sd = torch_state_dict(torch.float32)
    sd["output.weight"] = sd["output.weight"][:100]
    torch_backend.save_neutral_checkpoint(tmp_path / "ck", sd)
    with pytest.raises(LayoutMismatchError, match=r"output.weight: params has shape \(100, 64\)"):
        jax_backend.load_neutral_checkpoint(tmp_path / "ck", plan_model(UNITS, 2), make_mesh((2,), ("fsdp",)),
                                            "fsdp")
    assert jax_backend.load_neutral_params(tmp_path / "ck")["output.weight"].shape == (100, 64)
    buffers = shard_params({k: v.numpy() for k, v in torch_state_dict(torch.float32).items()},
                           plan_model(UNITS, 2), make_mesh((2,), ("fsdp",)), "fsdp")
    with pytest.raises(ragged.checkpoint.CheckpointError, match="exists"):
        jax_backend.save_neutral_checkpoint(tmp_path / "ck", buffers, plan_model(UNITS, 2))


# ----- both stacks training on from one checkpoint: tensor parallelism, MoE under FSDP and EP ---------------
@functools.cache
def tp_llama():
    """The flax llama under ``(fsdp 4, tensor 2)``: its runtime, AdamW and train step (the parameters are
    the checkpoints'), made once: ``jax_writes`` and the test after the launch train the one program."""
    fsdp = parallelize(Llama(rngs=nnx.Rngs(0)), make_mesh((4, 2), ("fsdp", "tensor")), tensor_axis="tensor")
    opt = optax.adamw(LR, weight_decay=WEIGHT_DECAY)
    return fsdp, opt, fsdp.train_step(opt, cross_entropy)


def moe_runtime(preset: str, ep: int, fsdp: int) -> ExpertParallel:
    return parallelize_moe(MoEDecoder(MOE_CONFIGS[preset], rngs=nnx.Rngs(0)),
                           make_mesh((ep, fsdp), ("ep", "fsdp")))


def train_jax(step, buffers, state, steps: range, *model_state) -> tuple[list[float], dict]:
    """``step`` (an FSDP train step; with ``model_state``, the EP one) over the demo's batches."""
    losses = []
    for s in steps:
        buffers, state, loss, *model_state = step(buffers, state, *batch(s), *model_state)
        losses.append(float(loss))
    return losses, buffers


def jax_writes(workdir: Path) -> dict[str, dict[str, list[float]]]:
    """Before the torch launch: JAX's TP checkpoint after ``PRE_STEPS`` steps; per MoE preset, torch's
    initial checkpoint, JAX's losses from it under FSDP (4 devices) and EP (2, 2), and its EP save."""
    fsdp, opt, step = tp_llama()
    buffers = fsdp.shard_params(model_params(Llama(rngs=nnx.Rngs(0))))
    _, buffers = train_jax(step, buffers, fsdp.init(opt, buffers), range(W.PRE_STEPS))
    jax_backend.save_neutral_checkpoint(workdir / "jax_tp", buffers, fsdp.layouts,
                                        tensor_parallel=fsdp.tensor_parallel)
    losses = {}
    for preset in W.MOE_PRESETS:
        c = MOE_CONFIGS[preset]
        model = TorchMoEDecoder(c)
        model.init_weights(0)
        torch_backend.save_neutral_checkpoint(workdir / f"{preset}_init", model)
        losses[preset] = {}
        for kind, ep in (("fsdp", 1), ("ep", 2)):
            runtime = moe_runtime(preset, ep, 4 // ep)
            buffers = runtime.shard_params(load_neutral_params(workdir / f"{preset}_init"))
            step = runtime.fsdp.train_step(opt, lambda output, y, c=c: moe_loss(output, y, c.aux_loss_coef))
            losses[preset][kind], buffers = train_jax(step, buffers, runtime.fsdp.init(opt, buffers),
                                                      range(W.STEPS), runtime.init_model_state())
        save_neutral_params(workdir / f"{preset}_jax_ep", runtime.full_params(buffers))
    return losses


@pytest.fixture(scope="module")
def cross_stack(tmp_path_factory) -> tuple[Path, dict, list]:
    """The checkpoints' directory, JAX's losses (``jax_writes``) and the torch launch's results."""
    workdir = tmp_path_factory.mktemp("cross_stack")
    losses = jax_writes(workdir)
    # The workers run no HuggingFace code: their forkserver (this launch starts it in the JAX tests' process)
    # need not import transformers, which tests/conftest.py preloads for the torch tests (5 to 14 s).
    hf = "tests.torch_backend._hf_preload"
    preload = [m for m in os.environ.get(WORKER_PRELOAD_ENV, "").split() if m != hf]
    with pytest.MonkeyPatch.context() as env:
        env.setenv(WORKER_PRELOAD_ENV, " ".join(preload))
        results = launch(str(Path(W.__file__)), "checks", 4, str(workdir), timeout_s=400)
    return workdir, losses, results


def assert_bits_equal(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert np.asarray(got[name]).tobytes() == np.asarray(value).tobytes(), name


def test_tensor_parallel_checkpoint_crosses_stacks_and_both_train_on_alike(cross_stack):
    """JAX (fsdp 4, tensor 2) saves, torch (dp 2, tp 2) loads it equal; torch trains, saves, and both load
    that save (JAX at fsdp 4 x tensor 2, bit for bit) and give the same losses over the next steps."""
    workdir, _, results = cross_stack
    ranks = case_results(results, "tp")
    assert all(r["loaded"] == 0.0 and r["reloaded"] == 0.0 for r in ranks), ranks
    fsdp, opt, step = tp_llama()
    buffers = jax_backend.load_neutral_checkpoint(workdir / "torch_tp", fsdp.layouts, fsdp.mesh, fsdp.axis,
                                                  tensor_parallel=fsdp.tensor_parallel)
    assert_bits_equal(fsdp.full_params(buffers), load_neutral_params(workdir / "torch_tp"))
    losses, _ = train_jax(step, buffers, fsdp.init(opt, buffers), range(W.PRE_STEPS, W.PRE_STEPS + W.STEPS))
    assert losses[-1] < losses[0]  # it trains
    np.testing.assert_allclose(losses, ranks[0]["losses"], rtol=LOSS_RTOL)


@pytest.mark.parametrize("preset", W.MOE_PRESETS)
def test_moe_trains_alike_on_both_stacks_from_one_checkpoint_under_fsdp_and_ep(cross_stack, preset):
    """Every expert receives tokens in every step (asserted: an idle expert gets no AdamW step on torch
    and a zero-gradient one on JAX, see docs/moe.md), and then both stacks give the same losses."""
    _, losses, results = cross_stack
    ranks = case_results(results, f"moe/{preset}")
    for kind in ("fsdp", "ep"):
        torch_run = ranks[0][kind]
        assert min(torch_run["fewest_tokens"]) > 0, torch_run
        assert torch_run["losses"][-1] < torch_run["losses"][0]  # it trains
        np.testing.assert_allclose(losses[preset][kind], torch_run["losses"], rtol=LOSS_RTOL, err_msg=kind)


@pytest.mark.parametrize("preset", W.MOE_PRESETS)
def test_expert_parallel_checkpoint_crosses_stacks(cross_stack, preset):
    """JAX's EP (2, 2) save loads into torch's EP (2, 2) equal on every rank; torch's EP save holds every
    EP rank's experts (each rank reads back its own, equal) under one-process names, and JAX loads it at
    EP (4, 2) bit for bit."""
    workdir, _, results = cross_stack
    ranks = case_results(results, f"moe/{preset}")
    assert all(r["loaded"] == 0.0 and r["saved"] == 0.0 for r in ranks), ranks
    saved = load_neutral_params(workdir / f"{preset}_torch_ep")
    runtime = moe_runtime(preset, 4, 2)
    assert_bits_equal(runtime.full_params(runtime.shard_params(saved)), saved)
