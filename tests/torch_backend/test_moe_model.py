"""The torch MoE decoders against float64 numpy (``tests/moe_references.py``) and the core's shapes.

Bound: fp32 against float64. Each output element is a few chained fp32 dot products of at most
``2 expert_dim = 96`` terms (router, gate/up, down, the weighted sum over ``top_k`` slots); each rounds to
at most ``terms x 2^-24`` of its scale (6e-6 for 96 terms, worst case), so 1e-5 of the output's largest
magnitude holds while a wrong expert, weight or slot is off by 1e-2 or more. The loss is one fp32 sum of
``N E`` products: 1e-6 relative. Routing is compared exactly (the cases keep every top-k gap above 1e-6,
checked: scores are below 1, so fp32 rounds them by 1e-7 at most and cannot reorder them).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ragged.models import MOE_CONFIGS, MoeConfig, moe_shapes
from tests.moe_references import load_balancing_loss, moe_ffn, route
from torch_backend.models.moe import MoEDecoder, moe_loss

TINY = ["mixtral-tiny", "gpt-oss-tiny", "deepseek-v3-tiny"]


def layer_params(model: MoEDecoder, layer: int) -> dict[str, np.ndarray]:
    prefix = f"layers.{layer}."
    return {n.removeprefix(prefix): p.detach().double().numpy() for n, p in model.named_parameters()
            if n.startswith(prefix)}


def tokens(n: int, dim: int, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32))


def router_with_margin(c: MoeConfig, model: MoEDecoder, x: torch.Tensor) -> int:
    """Scale the first MoE layer's router until its top-k choices are well separated; returns the layer."""
    layer = c.n_dense_layers
    router = model.layers[layer].feed_forward.router
    with torch.no_grad():
        router.weight.mul_(25.0)  # init's 0.02 -> 0.5: scores of order 1, gaps well above rounding
        if router.bias is not None:
            router.bias.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(1))
    scores = router(x)[2].sort(-1, descending=True).values
    gaps = scores[:, c.top_k - 1] - scores[:, c.top_k]
    assert gaps.min() > 1e-6, f"a top-k tie within rounding: gap {gaps.min():.2e}"
    return layer


@pytest.mark.parametrize("name", TINY)
def test_parameters_are_the_core_shapes_in_order(name):
    c = MOE_CONFIGS[name]
    got = [(n, tuple(p.shape)) for n, p in MoEDecoder(c).named_parameters()]
    assert got == [t for unit in moe_shapes(name, c).units for t in unit.tensors]


@pytest.mark.parametrize("name", TINY)
def test_router_and_aux_loss_match_numpy(name):
    c = MOE_CONFIGS[name]
    model = MoEDecoder(c)
    model.init_weights(0)
    x = tokens(48, c.dim)
    layer = router_with_margin(c, model, x)
    router = model.layers[layer].feed_forward.router
    weights, experts, probs = router(x)
    p = layer_params(model, layer)
    want_w, want_e, want_p = route(x.double().numpy(), p["feed_forward.router.weight"],
                                   p.get("feed_forward.router.bias"), c)
    np.testing.assert_array_equal(experts.numpy(), want_e)
    np.testing.assert_allclose(weights.detach().numpy(), want_w, rtol=1e-5, atol=0)
    np.testing.assert_allclose(probs.detach().numpy(), want_p, rtol=1e-5, atol=0)
    from torch_backend.models.moe import load_balancing_loss as torch_aux

    got = torch_aux(probs, experts).item()
    assert got == pytest.approx(load_balancing_loss(want_p, want_e), rel=1e-6)
    assert got >= 1.0 - 1e-6  # Cauchy-Schwarz-like: balanced routing is the minimum (up to ties)


def test_aux_loss_closed_forms():
    """Every token to one expert with probability ~1: the loss is E; a perfectly even split with uniform
    probabilities: 1."""
    from torch_backend.models.moe import load_balancing_loss as torch_aux

    e = 8
    collapsed = torch.zeros(16, e)
    collapsed[:, 3] = 1.0
    assert torch_aux(collapsed, torch.full((16, 1), 3)).item() == pytest.approx(e)
    even = torch.full((16, e), 1.0 / e)
    assert torch_aux(even, torch.arange(16).reshape(8, 2) % e).item() == pytest.approx(1.0)


