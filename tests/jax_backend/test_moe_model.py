"""The flax MoE decoders against float64 numpy and against the torch ones, from one neutral checkpoint.

Bounds. Against numpy: as tests/torch_backend/test_moe_model.py (1e-5 of the largest output, routing
exact). Torch against JAX: both compute in fp32 and differ only in summation order (``index_add`` over the
experts that got tokens against a dense one-hot combine; SDPA against an einsum softmax). Every logit is
about 3 layers x ~10 chained fp32 reductions of up to 96 terms, each off by a few 2^-24 of its scale:
1e-5 of the largest logit leaves two orders of margin over the measured 3e-7, while a token sent to a
different expert moves logits by 1e-2 or more. The aux loss is a sum of ``N E`` fp32 products: 1e-6.

An idle expert (no token chose it) is where the stacks' training differs, each as its own framework
trains one process: torch autograd leaves a per-expert module outside the graph (``.grad`` None) and
``torch.optim.AdamW`` skips it, while ``jax.grad`` gives it an exact zero and ``optax.adamw`` still applies
weight decay (and momentum, after the first step); a fused torch tensor of which some expert ran gets the
zero too, so there the stacks agree. Tested on one step from zero Adam moments, where a zero gradient's
update is the decay alone: ``p (1 - lr wd)``, one fp32 rounding each of the product and the difference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from flax import nnx

import torch_backend
from jax_backend import load_neutral_params
from jax_backend._names import fqn
from jax_backend.models import model_params
from jax_backend.models.moe import MoEDecoder, load_balancing_loss, moe_loss
from ragged.models import MOE_CONFIGS, moe_shapes
from tests.moe_references import load_balancing_loss as numpy_aux
from tests.moe_references import moe_ffn, route
from torch_backend.models.moe import MoEDecoder as TorchMoEDecoder
from torch_backend.models.moe import moe_loss as torch_moe_loss

TINY = ["mixtral-tiny", "gpt-oss-tiny", "deepseek-v3-tiny"]


def with_params(model: nnx.Module, params: dict[str, np.ndarray]) -> nnx.Module:
    """A copy of ``model`` holding ``params`` (by FQN)."""
    graphdef, state = nnx.split(model, nnx.Param)
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    values = [jnp.asarray(params[fqn(path)]) for path, _ in leaves]
    return nnx.merge(graphdef, jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(state), values))


def from_torch(name: str, tmp_path, router_scale: float = 1.0) -> tuple[TorchMoEDecoder, MoEDecoder]:
    """The torch model (``init_weights(0)``), and the flax model loaded from its neutral checkpoint."""
    c = MOE_CONFIGS[name]
    torch_model = TorchMoEDecoder(c)
    torch_model.init_weights(0)
    with torch.no_grad():
        for n, p in torch_model.named_parameters():
            if ".router." in n:
                p.mul_(router_scale)
    torch_backend.save_neutral_checkpoint(tmp_path / name, torch_model)
    return torch_model, with_params(MoEDecoder(c, rngs=nnx.Rngs(1)), load_neutral_params(tmp_path / name))


@pytest.mark.parametrize("name", TINY)
def test_parameters_are_the_core_shapes(name):
    c = MOE_CONFIGS[name]
    graphdef, state = nnx.split(MoEDecoder(c, rngs=nnx.Rngs(0)), nnx.Param)
    got = {fqn(path): tuple(leaf.shape) for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]}
    assert got == dict(t for unit in moe_shapes(name, c).units for t in unit.tensors)


@pytest.mark.parametrize("name", TINY)
def test_router_aux_loss_and_moe_feed_forward_match_numpy(name, tmp_path):
    c = MOE_CONFIGS[name]
    _, model = from_torch(name, tmp_path, router_scale=25.0)  # scores of order 1: top-k gaps above rounding
    layer = model.layers[c.n_dense_layers].feed_forward
    x = np.random.default_rng(0).standard_normal((48, c.dim)).astype(np.float32)
    params = {n.removeprefix(f"layers.{c.n_dense_layers}."): np.asarray(v, np.float64)
              for n, v in load_neutral_params(tmp_path / name).items()}
    want_w, want_e, want_p = route(x.astype(np.float64), params["feed_forward.router.weight"],
                                   params.get("feed_forward.router.bias"), c)
    ranked = np.sort(want_p, -1)[:, ::-1]
    assert (ranked[:, c.top_k - 1] - ranked[:, c.top_k]).min() > 1e-6  # no top-k tie within fp32 rounding
    weights, experts, probs = layer.router(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(experts), want_e)
    np.testing.assert_allclose(np.asarray(weights), want_w, rtol=1e-5, atol=0)
    np.testing.assert_allclose(np.asarray(probs), want_p, rtol=1e-5, atol=0)
    assert float(load_balancing_loss(probs, experts)) == pytest.approx(numpy_aux(want_p, want_e), rel=1e-6)
    out, aux = layer(jnp.asarray(x).reshape(6, 8, c.dim))
    want, want_aux = moe_ffn(x.astype(np.float64), params, c)
    got = np.asarray(out).reshape(48, c.dim)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    assert float(aux) == pytest.approx(want_aux, rel=1e-6)


@pytest.mark.parametrize("name", TINY)
def test_torch_and_jax_give_the_same_logits_and_aux_loss_from_one_checkpoint(name, tmp_path):
    torch_model, model = from_torch(name, tmp_path)
    tokens = np.random.default_rng(0).integers(0, 256, size=(2, 16))
    logits, aux = model(jnp.asarray(tokens))
    want_logits, want_aux = (t.detach().numpy() for t in torch_model(torch.from_numpy(tokens)))
    np.testing.assert_allclose(np.asarray(logits), want_logits, rtol=0, atol=1e-5 * np.abs(want_logits).max())
    assert float(aux) == pytest.approx(float(want_aux), rel=1e-6)
    assert float(aux) > 1.0  # tokens routed unevenly: the loss is not its balanced minimum



def idle_expert_tensors(c, chosen: list[set[int]], names) -> list[tuple[str, slice | int]]:
    """``(fqn, index)`` of every idle expert's parameters: a whole per-expert tensor or a fused row."""
    out = []
    for i, used in enumerate(chosen, start=c.n_dense_layers):
        assert len(used) < c.n_experts, used  # some expert of every MoE layer is idle
        prefix = f"layers.{i}.feed_forward.experts."
        for e in sorted(set(range(c.n_experts)) - used):
            if c.experts == "modules":
                out += [(n, slice(None)) for n in names if n.startswith(f"{prefix}{e}.")]
            else:
                out += [(n, e) for n in names if n.startswith(prefix)]
    return out


