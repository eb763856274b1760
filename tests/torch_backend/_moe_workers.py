"""What test_fsdp_moe runs in each gloo worker: the MoE decoders under ``parallelize`` with empty experts.

Every case trains the tiny MoE presets (per-expert modules, fused experts, sigmoid router with a shared
expert and a dense first layer) for a few AdamW steps with one unit per decoder layer, the embedding, the
head and the root, each rank on its rows, and the same steps single-process (the reference). Rows 0 and
1 of every batch repeat one token: attention then mixes equal values, every position routes alike, and
the rank(s) holding them run only ``top_k`` experts per layer while the others run more; so experts go
empty on some ranks and not on others. At step 0 every row repeats one token but for a few positions (an
all-equal batch would leave attention's q and k projections a gradient that is exactly zero, whose
rounding noise Adam amplifies): few experts run, many are unused everywhere (``.grad`` None), and under
expert parallelism the experts of some EP ranks receive no token.

The reference is FSDP-free. Its loss is the mean of each rank's batch loss, computed apart, because the
load-balancing loss is a product of per-batch means (data-parallel training defines it per rank's
batch). Under the mixed-precision policy it applies the policy's casts and nothing else: every batch's
forward and backward run on a bf16 copy of the fp32 master, and the bf16 gradients are summed in fp32.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from ragged.models import MOE_CONFIGS
from tests.parity import SPREAD_ORDERS
from tests.torch_backend._dist import run_cases, shared
from tests.torch_backend._user_model_workers import rel_errors

MODELS = ("mixtral-tiny", "gpt-oss-tiny", "deepseek-v3-tiny")
EP_MODELS = MODELS[:2]  # the two storage styles: per-expert modules, fused 3-D experts with biases
STEPS, ROWS, SEQ, SEED, LR, WEIGHT_DECAY = 5, 4, 8, 0, 1e-2, 0.1  # 4 rows: an even split over 2 and 4 ranks


# The dtype of test_fsdp_moe's cases without a policy (masters, compute, gloo's reductions): parity far
# from rounding (tests/parity.py). The bf16 policy keeps fp32 masters; test_moe_optim's
# optimizers and test_moe_dcp stay fp32.
FULL = torch.float64
SKEWED = "+skewed"  # a router bias of +5 on experts 0 .. top_k-1 of every MoE layer: every token goes there
# one MoE layer of 6 experts: at ep 2 an EP rank holds 3, an odd number of equal expert matrices (3 or
# 3 + 3) for its 2 fsdp ranks, so whole-matrix NS devices cannot balance them (two layers would: 18, 6 + 6)
ONE_LAYER_6_EXPERTS = "+1-layer-6-experts"


def config(name: str):
    if name.endswith(ONE_LAYER_6_EXPERTS):
        preset = MOE_CONFIGS[name.removesuffix(ONE_LAYER_6_EXPERTS)]
        return dataclasses.replace(preset, n_layers=1, n_experts=6)
    return MOE_CONFIGS[name.removesuffix(SKEWED)]


def build(name: str, dtype: torch.dtype = torch.float32):
    """The model of ``name`` with its init, in ``dtype``; ``+skewed``: routing fixed on the first experts
    (the experts of the other EP ranks then receive nothing, every step)."""
    from torch_backend.models import MoEDecoder

    c = config(name)
    model = MoEDecoder(c)
    model.init_weights(SEED)
    model.to(dtype)
    if name.endswith(SKEWED):
        with torch.no_grad():
            for layer in model.layers[c.n_dense_layers:]:
                layer.feed_forward.router.bias[:c.top_k] += 5.0
    return model


def n_rows(world: int) -> int:
    """Rows of a batch: ``ROWS``, or one per rank on more ranks."""
    return max(ROWS, world)


def batch(step: int, vocab: int, world: int) -> torch.Tensor:
    """(n_rows(world), SEQ + 1) token ids; rows 0 and 1 are one token repeated (those ranks route alike), and
    at step 0 every row is but the last row's second half (few experts run: many are idle everywhere)."""
    rng = np.random.default_rng([SEED, step])
    rows = rng.integers(0, vocab, (n_rows(world), SEQ + 1))
    rows[:len(rows) if step == 0 else 2] = rng.integers(0, vocab)
    if step == 0:  # a few tokens differ: attention still gets a gradient (all-equal rows give none)
        rows[-1, SEQ // 2:] = rng.integers(0, vocab, SEQ // 2 + 1)
    return torch.from_numpy(rows)


def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)


