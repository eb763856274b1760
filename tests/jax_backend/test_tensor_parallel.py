"""A tensor mesh axis beside fsdp (and replica): equal to single-device training and to GSPMD on the same
2-D / 3-D mesh, checkpoints across tensor sizes, and the errors of bad annotations.

Two models: the project's llama split by ``jax_backend.models.TENSOR_RULES``, and a transformer written
with flax's own layers (``nnx.Embed``, ``nnx.MultiHeadAttention``, ``nnx.Linear``, ``nnx.LayerNorm``) whose
weights carry ``nnx.with_partitioning`` annotations, as flax's sharding guide writes them
(``experiments/_flax_transformer.py``, which the benchmark runs too). The GSPMD baseline is the benchmark's
(``experiments/_gspmd.py``).
"""

from __future__ import annotations

import re

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from experiments._flax_transformer import Transformer, annotated, make_transformer
from experiments._gspmd import gspmd_step
from jax_backend import (
    TensorParallelError,
    UnsupportedOptimizerError,
    flatten_params,
    load_neutral_checkpoint,
    make_mesh,
    save_neutral_checkpoint,
    shard_model,
)
from jax_backend.models import cross_entropy, model_params, parallelize
from tests.jax_backend.any_models import train_reference as train_pytree
from tests.jax_backend.jax_reference import adamw, assert_float64_parity, float64, train_fsdp

MESHES = {"fsdp4_tensor2": ((4, 2), ("fsdp", "tensor"), None),
          "replica2_fsdp2_tensor2": ((2, 2, 2), ("replica", "fsdp", "tensor"), "replica")}
# Bounds: both models train in float64, sharded and under GSPMD, against one device in float64, same recipe
# (jax_reference.float64_bound: 10 steps of 1e5 eps for the llama, 5 for the flax model). Data parallelism
# sums the batch mean in another order, and tensor parallelism sums each row-parallel matmul in two partial
# sums: rounding amplified by AdamW where a gradient is near zero (10 steps of the llama in fp32: parameters
# 2e-6 at fsdp 4 x tensor 2, CPU-dependent; in float64 1.4e-15, GSPMD 1.9e-15). The flax model's float64
# copy takes flax's attention by its unfused path (jax_reference.unfused_attention: the fused one computes
# its softmax in fp32 whatever the inputs); measured in float64 on parameters: 2.6e-15 at both meshes, GSPMD
# 1.4e-14 and 5.1e-14, losses within 3e-16 (in fp32 the key kernel's distance was 1.2e-5 to 2.4e-5, where
# its gradient is zero in exact arithmetic along a shift of every key).


def _mesh(name: str):
    shape, names, replica = MESHES[name]
    return make_mesh(shape, names), replica


@pytest.fixture(scope="module")
def transformer() -> Transformer:
    return make_transformer()


@pytest.fixture(scope="module")
def tokens() -> np.ndarray:
    return np.random.default_rng(1).integers(0, 128, size=(5, 8, 17)).astype(np.int32)


def nnx_reference(model: nnx.Module, data: np.ndarray) -> tuple[list[float], dict]:
    graphdef, params = nnx.split(model, nnx.Param)
    return train_pytree(lambda p, x: nnx.merge(graphdef, p)(x), params, cross_entropy, data, adamw())


# ----- GSPMD on the same mesh and split: the baseline ---------------------------------------------------
def gspmd_train(model: nnx.Module, fsdp, data: np.ndarray) -> tuple[list[float], dict]:
    """``experiments._gspmd``'s jitted step (each parameter on the tensor axis as ``fsdp.tensor_parallel``
    splits it, on the fsdp axis along its largest other dim that fsdp divides, replicated over replicas;
    the batch over the data axes; AdamW on the full pytree), trained on ``data``."""
    step, carry = gspmd_step(model, cross_entropy, adamw(), fsdp.mesh, axis=fsdp.axis,
                             data_axes=fsdp.data_axes, tensor=fsdp.tensor_parallel)
    losses = []
    for b in data:
        *carry, loss = step(*carry, b[:, :-1], b[:, 1:])
        losses.append(float(loss))
    return losses, {k: np.asarray(v) for k, v in flatten_params(carry[0]).items()}


