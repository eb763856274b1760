"""What test_moe_optim runs in each gloo worker: 8-bit Adam and Muon on the MoE decoders under expert
parallelism + FSDP, against single-process training with the same optimizer.

The models, data (experts forced empty on some ranks, unused everywhere at step 0, or on whole EP ranks
with ``+skewed``), the single-process reference and the comparison are ``_moe_workers``'s; only the
optimizer changes: ``Adam8bit`` with every tensor planned by ``ragged.quant.tile_granularity`` (on the
experts' ``fsdp`` unit too), ``Muon`` with whole matrices to NS devices or (``max_imbalance=1.0``) split
over groups, the experts' matrices too on one MoE layer of 6 experts (``split_expert_checks``). Each Muon
case also returns where Muon orthogonalizes each matrix and which expert matrices a shard boundary cuts.
Muon trains in float64 (``_moe_workers.FULL``: it computes in at least its parameters' dtype); 8-bit Adam in
fp32 (its moments are 8-bit codes of fp32 values), with its reference also trained in other summation
orders (``ep_case``'s ``spread_of``).
"""

from __future__ import annotations

import ragged.muon
import ragged.quant
from tests.torch_backend import _moe_workers as W
from tests.torch_backend._dist import run_cases


def tiles(_name: str, shape: tuple[int, ...]):
    return ragged.quant.tile_granularity(shape)


def adam8bit(model):
    from torch_backend.optim import Adam8bit

    return Adam8bit(model.named_parameters(), lr=W.LR, weight_decay=W.WEIGHT_DECAY)


def muon(max_imbalance: float | None, made: list):
    """Muon (AdamW at the suite's settings for the rest); each optimizer built is appended to ``made``."""
    from torch_backend.optim import Muon

    def make(model):
        opt = Muon(model.named_parameters(), lr=0.02, weight_decay=W.WEIGHT_DECAY, adamw_lr=W.LR,
                   max_imbalance=max_imbalance)
        made.append(opt)
        return opt

    return make


def ns_devices(opt, model_params) -> dict[str, list[tuple[int, ...]]]:
    """``{parameter: devices of each of its matrices}`` (one entry for a 2-D weight, E for a stack)."""
    out = {}
    for name, p in model_params:
        if ragged.muon.muon_matrices(name, tuple(p.shape)):
            out[name] = [opt.ns_devices(p, None if p.ndim == 2 else e)
                         for e in range(1 if p.ndim == 2 else p.shape[0])]
    return out


def expert_matrices_across_shards(model_params) -> list[tuple[str, int]]:
    """The experts' matrices that a shard boundary cuts, as ``(parameter, matrix index)`` (index 0 for a
    2-D weight, as in ``ns_devices``): pieces of one matrix on several ``fsdp`` ranks, which Muon's
    gather joins (``ragged.muon.matrix_holdings``)."""
    out = []
    for name, p in model_params:
        if ".experts." not in name or not ragged.muon.muon_matrices(name, tuple(p.shape)):
            continue
        stack = (1, *p.shape) if p.ndim == 2 else tuple(p.shape)
        ranges = tuple(((a, b),) for a, b in p.placements[0].core.ranges(tuple(p.shape), name))
        out += [(name, e) for e in range(stack[0])
                if sum(1 for h in ragged.muon.matrix_holdings(ranges, stack, e, name)[0] if h) > 1]
    return out


def muon_case(name: str, rank: int, world: int, ep: int, max_imbalance: float | None) -> dict:
    made: list = []
    out = W.ep_case(name, rank, world, ep, optimizer=muon(max_imbalance, made), full=W.FULL)
    sharded = made[0]  # the EP run's optimizer (the reference's comes after it)
    params = [(n, p) for group in sharded.param_groups for n, p in zip(group["param_names"], group["params"])]
    out["ns_devices"] = ns_devices(sharded, params)
    out["expert_matrices_across_shards"] = expert_matrices_across_shards(params)
    return {**out, "skewed": name.endswith(W.SKEWED)}


def adam8bit_case(name: str, rank: int, world: int, ep: int) -> dict:
    return {**W.ep_case(name, rank, world, ep, optimizer=adam8bit, granularity=tiles, spread_of="full"),
            "skewed": name.endswith(W.SKEWED)}


def checks(rank: int, world: int) -> dict:
    cases = {}
    for name in ("mixtral-tiny", "gpt-oss-tiny", f"gpt-oss-tiny{W.SKEWED}"):
        cases[f"{name}/adam8bit"] = lambda name=name: adam8bit_case(name, rank, world, 2)
        cases[f"{name}/muon"] = lambda name=name: muon_case(name, rank, world, 2, None)
    for name in ("mixtral-tiny", "gpt-oss-tiny"):
        cases[f"{name}/muon-split"] = lambda name=name: muon_case(name, rank, world, 2, 1.0)
    return run_cases(cases)


def split_expert_checks(rank: int, world: int) -> dict:
    """Muon with ``max_imbalance=1.0`` on one MoE layer of 6 experts: an EP rank's 3 experts' matrices do
    not balance whole over its 2 fsdp ranks, so they split too (a stack's matrix ``e`` on its own). A launch
    of its own: split Newton-Schulz is about a thousand small collectives per case, slow on loaded CPUs."""
    return run_cases({f"{name}{W.ONE_LAYER_6_EXPERTS}/muon-split":
                      lambda name=name: muon_case(f"{name}{W.ONE_LAYER_6_EXPERTS}", rank, world, 2, 1.0)
                      for name in ("mixtral-tiny", "gpt-oss-tiny")})