def reference(name: str, world: int | tuple[int, ...], dtype: torch.dtype,
              optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer] = adamw,
              order: int | None = None, sum_dtype: torch.dtype | None = None) -> tuple[list[float], dict]:
    """Single-process training: each step, every rank's rows forward and backward apart on a ``dtype``
    copy of the master (``dtype`` itself, fp32 for bf16); gradients summed in the master's dtype and
    averaged; ``optimizer`` (AdamW) on the master. ``world``: the ranks, or the ranks of each step (a run
    resumed at another world size). ``order`` (a seed): the same training summed in another order, the
    ranks' batches taken in a permuted order and each one's rows permuted (every loss term is a mean over
    one rank's batch: the same losses and gradients, rounded otherwise). ``sum_dtype``: the ranks'
    gradients summed in it (bf16: each partial sum rounded to bf16) instead of the master's dtype."""
    from torch_backend.models import moe_loss

    c = config(name)
    master = build(name, torch.float32 if dtype == torch.bfloat16 else dtype)
    opt = optimizer(master)
    losses = []
    worlds = (world,) * STEPS if isinstance(world, int) else world
    for step, world in enumerate(worlds):
        step_loss, sums = 0.0, {}
        chunks = batch(step, c.vocab_size, world).chunk(world)
        if order is not None:
            rng = np.random.default_rng([order, step])
            chunks = [chunks[i][torch.from_numpy(rng.permutation(len(chunks[i])))]
                      for i in rng.permutation(world)]
        for rows in chunks:
            compute = copy.deepcopy(master).to(dtype)
            loss = moe_loss(compute(rows[:, :-1]), rows[:, 1:], c.aux_loss_coef)
            loss.backward()
            for k, (p, q) in enumerate(zip(master.parameters(), compute.parameters())):
                if q.grad is not None:  # an expert no row chose keeps .grad None, as in plain training
                    g = q.grad.to(sum_dtype or p.dtype) / world
                    sums[k] = g if k not in sums else sums[k] + g
            step_loss += loss.item() / world
        for k, p in enumerate(master.parameters()):
            if k in sums:
                p.grad = sums[k].to(p.dtype)
        opt.step()
        opt.zero_grad()
        losses.append(step_loss)
    return losses, full_params(master)


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().double()
            for n, p in model.named_parameters()}


def sharded(name: str, mesh, rank: int, world: int, bf16: bool, ep_mesh=None, optimizer=adamw,
            granularity=None, master: torch.dtype = torch.float32) -> tuple:
    """``parallelize`` (after ``expert_parallel`` on ``ep_mesh``, both with ``granularity``) the model
    built in ``master`` and train on this rank's rows with ``optimizer`` (AdamW).

    Returns the mean losses, the full parameters and the experts each MoE layer's router chose here per
    step (with ``ep_mesh``: and the rows this rank's experts received, per step and layer)."""
    from torch_backend import MixedPrecisionPolicy
    from torch_backend.models import parallelize
    from torch_backend.models.expert_parallel import expert_parallel

    c = config(name)
    model = build(name, master)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    if ep_mesh is not None:
        expert_parallel(model, ep_mesh, mp_policy=mp, granularity=granularity)
    parallelize(model, mesh, mp_policy=mp, granularity=granularity)
    routes: list[list[list[int]]] = []
    received: list[list[int]] = []  # expert parallelism: rows this rank's experts received, per layer
    for layer in model.layers[c.n_dense_layers:]:
        layer.feed_forward.router.register_forward_hook(
            lambda _m, _args, out: routes[-1].append(sorted(set(out[1].flatten().tolist()))))
        if ep_mesh is not None:  # runs after the dispatch hook: sees what arrived
            layer.feed_forward.experts.register_forward_pre_hook(
                lambda _m, args: received[-1].append(len(args[0])))
    opt = optimizer(model)
    losses = train(model, opt, name, rank, world, range(STEPS),
                   before_step=lambda: (routes.append([]), received.append([])))
    return losses, full_params(model), routes if ep_mesh is None else (routes, received)