# ----- training equals one device and GSPMD ------------------------------------------------------------
@pytest.mark.parametrize("mesh_name, mode", [("fsdp4_tensor2", {}),
                                             ("replica2_fsdp2_tensor2", {"remat": True})])
def test_llama_with_tensor_rules_matches_single_device_and_gspmd(x64, model64, batches, reference, mesh_name,
                                                                 mode):
    mesh, replica = _mesh(mesh_name)
    fsdp = parallelize(model64, mesh, replica_axis=replica, tensor_axis="tensor", **mode)
    assert all(lay.world_size == mesh.shape["fsdp"] for lay in fsdp.layouts)
    assert fsdp.tensor_parallel.local_shape("layers.0.attention.wq.weight", (64, 64)) == (32, 64)
    assert_float64_parity(*train_fsdp(fsdp, model64, batches), reference)
    assert_float64_parity(*gspmd_train(model64, fsdp, batches), reference)  # the baseline is right too


@pytest.fixture(scope="module")
def transformer64(transformer) -> Transformer:
    return float64(transformer)


@pytest.fixture(scope="module")
def flax_reference(transformer64, tokens) -> tuple[list[float], dict]:
    """The flax model trained on one device in float64 (shared by both meshes)."""
    with jax.enable_x64(True):
        return nnx_reference(transformer64, tokens)


@pytest.mark.parametrize("mesh_name, mode", [("fsdp4_tensor2", {"reshard_after_forward": True}),
                                             ("replica2_fsdp2_tensor2", {})])
def test_flax_model_with_partitioning_annotations_matches_single_device_and_gspmd(x64, transformer64, tokens,
                                                                                  flax_reference, mesh_name,
                                                                                  mode):
    mesh, replica = _mesh(mesh_name)
    fsdp = shard_model(transformer64, mesh, units="blocks.*", replica_axis=replica, tensor_axis="tensor",
                       **mode)
    tp = dict(fsdp.tensor_parallel.dims)
    assert tp["blocks.0.attn.query.kernel"] == 1 and tp["blocks.0.attn.out.kernel"] == 0
    assert tp["blocks.0.up.kernel"] == 1 and tp["blocks.0.up.bias"] == 0 and tp["embed.embedding"] == 0
    assert tp["blocks.0.norm1.scale"] is None and tp["blocks.0.down.bias"] is None
    assert_float64_parity(*train_fsdp(fsdp, transformer64, tokens), flax_reference)
    assert_float64_parity(*gspmd_train(transformer64, fsdp, tokens), flax_reference)  # the baseline too


def test_compiled_step_gathers_each_tensor_ranks_shard_over_fsdp_only(model, batches):
    """The optimizer state is placed as the buffers, and the unit collectives run on each tensor rank's row
    (``(1, W * S)``, groups of the fsdp axis): left to XLA, the all-gather of a (T, S) operand first
    replicates it over the tensor axis."""
    mesh, _ = _mesh("fsdp4_tensor2")
    fsdp = parallelize(model, mesh, tensor_axis="tensor", reshard_after_forward=False)  # one gather per unit
    buffers = fsdp.shard_params(model_params(model))
    assert all(b.shape[0] == 2 and b.sharding.spec == P("tensor", "fsdp") for b in buffers.values())
    opt = adamw()
    step = fsdp.train_step(opt, cross_entropy)
    state = fsdp.init(opt, buffers)
    # the moments as the buffers from init on (left to XLA, init replicated them over tensor), so the step
    # compiled for the first state takes the state it returns
    assert {a.sharding.spec for a in jax.tree.leaves(state) if a.ndim} == {P("tensor", "fsdp")}
    x, y = batches[0][:, :-1], batches[0][:, 1:]
    compiled = step.lower(buffers, state, x, y).compile()
    compiled(*compiled(buffers, state, x, y)[:2], x, y)
    text = compiled.as_text()
    sizes = {lay.total_numel for lay in fsdp.layouts} | {lay.shard_size for lay in fsdp.layouts}
    unit_ops = re.findall(r"= f32\[(\d+),(\d+)\]\S* (all-gather|reduce-scatter)\(", text)
    on_units = [(int(t), op) for t, n, op in unit_ops if int(n) in sizes]
    assert sorted(op for _, op in on_units) == ["all-gather"] * 6 + ["reduce-scatter"] * 6  # one per unit
    assert all(t == 1 for t, _ in on_units), on_units  # never the tensor axis's rows together


