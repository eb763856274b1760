"""DCP checkpoints of the MoE decoders move between expert-parallel layouts and world sizes.

mixtral-tiny (one module per expert) and gpt-oss-tiny (fused expert tensors) train two AdamW steps at
(ep, fsdp) = (2, 2) on 4 gloo ranks, save model and optimizer with ``save_dcp_checkpoint``, and go on for
the remaining three steps after loading at (ep, fsdp) = (1, 4) on the same 4 ranks, or on 2 ranks at
(1, 2) and as plain FSDP (``parallelize`` alone). The checkpoint holds the one-process names and shapes
(EP rank 1's ``experts.0`` is saved as ``experts.4``; a fused slice as the whole ``[E, ...]`` tensor), and
every resumed run equals the uninterrupted single-process reference of the same per-step rank batches
(tests/torch_backend/_moe_workers.py), with routing that leaves experts idle as there.

Bounds: those of test_fsdp_moe.py. Every run and reference trains in float64 (masters, compute, gloo's
reductions, the checkpoint): an expert's gradient is summed in another order than in one process, before
and after the checkpoint (the checkpoint itself moves bits), which float64 keeps far under
``tests.parity.float64_rtol`` of the steps, losses and parameters alike. A wrong name (a rank's experts
loaded into another's), a lost optimizer moment or a step counter restarted moves parameters by 1e-3 or
more (Adam's first steps are lr-sized, 1e-2 on weights of scale 0.02). Measured: losses at most 1.6e-16,
parameters 2.7e-15 (against 1.1e-9). Each world size's references (one per model) are trained once, on as
many ranks side by side (``_dist.shared``).
"""

from __future__ import annotations

import functools
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh

from tests.parity import float64_rtol
from tests.torch_backend import _moe_workers as W
from tests.torch_backend._dist import launch, shared

RTOL = float64_rtol(W.STEPS)

MODELS = ("mixtral-tiny", "gpt-oss-tiny")
SAVE_AT, SAVE_WORLD = 2, 4  # steps before the checkpoint, ranks that save it
RESUMED = {4: ("ep1",), 2: ("ep1", "fsdp")}  # layouts loaded at each world size