def train(model, opt, name: str, rank: int, world: int, steps: range,
          before_step: Callable[[], object] = lambda: None) -> list[float]:
    """Optimizer steps ``steps`` of the sharded ``model`` on this rank's rows; the mean loss of each step."""
    from torch_backend.models import moe_loss

    c = config(name)
    n = n_rows(world) // world
    losses = []
    for step in steps:
        before_step()
        rows = batch(step, c.vocab_size, world)[rank * n:(rank + 1) * n]
        loss = moe_loss(model(rows[:, :-1]), rows[:, 1:], c.aux_loss_coef)
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss = loss.detach().double()
        dist.all_reduce(loss)
        losses.append(loss.item() / world)
    return losses


def reference_job(name: str, world: int, dtype: torch.dtype, order: int | None = None,
                  sum_dtype: torch.dtype | None = None, optimizer=adamw) -> tuple[tuple, Callable]:
    """``reference``'s training as a ``_dist.shared`` job, keyed by what it trains: the cases of a launch
    that compare with the same training name it alike (``with_references`` trains it once)."""
    key = (name, world, str(dtype), order, str(sum_dtype), optimizer.__name__)
    return key, functools.partial(reference, name, world, dtype, optimizer, order, sum_dtype)


def case_jobs(name: str, world: int, bf16: bool) -> dict[str, tuple]:
    """``case``'s references: ``{label: (key, job)}``."""
    jobs = {"full": reference_job(name, world, torch.float32 if bf16 else FULL)}
    if bf16:
        jobs |= {k: reference_job(name, world, torch.bfloat16, k) for k in (None, *range(SPREAD_ORDERS))}
    return jobs


def share(jobs: dict[str, tuple], refs: dict | None) -> dict:
    """``{label: result}`` of ``jobs`` (``{label: (key, job)}``): from ``refs`` (``{key: result}``, every
    reference of the launch trained at once), or trained now over the ranks."""
    if refs is None:
        refs = shared(dict(jobs.values()))
    return {label: refs[key] for label, (key, _) in jobs.items()}


def case(name: str, mesh, rank: int, world: int, bf16: bool, refs: dict | None = None) -> dict:
    """Trained in float64 (its reference ``full`` too), or under the bf16 policy with fp32 masters (then
    ``full`` is fp32 training, ``policy`` the FSDP-free policy reference, and ``orders`` that reference's
    SPREAD_ORDERS other orders' distances from it). ``refs``: the launch's references (``share``)."""
    full = torch.float32 if bf16 else FULL
    losses, params, routes = sharded(name, mesh, rank, world, bf16, master=full)
    out = {"routes": routes, "top_k": config(name).top_k, "n_experts": config(name).n_experts}
    refs = share(case_jobs(name, world, bf16), refs)
    if rank == 0:
        for label, key in [("full", "full")] + ([("policy", None)] if bf16 else []):
            want_losses, want_params = refs[key]
            out[label] = {"loss": loss_error(losses, want_losses), "params": rel_errors(params, want_params)}
        if bf16:
            policy_losses, policy = refs[None]
            out["orders"] = [{"loss": loss_error(refs[k][0], policy_losses),
                              "params": rel_errors(refs[k][1], policy)} for k in range(SPREAD_ORDERS)]
        out["losses"] = losses
    return out


def global_expert_names(params: dict, name: str, ep_mesh) -> dict:
    """This EP rank's experts under their global names (index or slice) for comparison with the reference."""
    c = config(name)
    n_local = c.n_experts // ep_mesh.size(0)
    lo = ep_mesh.get_local_rank("ep") * n_local
    out = {}
    for n, p in params.items():
        head, _, tail = n.partition(".experts.")
        if not tail:
            out[n] = p
        elif c.experts == "fused":
            out[n] = (lo, p)  # rows [lo, lo + n_local) of the reference's tensor
        else:
            local, _, rest = tail.partition(".")
            out[f"{head}.experts.{lo + int(local)}.{rest}"] = p
    return out


