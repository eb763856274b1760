"""8-bit Adam and Muon under JAX expert parallelism (``parallelize_moe``) equal single-device training.

(ep, fsdp) = (2, 4) on 8 host devices, the models, data and single-device reference of
test_expert_parallel.py (per-expert mixtral-tiny; fused gpt-oss-tiny, whose first MoE layer routes every
token to EP rank 0's experts, so EP rank 1's receive nothing; step 0 reaches few experts), five steps with
the optimizer on the unit shards (``on_shards``) against the same optimizer on the whole model's pytree:

- ``adamw8bit`` with every tensor planned by ``ragged.quant.tile_granularity`` and ``shard_tiles`` of the
  composed layouts: each device quantizes the tiles of its pieces, the same tiles as the whole tensors'
  (a stack's tiles divide each expert's matrix, so the EP split cuts none);
- ``muon`` with ``muon_plan`` of the composed layouts (over the combined ``(ep, fsdp)`` axis: an expert's
  matrix may go to any device), whole matrices and (``max_imbalance=1.005``: the output head and the
  embedding) split groups; a fused stack is one matrix per expert and its biases get AdamW, in both runs
  (``ragged.muon.muon_matrices``).

Each case compiles the EP step and the reference (40 s, up to 3 minutes on the loaded 2-core machine), so
8-bit Adam runs on gpt-oss-tiny only (fused stacks, one-row tiles, EP ranks without tokens; the per-expert
model's tensors are plain matrices, and torch's test runs both), Muon on both. Lower ``max_imbalance``
splits every matrix (1.0: 44 groups), whose ring collectives took XLA:CPU 11 minutes to compile.

Bounds: as the torch EP test (tests/torch_backend/test_moe_optim.py). Muon 1e-4 (gradients summed in
another order, passed on by Newton-Schulz at about their relative size; measured 6.2e-6 gpt-oss-tiny,
5.2e-6 mixtral-tiny with splits). 8-bit Adam 2e-3: that rounding can move a moment across a code's
threshold, one code step of an element's step of lr = 1e-2 is ~2e-4 of a tensor's norm (measured 1.8e-4);
a tile other than the single-device one moves every element of it. Losses 1e-5 (test_expert_parallel.py's
RTOL; measured 8.6e-8).
"""

from __future__ import annotations

import numpy as np
import pytest

import ragged.muon
import ragged.quant
from jax_backend.optim import adamw8bit, muon, muon_plan, shard_tiles
from tests.jax_backend import test_expert_parallel as T
from tests.jax_backend.jax_reference import rel_err

EP, FSDP, MUON_RTOL, ADAM8BIT_RTOL = 2, 4, 1e-4, 2e-3


def tiles(_name: str, shape: tuple[int, ...]):
    return ragged.quant.tile_granularity(shape)


def adam8bit(tiled=None):
    return adamw8bit(T.LR, weight_decay=0.1, tiles=tiled)


def muon_opt(plan=None):
    return muon(0.02, weight_decay=0.1, adamw_learning_rate=T.LR, plan=plan)


def assert_equal_training(name: str, full, on_shards_opt, granularity, rtol: float) -> None:
    model = T.build(name)
    data = T.batches(model.config.vocab_size, FSDP)
    want_losses, history = T.train_reference(model, data, opt=full)
    losses, params, _ = T.train_ep(T.build(name), data, EP, FSDP, 1, on_shards_opt=on_shards_opt,
                                   granularity=granularity)
    np.testing.assert_allclose(losses, want_losses, rtol=T.RTOL)
    want = history[-1]
    errors = {k: rel_err(params[k], want[k]) for k in want}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= rtol, f"{worst}: relative error {errors[worst]:.3g} > {rtol}"
    moved = [rel_err(want[k], history[0][k]) for k in want]
    assert np.median(moved) > 10 * rtol, moved  # the parameters moved well beyond the bound


def test_adamw8bit_under_expert_parallelism_equals_single_device():
    assert_equal_training("gpt-oss-tiny", adam8bit(),
                          lambda fsdp: adam8bit(shard_tiles(fsdp.layouts, fsdp.axis)), tiles, ADAM8BIT_RTOL)


@pytest.mark.parametrize("name,max_imbalance", [("gpt-oss-tiny", None), ("mixtral-tiny", 1.005)])
def test_muon_under_expert_parallelism_equals_single_device(name, max_imbalance):
    plans = []

    def plan(fsdp):
        plans.append(muon_plan(fsdp.layouts, fsdp.axis, max_imbalance=max_imbalance))
        return muon_opt(plans[-1])

    assert_equal_training(name, muon_opt(), plan, "rows:1", MUON_RTOL)
    matrices = [m for ms in plans[0].matrices.values() for m in ms]
    experts = [m.name for m in matrices if ".experts." in m.name]
    assert experts and not any("bias" in n for n in experts), experts  # biases get AdamW
    if name == "gpt-oss-tiny":  # a fused stack is one matrix per expert
        assert all(n.endswith("]") for n in experts), experts
    split = [m.name for m in matrices if len(m.group) > 1]
    assert bool(split) == (max_imbalance is not None), split
