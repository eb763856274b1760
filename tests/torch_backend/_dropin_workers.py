"""What test_fsdp_dropin runs in each gloo worker: FSDP2's options and methods on the same small model.

A token model (an embedding, two residual MLP blocks, a head) and a float-input model (a projection
instead of the embedding) train a few AdamW steps single-process on the whole batch (the reference),
under our ``fully_shard`` and under PyTorch FSDP2 with the same option or method (each rank on its rows),
and each case returns the worst relative loss and parameter differences against the reference (rank 0;
FSDP2's show the case is sound), or the error each one raised.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from tests.torch_backend._dist import run_cases
from tests.torch_backend._user_model_workers import full_params, rel_errors

B, T, D, H, V, SEED, STEPS, LR = 8, 4, 8, 16, 16, 0, 3, 1e-2  # 8 rows: an even split over 2 and 4 ranks


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(D, H), nn.Linear(H, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class Net(nn.Module):
    """Tokens (``floats=False``: an embedding) or float features (a projection), blocks, a head."""

    def __init__(self, floats: bool = False, max_norm: float | None = None) -> None:
        super().__init__()
        self.embed = nn.Linear(D, D) if floats else nn.Embedding(V, D, max_norm=max_norm)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(D, V)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def build(floats: bool = False, max_norm: float | None = None) -> Net:
    torch.manual_seed(SEED)
    return Net(floats, max_norm)


def batch(step: int, floats: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(B, T, D, generator=g) if floats else torch.randint(0, V, (B, T), generator=g)
    return x, torch.randint(0, V, (B, T), generator=g)


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)  # bf16 under a policy: the loss in float32 then, else in the model's float64
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def rows_of(rank: int, world: int) -> slice:
    return slice(rank * B // world, (rank + 1) * B // world)


def shard(model: Net, mesh, which: str, **kwargs) -> Net:
    """Each block, the embedding, then the root (FSDP2's bottom-up order), with the same keywords."""
    if which == "ours":
        from torch_backend import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **kwargs)
    fully_shard(model.embed, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    return model


def train(model: nn.Module, rows: slice = slice(None), *, floats: bool = False, steps: int = STEPS,
          micro: int = 1, before: Callable[[int], None] | None = None) -> list[float]:
    """``steps`` AdamW steps on ``rows`` of each batch in ``micro`` micro-batches (losses averaged over
    ranks); ``before(m)`` runs before micro-batch ``m``'s forward."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.1)
    losses = []
    for step in range(steps):
        x, y = batch(step, floats)
        x, y = x[rows], y[rows]
        total = 0.0
        for m, (xm, ym) in enumerate(zip(x.chunk(micro), y.chunk(micro))):
            if before is not None:
                before(m)
            loss = loss_of(model, xm, ym) / micro
            loss.backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad()
        if dist.is_initialized() and rows != slice(None):
            dist.all_reduce(total)
            total /= dist.get_world_size()
        losses.append(float(total))
    return losses


def errors(losses: list[float], params: dict, ref: dict) -> dict:
    return {"loss": max(abs(a - b) / abs(b) for a, b in zip(losses, ref["losses"])),
            "params": rel_errors(params, ref["params"])}


def reference(floats: bool = False, **kwargs) -> dict:
    model = build(floats)
    losses = train(model, floats=floats, **kwargs)
    return {"losses": losses, "params": full_params(model)}


def both(mesh, rank: int, world: int, *, floats: bool = False, setup: Callable[[nn.Module], object] = None,
         train_kwargs: dict | None = None, ref_kwargs: dict | None = None, runs: dict | None = None,
         **shard_kwargs) -> dict:
    """Ours and FSDP2 under the same keywords and ``setup(model)``, against single-process training;
    ``runs`` (a dict) receives each one's ``(losses, full parameters)``."""
    ref = reference(floats, **(ref_kwargs or {}))
    out = {}
    for which in ("ours", "fsdp2"):
        try:
            model = shard(build(floats), mesh, which, **shard_kwargs)
            if setup is not None:
                setup(model)
            losses = train(model, rows_of(rank, world), floats=floats, **(train_kwargs or {}))
            out[which] = errors(losses, full_params(model), ref)
            if runs is not None:
                runs[which] = (losses, full_params(model))
        except Exception as e:  # noqa: BLE001 - FSDP2's failures are part of the comparison
            out[which] = {"error": f"{type(e).__name__}: {e}"}
    return out


def raised(fn: Callable[[], object]) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return "no error"


# ----- 1. FSDPModule ----------------------------------------------------------------------------------
def _module_api(mesh) -> dict:
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
    from torch.distributed.fsdp import UnshardHandle as TorchUnshardHandle

    from torch_backend import FSDPModule

    model = shard(build(), mesh, "ours")
    public = sorted(n for n, v in vars(TorchFSDPModule).items() if callable(v) and not n.startswith("__"))
    refused = {}
    for name, args in (("set_custom_all_gather", (None,)), ("set_custom_reduce_scatter", (None,)),
                       ("set_allocate_memory_from_process_group_for_comm", (True,)),
                       ("set_symm_mem_for_comm", ()), ("_set_unshard_async_op", (True,)),
                       ("_get_fsdp_state", ())):
        refused[name] = raised(lambda name=name, args=args: getattr(model, name)(*args))
    return {
        "isinstance": [isinstance(m, TorchFSDPModule) for m in (model, model.blocks[0], model.embed)],
        "not_overridden": [n for n in public if n not in vars(FSDPModule)],
        "handle": isinstance(model.blocks[0].unshard(async_op=True), TorchUnshardHandle),
        "refused": refused,
        "accepted": raised(lambda: (model.set_is_last_backward(True),
                                    model.set_force_sum_reduction_for_comms(True),
                                    model.set_reduce_scatter_unused_params(True),
                                    model.set_reduce_scatter_max_input_buffers(2),
                                    model.set_allocate_memory_from_process_group_for_comm(False))),
        "deepcopy": raised(lambda: __import__("copy").deepcopy(model)),
        "shared_class": type(model.blocks[0]) is type(model.blocks[1]),  # FSDP2's one class per class
        "slice": type(_sharded_sequential(mesh)[0:1]).__name__,  # __new__ builds the original class
    }


def _sharded_sequential(mesh) -> nn.Sequential:
    from torch_backend import fully_shard

    return fully_shard(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), mesh=mesh)