def ep_dtypes(bf16: bool, full: torch.dtype) -> dict[str, torch.dtype]:
    return {"full": full, **({"policy": torch.bfloat16} if bf16 else {})}


def ep_jobs(name: str, world: int, bf16: bool = False, optimizer=adamw, full: torch.dtype = torch.float32,
            spread_of: str | None = None) -> dict[str, tuple]:
    """``ep_case``'s references: ``{label: (key, job)}``."""
    dtypes = ep_dtypes(bf16, full)
    jobs = {label: reference_job(name, world, dtype, optimizer=optimizer) for label, dtype in dtypes.items()}
    if spread_of is not None:
        sums = torch.bfloat16 if spread_of == "policy" else None
        jobs |= {f"order {k}": reference_job(name, world, dtypes[spread_of], k, sums, optimizer)
                 for k in range(SPREAD_ORDERS)}
    return jobs


def ep_case(name: str, rank: int, world: int, ep: int, replicas: int = 1, bf16: bool = False, *,
            optimizer=adamw, granularity=None, full: torch.dtype = torch.float32,
            spread_of: str | None = None, refs: dict | None = None) -> dict:
    """Expert parallelism on an (ep, fsdp) mesh, every other parameter over all ranks; with ``replicas``
    (HSDP) on a (replicas, ep, fsdp) mesh, the rest on (replicas, ep * fsdp). fp32, or bf16 under the
    mixed-precision policy: then also compared with the policy reference, and that reference with fp32
    training (``policy_vs_full``: the policy's own distance, which FSDP2 and plain FSDP reproduce).
    Trained and referenced with ``optimizer`` (AdamW), sharded with ``granularity``; ``full``: the dtype of
    the master and of the full-precision reference (``full``), fp32 under the bf16 policy. ``spread_of``
    (``"full"`` or ``"policy"``): also that reference trained in SPREAD_ORDERS other orders (``reference``'s
    ``order``; the policy's with the ranks' bf16 gradients summed in bf16, as expert parallelism sums an
    expert's over every EP rank's tokens in one bf16 GEMM), and each one's distances from it (``orders``)
    over the tensors (or rows) this rank holds, as the run's: for ``tests.parity.assert_within_spread``
    over every rank's.
    The references are computed once, spread over the ranks (``_dist.shared``), or given: ``refs``, the
    launch's (``share``)."""
    fsdp = world // (replicas * ep)
    if replicas == 1:
        ep_mesh = init_device_mesh("cpu", (ep, fsdp), mesh_dim_names=("ep", "fsdp"))
        mesh = init_device_mesh("cpu", (world,))
    else:
        ep_mesh = init_device_mesh("cpu", (replicas, ep, fsdp), mesh_dim_names=("replicate", "ep", "fsdp"))
        mesh = init_device_mesh("cpu", (replicas, ep * fsdp))
    losses, params, (routes, received) = sharded(name, mesh, rank, world, bf16, ep_mesh, optimizer,
                                                 granularity, full)
    out = {"rank": rank, "routes": routes, "received": received, "top_k": config(name).top_k,
           "n_experts": config(name).n_experts}
    dtypes = ep_dtypes(bf16, full)
    refs = share(ep_jobs(name, world, bf16, optimizer, full, spread_of), refs)
    for label in dtypes:
        want_losses, want = refs[label]
        got, ref = held_and_reference(params, name, ep_mesh, want)
        out[label] = {"loss": loss_error(losses, want_losses), "params": rel_errors(got, ref)}
    if spread_of is not None:
        want_losses, want = refs[spread_of]
        _, ref = held_and_reference(params, name, ep_mesh, want)
        out["orders"] = []
        for k in range(SPREAD_ORDERS):
            order_losses, order = refs[f"order {k}"]
            _, held = held_and_reference(params, name, ep_mesh, order)
            out["orders"].append({"loss": loss_error(order_losses, want_losses),
                                  "params": rel_errors(held, ref)})
    if bf16:
        (full_losses, full_weights), (policy_losses, policy_weights) = refs["full"], refs["policy"]
        out["policy_vs_full"] = {"loss": loss_error(policy_losses, full_losses),
                                 "params": rel_errors(policy_weights, full_weights)}
    out["expert_numel_held"] = sum(p.numel() for n, p in got.items() if ".experts." in n)
    out["expert_numel_total"] = sum(p.numel() for n, p in want.items() if ".experts." in n)
    return out