@pytest.mark.parametrize("name", TINY)
def test_moe_feed_forward_matches_numpy(name):
    c = MOE_CONFIGS[name]
    model = MoEDecoder(c)
    model.init_weights(0)
    x = tokens(48, c.dim)
    layer = router_with_margin(c, model, x)
    out, aux = model.layers[layer].feed_forward(x.view(6, 8, c.dim))
    want, want_aux = moe_ffn(x.double().numpy(), layer_params(model, layer), c)
    got = out.detach().reshape(48, c.dim).numpy()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    assert aux.item() == pytest.approx(want_aux, rel=1e-6)


@pytest.mark.parametrize("name", TINY)
def test_only_experts_with_tokens_run_and_empty_ones_get_no_gradient(name):
    """A row of one repeated token: attention mixes equal values, so every position routes alike and only
    ``top_k`` experts run per layer; the others stay out of autograd (``.grad`` None, or an exact zero
    slice of the fused tensors)."""
    c = MOE_CONFIGS[name]
    model = MoEDecoder(c)
    model.init_weights(0)
    ran: list[int] = []
    for moe in (layer.feed_forward for layer in model.layers[c.n_dense_layers:]):
        orig = moe.experts.expert
        moe.experts.expert = lambda e, x, orig=orig: ran.append(e) or orig(e, x)
    row = torch.full((1, 9), 7)
    loss = moe_loss(model(row[:, :-1]), row[:, 1:], c.aux_loss_coef)
    loss.backward()
    assert len(ran) == c.top_k * (c.n_layers - c.n_dense_layers)
    moe = model.layers[c.n_dense_layers].feed_forward
    idle = sorted(set(range(c.n_experts)) - set(ran[:c.top_k]))
    assert idle
    for e in idle:
        if c.experts == "fused":
            assert torch.count_nonzero(moe.experts.down_proj.grad[e]) == 0
        else:
            assert moe.experts[e].w1.weight.grad is None


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("ep,fsdp,granularity", [(2, 2, None), (4, 1, None), (2, 4, "rows:4"),
                                                 (4, 2, "tiles:2x16")])
def test_an_ep_ranks_experts_unit_is_the_cores_expert_parallel_plan(name, ep, fsdp, granularity):
    """What ``expert_parallel`` hands to ``fully_shard`` for EP rank 1 (its experts, local names) plans, by
    ``plan_module``, to exactly the core's ``plan_expert_parallel(...).local``: the Layout the JAX backend
    composes over (ep, fsdp); the global names torch writes in checkpoints are that plan's sources."""
    from ragged.models import plan_expert_parallel
    from torch_backend.fsdp import plan_module
    from torch_backend.models.expert_parallel import _keep_local_experts

    c = MOE_CONFIGS[name]
    if c.n_experts % ep:
        pytest.skip(f"{name} has {c.n_experts} experts")
    torch.manual_seed(0)
    model = MoEDecoder(c)
    n_local = c.n_experts // ep
    units = plan_expert_parallel(c, ep, fsdp, granularity or "rows:1")
    moe_layers = model.layers[c.n_dense_layers:]
    assert len(units) == len(moe_layers) > 0
    for layer, unit in zip(moe_layers, units):
        _keep_local_experts(layer.feed_forward.experts, n_local, 2 * n_local)
        assert plan_module(layer.feed_forward.experts, fsdp, granularity, root=model) == unit.local


@pytest.mark.parametrize("name", ["mixtral-tiny", "gpt-oss-tiny"])
def test_an_moe_layer_forward_reads_the_host_once(name):
    """The dispatch reads the per-expert counts once, whatever the number of experts that got tokens
    (a GPU sync each; a loop with one ``nonzero`` per expert would make ``1 + E`` of them)."""
    from tests.torch_backend.host_reads import host_reads

    c = MOE_CONFIGS[name]
    model = MoEDecoder(c)
    model.init_weights(0)
    moe = model.layers[c.n_dense_layers].feed_forward
    x = tokens(64, c.dim)
    chosen = moe.router(x)[1]
    assert len(chosen.unique()) == c.n_experts  # every expert got tokens: the old loop read 2 + E times
    with host_reads() as reads:
        moe(x[None])
    assert reads.total == 1, reads.counts