def _sharded(name: str, world: int, layout: str):
    """The model of ``name`` under ``layout`` (``epN``: (N, world / N) then ``parallelize``; ``fsdp``:
    ``parallelize`` alone), its AdamW and its EP mesh (None without)."""
    from torch_backend.models import parallelize
    from torch_backend.models.expert_parallel import expert_parallel

    model = W.build(name, W.FULL)
    ep_mesh = None
    if layout.startswith("ep"):
        ep = int(layout[2:])
        ep_mesh = init_device_mesh("cpu", (ep, world // ep), mesh_dim_names=("ep", "fsdp"))
        expert_parallel(model, ep_mesh)
    parallelize(model, init_device_mesh("cpu", (world,)))
    return model, torch.optim.AdamW(model.parameters(), lr=W.LR, weight_decay=W.WEIGHT_DECAY), ep_mesh


def _reference(name: str, world: int) -> tuple[list[float], dict]:
    """The uninterrupted single-process run of what was saved at SAVE_WORLD ranks and resumed at ``world``."""
    return W.reference(name, (SAVE_WORLD,) * SAVE_AT + (world,) * (W.STEPS - SAVE_AT), W.FULL)


def _errors(name: str, world: int, layout: str, path: str, rank: int, reference: tuple) -> dict:
    """Load ``path`` under ``layout``, train the remaining steps; relative errors from ``reference``."""
    from torch_backend.fsdp import load_dcp_checkpoint

    model, opt, ep_mesh = _sharded(name, world, layout)
    load_dcp_checkpoint(path, model, opt)
    losses = W.train(model, opt, name, rank, world, range(SAVE_AT, W.STEPS))
    want_losses, want = reference
    params = W.full_params(model)
    got, ref = (params, want) if ep_mesh is None else W.held_and_reference(params, name, ep_mesh, want)
    return {"loss": max(abs(a - b) / abs(b) for a, b in zip(losses, want_losses[SAVE_AT:])),
            "params": W.rel_errors(got, ref)}


def _guarded(out: dict, label: str, fn) -> None:
    try:
        out[label] = fn()
    except BaseException:
        out[label] = {"traceback": traceback.format_exc()}


def save_and_resume(rank: int, world: int, root: str) -> dict:
    """At 4 ranks: train at (2, 2), save, and resume at (1, 4)."""
    from torch_backend.fsdp import save_dcp_checkpoint

    out: dict = {}
    for name in MODELS:
        def save(name=name):
            model, opt, _ = _sharded(name, world, "ep2")
            W.train(model, opt, name, rank, world, range(SAVE_AT))
            save_dcp_checkpoint(f"{root}/{name}", model, opt)

        _guarded(out, f"{name}/save", save)
    return out | resume(rank, world, root)


def resume(rank: int, world: int, root: str) -> dict:
    """Load each model's checkpoint under every layout of this world size and train on."""
    out: dict = {}
    try:  # one reference per model, each on its own rank
        refs = shared({name: functools.partial(_reference, name, world) for name in MODELS})
    except BaseException:
        refs = {}
        failed = {"traceback": traceback.format_exc()}
    for name in MODELS:
        for layout in RESUMED[world]:
            _guarded(out, f"{name}/{layout}",
                     lambda n=name, lay=layout: _errors(n, world, lay, f"{root}/{n}", rank, refs[n])
                     if refs else failed)
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[str, list[dict]]:
    root = str(tmp_path_factory.mktemp("moe_dcp"))
    return root, launch(__file__, "save_and_resume", SAVE_WORLD, root)


@pytest.fixture(scope="module")
def resumed_at_two(saved) -> list[dict]:
    return launch(__file__, "resume", 2, saved[0])


def _result(ranks: list[dict], case: str) -> dict:
    errors = [f"rank {r}: {res.get(case, res.get('<worker>'))}" for r, res in enumerate(ranks)
              if "<worker>" in res or res.get(case) is not None and "traceback" in res[case]]
    if errors:
        raise AssertionError("\n".join(errors))
    return ranks[0][case]


@pytest.mark.parametrize("name", MODELS)
def test_the_checkpoint_holds_one_process_names_and_shapes(saved, name):
    from torch_backend.models import MoEDecoder

    _result(saved[1], f"{name}/save")
    meta = dcp.FileSystemReader(str(Path(saved[0]) / name)).read_metadata().state_dict_metadata
    got = {k.removeprefix("model."): tuple(m.size) for k, m in meta.items() if k.startswith("model.")}
    want = {n: tuple(p.shape) for n, p in MoEDecoder(W.config(name)).named_parameters()}
    assert got == want
    # Adam's moments of the experts of both EP ranks, under their global names and whole shapes
    moments = {k for k in meta if k.startswith("optim.") and ".experts." in k and k.endswith(".exp_avg")}
    assert {k.removeprefix("optim.").removesuffix(".exp_avg") for k in moments} <= set(want)
    assert any(".experts.7." in k or ".experts.gate_up_proj." in k for k in moments), sorted(moments)


@pytest.mark.parametrize("name", MODELS)
def test_saved_at_ep2_fsdp2_resumes_at_ep1_fsdp4_like_single_process(saved, name):
    r = [_result(saved[1], f"{name}/ep1")] + [res[f"{name}/ep1"] for res in saved[1][1:]]
    assert all(x["loss"] <= RTOL and x["params"] <= RTOL for x in r), r


@pytest.mark.parametrize("layout", RESUMED[2])
@pytest.mark.parametrize("name", MODELS)
def test_saved_at_four_ranks_resumes_at_two_like_single_process(resumed_at_two, name, layout):
    case = f"{name}/{layout}"
    r = [_result(resumed_at_two, case)] + [res[case] for res in resumed_at_two[1:]]
    assert all(x["loss"] <= RTOL and x["params"] <= RTOL for x in r), r
