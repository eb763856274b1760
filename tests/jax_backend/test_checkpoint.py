"""Neutral checkpoints across frameworks: torch -> neutral -> JAX (resharded) -> neutral -> torch."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
from flax import nnx

import jax_backend
import ragged
import ragged.checkpoint
import ragged.models
import torch_backend
from jax_backend import LayoutMismatchError, full_params, make_mesh, shard_params
from jax_backend._names import fqn
from jax_backend.models import Llama, parallelize
from ragged import plan_model
from torch_backend.models import Llama as TorchLlama

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


def test_torch_weights_give_the_same_logits_in_flax(tmp_path):
    """Same architecture: the torch model's weights, through a checkpoint, give flax the same logits."""
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
    got = np.asarray(nnx.merge(graphdef, state)(tokens))
    want = torch_model(torch.from_numpy(tokens)).detach().numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


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
