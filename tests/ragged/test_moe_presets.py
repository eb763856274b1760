"""The MoE configs the runtimes train: their checks, their full shapes, and what the memory plan counts."""

from __future__ import annotations

import math

import pytest

from ragged import RaggedError
from ragged.models import (
    MOE_CONFIGS,
    MoeConfig,
    flops_per_token,
    memory_plan,
    model_shapes,
    moe_shapes,
    trained_llama,
    trained_model,
    trained_shapes,
)


def tensors(shapes) -> dict:
    return dict(t for unit in shapes.units for t in unit.tensors)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"scoring": "relu"}, "MoeConfig.scoring='relu'"),
    ({"experts": "stacked"}, "MoeConfig.experts='stacked'"),
    ({"top_k": 9}, "MoeConfig.top_k=9: must be between 1 and n_experts=8"),
    ({"n_dense_layers": 1}, "dense_ffn_dim > 0"),
    ({"n_dense_layers": 2, "dense_ffn_dim": 8}, "n_dense_layers=2 must be below n_layers=2"),
])
def test_bad_configs_are_refused_with_the_field_named(kwargs, message):
    with pytest.raises(RaggedError, match=message.replace("(", r"\(").replace(")", r"\)")):
        MoeConfig(256, 64, 2, 4, 2, 16, **{"n_experts": 8, "top_k": 2, "expert_dim": 32, **kwargs})


def test_mixtral_is_the_published_model_tensor_for_tensor():
    """Mixtral 8x7B is the llama attention with 8 SwiGLU experts: every shape equals the core preset's
    (46.70 B parameters); only the router's name differs (``gate`` in the preset)."""
    ours = tensors(moe_shapes("mixtral-8x7b", MOE_CONFIGS["mixtral-8x7b"]))
    preset = tensors(model_shapes("mixtral-8x7b"))
    rename = {n.replace("feed_forward.gate.", "feed_forward.router."): s for n, s in preset.items()}
    assert ours == rename
    assert sum(math.prod(s) for s in ours.values()) == 46_702_792_704


@pytest.mark.parametrize(("name", "moe_layers"), [("gpt-oss-120b", 36), ("deepseek-v3", 58)])
def test_full_presets_hold_every_expert_tensor_of_the_real_model(name, moe_layers):
    """The expert tensors equal the public model's (``model_shapes``), only the attention is the llama's."""
    c = MOE_CONFIGS[name]
    ours = tensors(moe_shapes(name, c))
    preset = tensors(model_shapes(name))
    if c.experts == "fused":
        pairs = [(n, n.replace(".feed_forward.", ".mlp.")) for n in ours if ".experts." in n]
    else:
        pairs = [(n, n.replace(".feed_forward.", ".mlp.").replace(".w1.", ".gate_proj.")
                  .replace(".w3.", ".up_proj.").replace(".w2.", ".down_proj."))
                 for n in ours if ".experts." in n or ".shared_expert." in n]
        pairs = [(a, b.replace(".shared_expert.", ".shared_experts.")) for a, b in pairs]
    assert len(pairs) == moe_layers * (4 if c.experts == "fused" else 3 * (c.n_experts + 1))
    assert all(ours[a] == preset[b] for a, b in pairs)


@pytest.mark.parametrize("name", list(MOE_CONFIGS))
def test_memory_plan_counts_the_full_shapes_expert_tensors_included(name):
    c, described = trained_model(name)
    assert isinstance(c, MoeConfig) and f"{c.n_experts} {c.experts} experts" in described
    shapes = trained_shapes(name, c)
    assert shapes == moe_shapes(name, c)
    plan = memory_plan(name, c, 1, optimizer="adamw", seq_len=16)
    assert plan.numel == shapes.numel
    assert (plan.params, plan.grads, plan.optimizer_state) == (4 * plan.numel, 4 * plan.numel, 8 * plan.numel)
    # A token goes through top_k experts (and the shared one): the FLOPs are the dense stand-in's, whose
    # FFN is that wide, plus the router's matmul; dense first layers are as wide as that already.
    dense, _ = trained_llama(name)
    moe_layers = c.n_layers - c.n_dense_layers
    assert dense.ffn_dim == c.active_ffn_dim
    assert flops_per_token(c, 64) == pytest.approx(
        flops_per_token(dense, 64) + 6 * moe_layers * c.n_experts * c.dim
        + 6 * c.n_dense_layers * 3 * c.dim * (c.dense_ffn_dim - c.active_ffn_dim), rel=1e-12)