def _all_gathers_of(fn: Callable[[], object]) -> dict[str, int]:
    from torch_backend import debug_counter

    with debug_counter() as c:
        fn()
    return c.per_label("all_gather")


def _divide_factor(mesh, rank: int, world: int) -> dict:
    """``set_gradient_divide_factor(f)``: gradients are the sum over ranks / f; the reference scales its
    loss by world / f (each rank's loss is a mean over its rows)."""
    factor = 2.0 * world

    def setup(model: nn.Module) -> None:
        for m in model.modules():  # not recursive, in both
            if hasattr(m, "set_gradient_divide_factor"):
                m.set_gradient_divide_factor(factor)
                m.set_force_sum_reduction_for_comms(True)  # FSDP2 would use PREMUL_SUM, which gloo lacks

    grads = {}  # the gradients themselves: AdamW's steps hardly depend on their scale
    for which in ("ours", "fsdp2"):
        model = shard(build(), mesh, which)
        setup(model)
        x, y = batch(0)
        loss_of(model, x[rows_of(rank, world)], y[rows_of(rank, world)]).backward()
        grads[which] = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    ref = build()
    x, y = batch(0)
    (loss_of(ref, x, y) * world / factor).backward()
    want = {n: p.grad for n, p in ref.named_parameters()}
    return {"ours": rel_errors(grads["ours"], want), "fsdp2": rel_errors(grads["fsdp2"], want)}