def loss_error(losses: list[float], want: list[float]) -> float:
    """The worst step's relative loss error."""
    return max(abs(a - b) / abs(b) for a, b in zip(losses, want))


def held_and_reference(params: dict, name: str, ep_mesh, want: dict) -> tuple[dict, dict]:
    """The parameters this EP rank holds and the reference's same tensors (or rows), by global name."""
    got, ref = {}, {}
    for n, p in global_expert_names(params, name, ep_mesh).items():
        if isinstance(p, tuple):
            lo, p = p
            got[n], ref[n] = p, want[n][lo:lo + len(p)]
        else:
            got[n], ref[n] = p, want[n]
    return got, ref


def with_references(cases: dict[str, tuple[dict, Callable[[dict], object]]]) -> dict:
    """``run_cases`` of ``{case: (its references' jobs, run(refs))}``: every reference of the launch first,
    trained once and side by side (``_dist.shared``; a training that several cases compare with, such as
    a model's float64 reference at this world size, once), then each case given them."""
    refs = shared({key: job for jobs, _ in cases.values() for key, job in jobs.values()})
    return run_cases({label: functools.partial(run, refs) for label, (_, run) in cases.items()})


def ep_entry(name: str, rank: int, world: int, ep: int, replicas: int = 1, bf16: bool = False,
             **kwargs) -> tuple:
    """``ep_case`` for ``with_references`` (``kwargs``: its ``full`` and ``spread_of``)."""
    return ep_jobs(name, world, bf16, **kwargs), lambda refs: ep_case(name, rank, world, ep, replicas, bf16,
                                                                      refs=refs, **kwargs)


def checks(rank: int, world: int) -> dict:
    cases = {}
    mesh = init_device_mesh("cpu", (world,))
    for name in MODELS:
        for label, bf16 in (("fp32", False), ("bf16", True)):
            cases[f"{name}/{label}"] = (case_jobs(name, world, bf16), lambda refs, name=name, bf16=bf16: case(
                name, mesh, rank, world, bf16, refs))
        for ep in {2: (2,), 4: (2, 4)}[world]:
            cases[f"{name}/ep{ep}"] = ep_entry(name, rank, world, ep, full=FULL)
    if world == 4:
        skewed = f"gpt-oss-tiny{SKEWED}"
        for ep in (2, 4):
            cases[f"{skewed}/ep{ep}"] = ep_entry(skewed, rank, world, ep, full=FULL)
        cases["ep-mesh-refused"] = ({}, lambda _: refused_ep_mesh(("ep", "replicate", "fsdp")))
    return with_references(cases)


def refused_ep_mesh(dims: tuple[str, ...]) -> str:
    """``expert_parallel``'s error for a mesh whose dims are not (replicate?, ep, fsdp)."""
    from torch_backend.models.expert_parallel import expert_parallel

    mesh = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=dims)
    try:
        expert_parallel(build("mixtral-tiny"), mesh)
    except ValueError as e:
        return str(e)
    return "accepted"


def ep_bf16_checks(rank: int, world: int) -> dict:
    """Expert parallelism in bf16 under the mixed-precision policy at (ep, fsdp) = (2, 2) on 4 ranks."""
    return with_references({f"{name}/ep2-bf16": ep_entry(name, rank, world, 2, bf16=True, spread_of="policy")
                            for name in EP_MODELS})


def hsdp_checks(rank: int, world: int, bf16: bool) -> dict:
    """Expert parallelism with HSDP: (replicas, ep, fsdp) = (2, 2, 2) on 8 ranks, in fp32 (and with routing
    skewed onto EP rank 0's experts) or bf16."""
    names = EP_MODELS + (() if bf16 else (f"gpt-oss-tiny{SKEWED}",))
    return with_references({f"{name}/hsdp2-ep2": ep_entry(
        name, rank, world, 2, 2, bf16, full=torch.float32 if bf16 else FULL,
        spread_of="policy" if bf16 else None) for name in names})