@pytest.mark.parametrize("name", ["mixtral-tiny", "gpt-oss-tiny"])
def test_an_idle_expert_is_skipped_by_torch_adamw_and_decayed_by_optax(name, tmp_path):
    c, lr, wd = MOE_CONFIGS[name], 1e-2, 0.1
    decay_rtol = 4 * 2.0**-24  # p (1 - lr wd): the product, the difference and the reference's own product
    torch_model, model = from_torch(name, tmp_path)
    tokens = np.full((2, 17), 7)  # one token everywhere: every position routes alike, top_k experts run
    x, y = tokens[:, :-1], tokens[:, 1:]
    chosen: list[set[int]] = []
    for layer in torch_model.layers[c.n_dense_layers:]:
        layer.feed_forward.router.register_forward_hook(
            lambda _m, _args, out: chosen.append(set(out[1].flatten().tolist())))
    before = {n: p.detach().clone() for n, p in torch_model.named_parameters()}
    opt = torch.optim.AdamW(torch_model.parameters(), lr=lr, weight_decay=wd)
    torch_moe_loss(torch_model(torch.from_numpy(x)), torch.from_numpy(y), c.aux_loss_coef).backward()
    opt.step()
    torch_after = {n: p.detach() for n, p in torch_model.named_parameters()}
    graphdef, params = nnx.split(model, nnx.Param)
    grads = jax.grad(lambda p: moe_loss(nnx.merge(graphdef, p)(jnp.asarray(x)), jnp.asarray(y),
                                        c.aux_loss_coef))(params)
    tx = optax.adamw(lr, weight_decay=wd)
    updates, _ = tx.update(grads, tx.init(params), params)
    jax_after = model_params(nnx.merge(graphdef, optax.apply_updates(params, updates)))
    jax_grads = {fqn(path): np.asarray(g) for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]}
    idle = idle_expert_tensors(c, chosen, before)
    assert idle
    for n, row in idle:
        was = before[n][row].numpy()
        decayed = was * np.float32(1 - lr * wd)
        assert not jax_grads[n][row].any(), n  # an exact zero gradient on JAX
        np.testing.assert_allclose(np.asarray(jax_after[n][row]), decayed, rtol=decay_rtol, err_msg=n)
        if c.experts == "modules":  # no gradient: AdamW leaves it as it was
            assert torch.equal(torch_after[n][row], before[n][row]), n
        else:  # a fused tensor's zero rows: decayed as on JAX
            np.testing.assert_allclose(torch_after[n][row].numpy(), decayed, rtol=decay_rtol, err_msg=n)