def _accumulate_without_resharding(mesh, rank: int, world: int) -> dict:
    """Pipelining's recipe: micro-batches with ``set_requires_gradient_sync(False)`` and
    ``set_reshard_after_backward(False)``, the last one with both True. Kept unsharded after backward, a
    unit's next forward gathers nothing (the root then gathers nothing at all; the others once, in
    backward, since they still reshard after forward), against twice per unit when resharded."""

    def before(m: int, model: nn.Module, keep: bool = True) -> None:
        last = m == 1
        model.set_requires_gradient_sync(last)
        model.set_reshard_after_backward(last or not keep)

    out = {}
    ref = reference(micro=2)
    rows = rows_of(rank, world)
    for which in ("ours", "fsdp2"):
        model = shard(build(), mesh, which)
        losses = train(model, rows, micro=2, before=lambda m, model=model: before(m, model))
        out[which] = errors(losses, full_params(model), ref)
    x, y = batch(0)
    for keep in (True, False):
        model = shard(build(), mesh, "ours")
        before(0, model, keep)
        loss_of(model, x[rows], y[rows]).backward()
        out[f"second_micro_batch_gathers_keep={keep}"] = _all_gathers_of(
            lambda model=model: loss_of(model, x[rows], y[rows]).backward())
    return out


def _reshard_after_forward(mesh, rank: int, world: int) -> dict:
    """``set_reshard_after_forward(False)`` keeps every unit gathered after forward (one all-gather per
    unit and step); the int forms 1 and the shard size mean False and True; 2 of 4 keeps half."""
    from torch_backend.fsdp import UnitState, units

    out = both(mesh, rank, world, setup=lambda m: m.set_reshard_after_forward(False))
    model = shard(build(), mesh, "ours")
    model.set_reshard_after_forward(False)
    x, y = batch(0)
    counts = _all_gathers_of(lambda: loss_of(model, x, y).backward())
    model(x)
    out["after_forward_unsharded"] = [u.state is UnitState.UNSHARDED for u in units(model)]
    out["gathers_per_unit"] = sorted(set(counts.values()))
    kept = {}
    for value in (1, world):
        model = shard(build(), mesh, "ours", reshard_after_forward=value)
        model(x)
        kept[value] = [u.state is UnitState.UNSHARDED for u in units(model.blocks[0])]
    out["int"] = {str(k): v for k, v in kept.items()}
    if world == 4:  # groups of 2: each rank keeps half of the unsharded unit after forward
        from torch_backend.fsdp import units

        out["int_2"] = both(mesh, rank, world, reshard_after_forward=2)
        model = shard(build(), mesh, "ours", reshard_after_forward=2)
        model(x)
        out["int_2_state"] = {u.name: [u.state.value, 0 if u._grouped is None else u._grouped.numel(),
                                       u.layout.total_numel] for u in units(model)}
        out["int_2_groups"] = len({id(u.post_forward_group) for u in units(model)})  # one mesh: shared
    out["int_bad"] = raised(lambda: shard(build(), mesh, "ours", reshard_after_forward=world + 1))
    return out


def _unshard_in_backward(mesh, rank: int, world: int) -> dict:
    """``set_unshard_in_backward(False)`` on the embedding: its backward gathers nothing, same training."""
    out = both(mesh, rank, world, setup=lambda m: m.embed.set_unshard_in_backward(False))
    model = shard(build(), mesh, "ours")
    model.embed.set_unshard_in_backward(False)
    x, y = batch(0)
    loss = loss_of(model, x, y)
    out["embed_gathers_in_backward"] = _all_gathers_of(loss.backward).get("embed", 0)
    return out


def _all_reduce_hook(mesh, rank: int, world: int) -> dict:
    """A hook that doubles the reduced shard: one backward's gradients are twice the reference's."""
    grads = {}
    for which in ("ours", "fsdp2"):
        model = shard(build(), mesh, which)
        for m in model.modules():
            if hasattr(m, "set_all_reduce_hook"):
                m.set_all_reduce_hook(lambda t: t.mul_(2))
        x, y = batch(0)
        loss_of(model, x[rows_of(rank, world)], y[rows_of(rank, world)]).backward()
        grads[which] = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    ref = build()
    x, y = batch(0)
    (2 * loss_of(ref, x, y)).backward()
    want = {n: p.grad for n, p in ref.named_parameters()}
    return {"ours": rel_errors(grads["ours"], want), "fsdp2": rel_errors(grads["fsdp2"], want)}


def _separate_group_and_events(mesh, rank: int, world: int) -> dict:
    """``set_separate_reduce_scatter_group`` and the accepted no-ops train like the reference."""

    def setup(model: nn.Module) -> None:
        model.set_separate_reduce_scatter_group(True)
        model.set_is_last_backward(True)
        model.set_force_sum_reduction_for_comms(True)

    return both(mesh, rank, world, setup=setup)


