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

Each case compiles the EP step and the reference (15 to 25 s on an idle 2-core machine), so
8-bit Adam runs on gpt-oss-tiny only (fused stacks, one-row tiles, EP ranks without tokens; the per-expert
model's tensors are plain matrices, and torch's test runs both), Muon on both. Lower ``max_imbalance``
splits every matrix (1.0: 44 groups), whose ring collectives took XLA:CPU 11 minutes to compile.

Bounds: both optimizers compute in fp32, so the spread of the single-device reference over
``SPREAD_ORDERS`` other summation orders of the same training (test_expert_parallel.reordered: the device
batches and their rows in another order; ``tests.parity.assert_within_spread``), on losses and on the
worst tensor's relative error. 8-bit Adam's orders often give the reference's losses bit for bit while a
code that flips moves its parameters, so its losses are bounded by what the orders move at all
(``tests.parity.floored_by``). Measured parameters 0.49 of the spread (8-bit Adam, 2.0e-4), 1.05 and
0.76 (Muon, gpt-oss-tiny and mixtral-tiny, 5e-6); losses 0 in all three (the run's losses are the
reference's bit for bit).
"""

from __future__ import annotations

import numpy as np
import pytest

import ragged.muon
import ragged.quant
from jax_backend.optim import adamw8bit, muon, muon_plan, shard_tiles
from tests.jax_backend import test_expert_parallel as T
from tests.jax_backend.jax_reference import SPREAD_ORDERS, params_distance, rel_err
from tests.parity import assert_within_spread, floored_by

EP, FSDP = 2, 4


def tiles(_name: str, shape: tuple[int, ...]):
    return ragged.quant.tile_granularity(shape)


def adam8bit(tiled=None):
    return adamw8bit(T.LR, weight_decay=0.1, tiles=tiled)


def muon_opt(plan=None):
    return muon(0.02, weight_decay=0.1, adamw_learning_rate=T.LR, plan=plan)


def assert_equal_training(name: str, full, on_shards_opt, granularity, losses_floored: bool) -> dict:
    """EP training with ``on_shards(on_shards_opt(fsdp))`` within the spread of single-device ``full``;
    returns the distances."""
    model = T.build(name)
    data = T.batches(model.config.vocab_size, FSDP)
    (want_losses, history), *orders = [T.train_reference(model, d, opt=full) for d in
                                       [data, *(T.reordered(data, seed) for seed in range(SPREAD_ORDERS))]]
    losses, params, _ = T.train_ep(T.build(name), data, EP, FSDP, 1, on_shards_opt=on_shards_opt,
                                   granularity=granularity)
    want = history[-1]

    def distances(run_losses, run_params) -> dict:
        return {"loss": rel_err(run_losses, want_losses), "params": params_distance(run_params, want)}

    spread = [distances(o[0], o[1][-1]) for o in orders]
    d = assert_within_spread(distances(losses, params), floored_by(spread) if losses_floored else spread)
    moved = [rel_err(want[k], history[0][k]) for k in want]
    assert np.median(moved) > 10 * d["params_spread"], (moved, d)  # the parameters moved well beyond it
    return d


def test_adamw8bit_under_expert_parallelism_equals_single_device():
    assert_equal_training("gpt-oss-tiny", adam8bit(),
                          lambda fsdp: adam8bit(shard_tiles(fsdp.layouts, fsdp.axis)), tiles, True)


@pytest.mark.parametrize("name,max_imbalance", [("gpt-oss-tiny", None), ("mixtral-tiny", 1.005)])
def test_muon_under_expert_parallelism_equals_single_device(name, max_imbalance):
    plans = []

    def plan(fsdp):
        plans.append(muon_plan(fsdp.layouts, fsdp.axis, max_imbalance=max_imbalance))
        return muon_opt(plans[-1])

    assert_equal_training(name, muon_opt(), plan, "rows:1", False)
    matrices = [m for ms in plans[0].matrices.values() for m in ms]
    experts = [m.name for m in matrices if ".experts." in m.name]
    assert experts and not any("bias" in n for n in experts), experts  # biases get AdamW
    if name == "gpt-oss-tiny":  # a fused stack is one matrix per expert
        assert all(n.endswith("]") for n in experts), experts
    split = [m.name for m in matrices if len(m.group) > 1]
    assert bool(split) == (max_imbalance is not None), split