# ----- checkpoints: with and without the tensor axis ---------------------------------------------------
def test_neutral_checkpoint_saved_with_tensor_parallel_loads_without_and_back(model, tmp_path):
    params = model_params(model)
    mesh, _ = _mesh("fsdp4_tensor2")
    tp_fsdp = parallelize(model, mesh, tensor_axis="tensor")
    plain = parallelize(model, make_mesh((8,), ("fsdp",)))
    buffers = tp_fsdp.shard_params(params)
    save_neutral_checkpoint(tmp_path / "tp", buffers, tp_fsdp.layouts,
                            tensor_parallel=tp_fsdp.tensor_parallel)
    loaded = load_neutral_checkpoint(tmp_path / "tp", plain.layouts, plain.mesh, "fsdp")
    for name, full in plain.full_params(loaded).items():
        np.testing.assert_array_equal(np.asarray(full), np.asarray(params[name]), err_msg=name)
    save_neutral_checkpoint(tmp_path / "plain", loaded, plain.layouts)
    back = load_neutral_checkpoint(tmp_path / "plain", tp_fsdp.layouts, mesh, "fsdp",
                                   tensor_parallel=tp_fsdp.tensor_parallel)
    for unit in buffers:  # the same (T, W * S) buffers, bit for bit
        np.testing.assert_array_equal(np.asarray(back[unit]), np.asarray(buffers[unit]), err_msg=unit)
    assert {k: v.sharding.spec for k, v in back.items()} == {k: P("tensor", "fsdp") for k in back}


# ----- errors ------------------------------------------------------------------------------------------
class Odd(nnx.Module):
    def __init__(self, spec: tuple, out: int = 6, *, rngs: nnx.Rngs):
        with nnx.use_eager_sharding(False):
            self.inner = nnx.Linear(4, out, kernel_init=annotated(spec), rngs=rngs)
            self.last = nnx.Linear(out, 2, rngs=rngs)

    def __call__(self, x):
        return self.last(self.inner(x))


@pytest.mark.parametrize("spec, out, match", [
    ((None, "tensor"), 5, r"'inner.kernel' \(shape \(4, 5\)\): dim 1 \(5\) is not divisible by the size 2"),
    ((None, "model"), 6, r"'inner.kernel' .*'model' is not a mesh axis"),
    (("tensor", "tensor"), 6, r"'inner.kernel' .*splits dims \[0, 1\]"),
])
def test_bad_annotation_names_the_parameter(spec, out, match):
    mesh, _ = _mesh("fsdp4_tensor2")
    with pytest.raises(TensorParallelError, match=match):
        shard_model(Odd(spec, out, rngs=nnx.Rngs(0)), mesh, units="inner", tensor_axis="tensor")


def test_bad_rules_and_optimizers_are_refused(transformer):
    mesh, _ = _mesh("fsdp4_tensor2")
    odd = Odd((None, None), 5, rngs=nnx.Rngs(0))
    with pytest.raises(TensorParallelError, match=r"'inner.kernel' \(shape \(4, 5\)\): dim 1 \(5\) is not"):
        shard_model(odd, mesh, units="inner", tensor_axis="tensor", tensor_rules={"inner.kernel": 1})
    with pytest.raises(TensorParallelError, match=r"'inner.kernel' \(shape \(4, 5\)\): tensor dim 2 out of"):
        shard_model(odd, mesh, units="inner", tensor_axis="tensor", tensor_rules={"inner.kernel": 2})
    with pytest.raises(TensorParallelError, match="tensor_axis"):
        shard_model(transformer, mesh, units="blocks.*", tensor_rules={"head.kernel": 0})
    fsdp = shard_model(transformer, mesh, units="blocks.*", tensor_axis="tensor")
    with pytest.raises(UnsupportedOptimizerError, match="element-wise"):
        masked = optax.adamw(1e-3, mask=lambda p: jax.tree.map(lambda a: a.ndim > 1, p))
        fsdp.train_step(masked, cross_entropy)