def _fail_once(state: dict) -> Callable:
    """A forward pre-hook that raises while ``state["fail"]`` is set (an aborted step)."""

    def hook(*_: object) -> None:
        if state["fail"]:
            raise RuntimeError("injected")

    return hook


def _reset_iter_state(mesh, rank: int, world: int) -> dict:
    """A forward that raised after the first units ran, ``reset_iter_state()``, then normal training."""
    out = {}
    ref = reference()
    for which in ("ours", "fsdp2"):
        model = shard(build(), mesh, which)
        state = {"fail": True}
        model.blocks[1].register_forward_pre_hook(_fail_once(state))
        x, y = batch(0)
        rows = rows_of(rank, world)
        caught = raised(lambda model=model, x=x[rows], y=y[rows]: loss_of(model, x, y).backward())
        state["fail"] = False
        model.reset_iter_state()
        losses = train(model, rows_of(rank, world))
        out[which] = errors(losses, full_params(model), ref) | {"caught": caught}
    out["not_root"] = raised(lambda: shard(build(), mesh, "ours").blocks[0].reset_iter_state())
    return out


def _hsdp_requires_all_reduce(rank: int) -> dict:
    """HSDP 2x2: micro-batch 0 reduce-scatters without the all-reduce, micro-batch 1 all-reduces both."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))

    def before(m: int, model: nn.Module) -> None:
        model.set_requires_all_reduce(m == 1)

    out = {}
    ref = reference(micro=2)
    for which in ("ours", "fsdp2"):
        model = shard(build(), mesh, which)
        losses = train(model, rows_of(rank, 4), micro=2, before=lambda m, model=model: before(m, model))
        out[which] = errors(losses, full_params(model), ref)
    return out


# ----- 2. fully_shard's keywords ----------------------------------------------------------------------
def _shard_placement_fn(mesh, rank: int, world: int) -> dict:
    from torch.distributed.tensor import Shard

    out = both(mesh, rank, world, shard_placement_fn=lambda p: Shard(0))
    out["shard1"] = raised(lambda: shard(build(), mesh, "ours", shard_placement_fn=lambda p: Shard(1)))
    return out


def _ignored_params(mesh, rank: int, world: int) -> dict:
    """The head's bias ignored: a plain tensor, never reduced (each rank steps its own local gradient),
    exactly as FSDP2 leaves it; every other parameter trains like the reference."""
    from torch.distributed.tensor import DTensor

    out = {}
    params = {}
    for which in ("ours", "fsdp2"):
        model = build()
        ignored = {model.head.bias}
        for block in model.blocks:
            _fully_shard(which)(block, mesh=mesh, ignored_params=ignored)
        _fully_shard(which)(model, mesh=mesh, ignored_params=ignored)
        losses = train(model, rows_of(rank, world))
        params[which] = full_params(model)
        out[f"{which}_plain"] = not isinstance(model.head.bias, DTensor)
        out[f"{which}_losses"] = losses
    ref = reference()
    rest = [n for n in params["ours"] if n != "head.bias"]
    want = {n: ref["params"][n] for n in rest}
    out["others_vs_reference"] = rel_errors({n: params["ours"][n] for n in rest}, want)
    out["fsdp2_others_vs_reference"] = rel_errors({n: params["fsdp2"][n] for n in rest}, want)
    out["ignored_ours_vs_fsdp2"] = rel_errors({"b": params["ours"]["head.bias"]},
                                              {"b": params["fsdp2"]["head.bias"]})
    return out


def _fully_shard(which: str):
    if which == "ours":
        from torch_backend import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    return fully_shard


def _refused_keywords(mesh) -> dict:
    return {"dp_mesh_dims": raised(lambda: shard(build(), mesh, "ours", dp_mesh_dims=object())),
            "offload_policy": raised(lambda: shard(build(), mesh, "ours", offload_policy="cpu")),
            "mp_policy": raised(lambda: shard(build(), mesh, "ours", mp_policy="bf16"))}


# ----- 3. mixed precision -----------------------------------------------------------------------------
def policy_reference(world: int, order: int | None = None) -> dict:
    """The float-input model trained in one process under a bf16 policy's casts: float64 masters, each
    step's rows in ``world`` micro-batches (the ranks), each on a bf16 cast of the master and of its
    inputs (``_policy_reference.train``); ``order``: the rows permuted, the same training in another order."""
    from tests.torch_backend import _policy_reference

    model = build(True)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    out = _policy_reference.train(model, lambda step: batch(step, True),
                                  lambda call, rows: loss_of(call, *rows), STEPS, world, opt, torch.bfloat16,
                                  order)
    return {"losses": out["losses"], "params": out["params"]}


@functools.cache
def policy_references(world: int) -> dict:
    """The policy reference and its SPREAD_ORDERS other orders, trained once over the ranks (every rank
    calls this first thing in the same case)."""
    from tests.parity import SPREAD_ORDERS
    from tests.torch_backend._dist import shared

    refs = shared({order: functools.partial(policy_reference, world, order)
                   for order in (None, *range(SPREAD_ORDERS))})
    return {"policy": refs[None], "orders": [refs[k] for k in range(SPREAD_ORDERS)]}


def against_policy(out: dict, world: int, runs: dict[str, tuple[list[float], dict]]) -> dict:
    """``out`` with each bf16 run's distances from the policy reference (``{which}_vs_policy``) and the
    reference's other orders' (``policy_orders``)."""
    refs = policy_references(world)
    for which, (losses, params) in runs.items():
        out[f"{which}_vs_policy"] = errors(losses, {n: p.double() for n, p in params.items()}, refs["policy"])
    out["policy_orders"] = [errors(o["losses"], o["params"], refs["policy"]) for o in refs["orders"]]
    return out


def _torch_mp_policy(mesh, rank: int, world: int) -> dict:
    """torch's own policy object (bf16 params, fp32 reduce) on a model called with fp32 inputs: FSDP2
    casts each unit's inputs; ours must too. ``output_dtype=float32`` on the root only (on every unit it
    would hand fp32 to the root's bf16 head, in FSDP2 as here). Against the fp32 reference."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32)
    root_policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32, output_dtype=torch.float32)

    def mp_shard(which: str, inner=policy, root=root_policy) -> Net:
        model = build(True)
        for m in (*model.blocks, model.embed):
            _fully_shard(which)(m, mesh=mesh, mp_policy=inner)
        return _fully_shard(which)(model, mesh=mesh, mp_policy=root)

    policy_references(world)  # first: every rank trains its share of them here
    ref = reference(True)
    out: dict = {"dtypes": {}}
    runs = {}
    for which in ("ours", "fsdp2"):
        model = mp_shard(which)
        seen = {}
        model.blocks[0].up.register_forward_hook(
            lambda m, a, o, seen=seen: seen.update(block_in=str(a[0].dtype)))
        x, _ = batch(0, floats=True)
        out["dtypes"][which] = {"output": str(model(x).dtype)} | seen
        model = mp_shard(which)
        losses = train(model, rows_of(rank, world), floats=True)
        out[which] = errors(losses, full_params(model), ref)
        runs[which] = (losses, full_params(model))
    against_policy(out, world, runs)
    no_cast = MixedPrecisionPolicy(torch.bfloat16, cast_forward_inputs=False)
    for which in ("ours", "fsdp2"):
        out[f"no_cast_{which}"] = raised(
            lambda which=which: mp_shard(which, no_cast, no_cast)(batch(0, True)[0]))
    return out


# ----- 4. CPU offload -----------------------------------------------------------------------------------
def _cpu_offload(mesh, rank: int, world: int) -> dict:
    """``CPUOffloadPolicy()``: training equals the reference, fp32 and under a bf16 policy (against FSDP2
    offloaded the same way); the sharded parameters, their gradients and AdamW's state are host tensors,
    and the all-gather runs from a separate (device) copy of the shard. FSDP2 pins unconditionally, which
    a machine without an accelerator cannot: it runs with ``pin_memory=False``; ours pins only when the
    mesh is an accelerator's (a CPU mesh has nothing to pin for)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    from torch_backend.fsdp import units

    policy_references(world)  # first: every rank trains its share of them here
    out, bf16_runs = {}, {}
    for which in ("ours", "fsdp2"):
        policy = CPUOffloadPolicy() if which == "ours" else CPUOffloadPolicy(pin_memory=False)
        out[which] = both(mesh, rank, world, offload_policy=policy)[which]
        out[f"{which}_bf16"] = both(mesh, rank, world, floats=True, offload_policy=policy, runs=bf16_runs,
                                    mp_policy=MixedPrecisionPolicy(torch.bfloat16, torch.float32))[which]
    out |= {f"bf16_{k}": v for k, v in against_policy({}, world, bf16_runs).items()}
    model = shard(build(), mesh, "ours", offload_policy=CPUOffloadPolicy())
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    x, y = batch(0)
    loss_of(model, x[rows_of(rank, world)], y[rows_of(rank, world)]).backward()
    opt.step()
    devices = {str(t.device) for p in model.parameters()
               for t in (p.to_local(), p.grad.to_local(), *[v for v in opt.state[p].values() if v.dim()])}
    out["where"] = {"devices": sorted(devices),
                    "separate_compute_buffer": all(u.compute is not u.master for u in units(model)),
                    "offload": all(u.offload for u in units(model))}
    out["pin_memory_default"] = raised(
        lambda: shard(build(), mesh, "fsdp2", offload_policy=CPUOffloadPolicy()))
    return out


# ----- 5. beyond FSDP2 ---------------------------------------------------------------------------------
PENALTY = 0.5


def _train_gradient_penalty(model: nn.Module, rows: slice, world: int) -> list[float]:
    """Loss plus ``PENALTY * ||d loss / d x||^2`` (an input-gradient penalty: double backward).

    Rows are independent, so with each rank's loss a mean over its rows the penalty scaled by
    ``1 / world`` makes the average over ranks the single-process objective (world = 1 there).
    """
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    losses = []
    for step in range(STEPS):
        x, y = batch(step, floats=True)
        x = x[rows].requires_grad_()
        loss = loss_of(model, x, y[rows])
        (g,) = torch.autograd.grad(loss, x, create_graph=True)
        total = loss + PENALTY / world * g.pow(2).sum()
        total.backward()
        opt.step()
        opt.zero_grad()
        total = total.detach()
        if rows != slice(None):
            dist.all_reduce(total)
            total /= world
        losses.append(float(total))
    return losses


def _gradient_penalty(mesh, rank: int, world: int) -> dict:
    model = build(True)
    ref = {"losses": _train_gradient_penalty(model, slice(None), 1), "params": full_params(model)}
    out = {}
    for which in ("ours", "fsdp2"):
        try:
            model = shard(build(True), mesh, which)
            losses = _train_gradient_penalty(model, rows_of(rank, world), world)
            out[which] = errors(losses, full_params(model), ref)
        except Exception as e:  # noqa: BLE001 - FSDP2 fails here
            out[which] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    model = shard(build(True), mesh, "ours")
    x, y = batch(0, floats=True)
    out["create_graph_backward"] = raised(lambda: loss_of(model, x, y).backward(create_graph=True))
    return out


def _embedding_max_norm(mesh, rank: int, world: int) -> dict:
    """``nn.Embedding(max_norm=1)`` (rows of norm about 2.8 at init: every used row is renormed in
    forward); each rank's rows use different tokens."""
    model = build(max_norm=1.0)
    ref = {"losses": train(model), "params": full_params(model)}
    out = {}
    for which in ("ours", "fsdp2"):
        model = shard(build(max_norm=1.0), mesh, which)
        losses = train(model, rows_of(rank, world))
        out[which] = errors(losses, full_params(model), ref)
    return out


# ----- 6. async DCP -----------------------------------------------------------------------------------
def _async_dcp(mesh, rank: int, world: int, path: str) -> dict:
    """``dcp.async_save`` of the model and AdamW state after one step at ``world`` ranks, loaded into a
    fresh model sharded over half as many ranks (the shard dim of a (2, world / 2) mesh) at 4 ranks, over
    the same ranks at 2; the loaded parameters and optimizer state equal the saved ones (ours, and
    FSDP2 the same way)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def full(tree: dict) -> dict:
        return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone() for k, v in tree.items()}

    load_mesh = (init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))["shard"]
                 if world == 4 else mesh)
    out = {}
    x, y = batch(0)
    for which in ("ours", "fsdp2"):
        model = shard(build(), mesh, which)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        loss_of(model, x[rows_of(rank, world)], y[rows_of(rank, world)]).backward()
        opt.step()
        opt.zero_grad()
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.async_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{path}/{which}").result()
        saved = {"model": full(model_sd), "optim": {k: full(v) for k, v in optim_sd["state"].items()}}

        fresh = shard(build(), load_mesh, which)
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=LR)
        loss_of(fresh, x[:1], y[:1]).backward()  # AdamW's state exists (DCP loads into it)
        fresh_opt.step()
        fresh_opt.zero_grad()
        model_sd, optim_sd = get_state_dict(fresh, fresh_opt)
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{path}/{which}")
        set_state_dict(fresh, fresh_opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
        model_sd, optim_sd = get_state_dict(fresh, fresh_opt)
        out[which] = {
            "model": rel_errors(full(model_sd), saved["model"]),
            "optim": max(rel_errors({k: v for k, v in full(optim_sd["state"][n]).items() if k != "step"},
                                    {k: v for k, v in saved["optim"][n].items() if k != "step"})
                         for n in saved["optim"]),
        }
    return out


# ----- 7. torch.compile ------------------------------------------------------------------------------
def _compiled(mesh, rank: int, world: int) -> dict:
    """``torch.compile`` (inductor) of the whole sharded model, and of each block before sharding
    (torchtitan's way): training equals the eager single-process reference, for ours and FSDP2, and
    the graphs and graph breaks dynamo made are counted (the hooks run eagerly, outside the graphs)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    ref = reference()
    out = {}
    for which in ("ours", "fsdp2"):
        for mode in ("whole", "blocks"):
            torch._dynamo.reset()
            counters.clear()
            model = build()
            if mode == "blocks":
                for block in model.blocks:
                    block.compile()
            model = shard(model, mesh, which)
            compiled = torch.compile(model) if mode == "whole" else model
            losses = train(compiled, rows_of(rank, world))
            out[f"{which}_{mode}"] = errors(losses, full_params(model), ref) | {
                "graphs": counters["stats"]["unique_graphs"],
                "breaks": sum(counters["graph_break"].values())}
    torch._dynamo.reset()
    return out


# ----- the checks of one launch -------------------------------------------------------------------------
def checks(rank: int, world: int, path: str) -> dict:
    torch.set_default_dtype(torch.float64)  # every model and batch (masters too, under a policy): parity far
    # from rounding
    mesh = init_device_mesh("cpu", (world,))
    cases = {}
    cases["module_api"] = lambda: _module_api(mesh)
    cases["divide_factor"] = lambda: _divide_factor(mesh, rank, world)
    cases["accumulate_without_resharding"] = lambda: _accumulate_without_resharding(mesh, rank, world)
    cases["reshard_after_forward"] = lambda: _reshard_after_forward(mesh, rank, world)
    cases["unshard_in_backward"] = lambda: _unshard_in_backward(mesh, rank, world)
    cases["all_reduce_hook"] = lambda: _all_reduce_hook(mesh, rank, world)
    cases["separate_group"] = lambda: _separate_group_and_events(mesh, rank, world)
    cases["reset_iter_state"] = lambda: _reset_iter_state(mesh, rank, world)
    if world == 4:
        cases["hsdp_requires_all_reduce"] = lambda: _hsdp_requires_all_reduce(rank)
    cases["shard_placement_fn"] = lambda: _shard_placement_fn(mesh, rank, world)
    cases["ignored_params"] = lambda: _ignored_params(mesh, rank, world)
    cases["refused_keywords"] = lambda: _refused_keywords(mesh)
    cases["torch_mp_policy"] = lambda: _torch_mp_policy(mesh, rank, world)
    cases["cpu_offload"] = lambda: _cpu_offload(mesh, rank, world)
    cases["gradient_penalty"] = lambda: _gradient_penalty(mesh, rank, world)
    cases["embedding_max_norm"] = lambda: _embedding_max_norm(mesh, rank, world)
    cases["async_dcp"] = lambda: _async_dcp(mesh, rank, world, f"{path}/{world}")
    if world == 2:
        cases["compiled"] = lambda: _compiled(mesh, rank, world)
    return run_cases(cases)
