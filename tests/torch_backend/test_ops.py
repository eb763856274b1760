"""Ops on RaggedShard DTensors: elementwise, foreach, torch.optim fused/foreach steps, reductions, clipping.

Every result is compared with the same op on the full tensors in the same process. Elementwise ops and
foreach/for-loop optimizer steps must match bit for bit (each element sees the same arithmetic); fused
kernels, means and norms within float rounding; sums of integer-valued data exactly.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import ragged
from tests.torch_backend._dist import Launcher, assert_case, run_cases
from tests.torch_backend._ragged_cases import cases, full
from torch_backend import RaggedShard

WORLDS = (1, 2, 3, 4)


def _layouts(world: int):
    """One layout per shape: rows/multinomial, elements/zeros, vector/one-hot, 4-D two-dim blocks."""
    picked = {}
    for c in cases(world):
        key = c.shape
        want = {(25, 3): "u25-multinomial", (3, 26): "u78-zeros", (7,): "onehot", (5, 3, 6, 7): "d2-u5-zeros"}
        if key not in picked and want[key] in c.name:
            picked[key] = c
    return list(picked.values())


def _equal(got: DTensor, want: torch.Tensor, what: str) -> None:
    g = got.full_tensor()
    assert g.shape == want.shape and torch.equal(g, want), f"{what}: max err {(g - want).abs().max()}"


def _close(got: DTensor, want: torch.Tensor, what: str) -> None:
    g = got.full_tensor()
    # Bound: elementwise ops are exact; reductions across shard boundaries sum in another order: a few fp32
    # eps on values of order 1 (1e-6 ~ 8 eps).
    assert g.shape == want.shape and torch.allclose(g, want, rtol=1e-6, atol=1e-6), f"{what}: {g} vs {want}"


def _expect_unsupported(fn, *needles: str) -> None:
    try:
        fn()
    except (RuntimeError, ragged.RaggedError) as e:
        missing = [n for n in needles if n not in str(e)]
        assert not missing, f"error does not mention {missing}: {e}"
    else:
        raise AssertionError("no error raised")
    dist.barrier()


def _elementwise_cases(rank: int, world: int, mesh) -> dict:
    out = {}
    for c in _layouts(world):
        p = RaggedShard(c.dims, c.units)
        a, b, w = full(c.shape, 1), full(c.shape, 2) + 20, full(c.shape, 3).abs() / 8

        def elementwise(a=a, b=b, w=w, p=p):
            x, y, wt = (distribute_tensor(t, mesh, [p]) for t in (a, b, w))
            _equal(x + y, a + b, "add")
            _equal(x - y, a - b, "sub")
            _equal(x * y, a * b, "mul")
            _equal(x / y, a / b, "div")
            _equal(x * 2.5 - 1, a * 2.5 - 1, "scalars")
            _equal(torch.lerp(x, y, 0.3), torch.lerp(a, b, 0.3), "lerp scalar")
            _equal(torch.lerp(x, y, wt), torch.lerp(a, b, w), "lerp tensor")
            _equal(torch.addcmul(x, x, y, value=0.5), torch.addcmul(a, a, b, value=0.5), "addcmul")
            _equal(torch.addcdiv(x, x, y, value=-2), torch.addcdiv(a, a, b, value=-2), "addcdiv")
            _equal(y.sqrt(), b.sqrt(), "sqrt")
            _equal(torch.where(x > 0, x, y), torch.where(a > 0, a, b), "where")
            _equal(x.to(torch.float64), a.to(torch.float64), "cast")
            replicated = distribute_tensor(b, mesh, [Replicate()])
            _equal(x + replicated, a + b, "ragged + replicate")

        def inplace(a=a, b=b, p=p):
            x, y = (distribute_tensor(t, mesh, [p]) for t in (a, b))
            z, ref = x.clone(), a.clone()
            z.add_(y).mul_(2).lerp_(y, 0.25).addcmul_(x, y, value=2).addcdiv_(x, y, value=0.5)
            ref.add_(b).mul_(2).lerp_(b, 0.25).addcmul_(a, b, value=2).addcdiv_(a, b, value=0.5)
            _equal(z, ref, "inplace chain")
            z.zero_()
            _equal(z, torch.zeros_like(a), "zero_")

        def foreach(a=a, b=b, p=p):
            x, y = (distribute_tensor(t, mesh, [p]) for t in (a, b))
            xs, refs = [x.clone(), y.clone()], [a.clone(), b.clone()]
            torch._foreach_add_(xs, [y, x], alpha=3)
            torch._foreach_add_(refs, [b, a], alpha=3)
            torch._foreach_mul_(xs, 0.5)
            torch._foreach_mul_(refs, 0.5)
            torch._foreach_lerp_(xs, [x, y], 0.125)
            torch._foreach_lerp_(refs, [a, b], 0.125)
            got = torch._foreach_sqrt(torch._foreach_abs(xs))
            want = torch._foreach_sqrt(torch._foreach_abs(refs))
            for g, r in zip(got, want):
                _equal(g, r, "foreach")

        for fn in (elementwise, inplace, foreach):
            out[f"{c.name}:{fn.__name__}"] = fn
    return out


def _params(world: int, mesh, step_seed: int = 0):
    """A mix of RaggedShard (rows, one-hot vector, elements with a zero) and Shard(0) parameters."""
    specs = [(c.shape, RaggedShard(c.dims, c.units)) for c in _layouts(world)[:3]]
    specs.append(((7, 4), Shard(0)))
    fulls = [full(shape, 10 + i) / 4 for i, (shape, _) in enumerate(specs)]
    dts = [torch.nn.Parameter(distribute_tensor(t, mesh, [p])) for t, (_, p) in zip(fulls, specs)]
    refs = [torch.nn.Parameter(t.clone()) for t in fulls]
    return specs, dts, refs


def _set_grads(specs, dts, refs, mesh, seed: int) -> None:
    for i, ((shape, p), d, r) in enumerate(zip(specs, dts, refs)):
        g = full(shape, seed * 100 + i) / 8
        d.grad = distribute_tensor(g, mesh, [p])
        r.grad = g.clone()


_OPTIMIZERS = {
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1, fused=True),
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1, foreach=True),
    "adamw_loop": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1, foreach=False),
    "sgd_fused": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True),
    "sgd_foreach": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, foreach=True),
}


def _optimizer_cases(rank: int, world: int, mesh) -> dict:
    out = {}
    for name, make in _OPTIMIZERS.items():

        def step(make=make, name=name):
            specs, dts, refs = _params(world, mesh)
            opt, ref_opt = make(dts), make(refs)
            for s in range(3):
                _set_grads(specs, dts, refs, mesh, seed=s)
                opt.step()
                ref_opt.step()
            for i, (d, r) in enumerate(zip(dts, refs)):
                assert d.placements == (specs[i][1],)
                # Fused CPU kernels run vector bodies and scalar tails (FMA vs not) at offsets that
                # depend on the local length, so they may differ by an ulp; the rest is bit-exact.
                (_close if "fused" in name else _equal)(d.data, r.data, f"{name} param {i}")

        out[f"optim:{name}"] = step
    return out


def _reduction_cases(rank: int, world: int, mesh) -> dict:
    out = {}
    for c in _layouts(world):
        p = RaggedShard(c.dims, c.units)
        a = full(c.shape, 5)
        inside, outside = 0, len(c.dims)  # a dim within the ragged prefix, one after it (if any)

        def reductions(a=a, p=p, inside=inside, outside=outside):
            x = distribute_tensor(a, mesh, [p])
            _equal(x.sum(), a.sum(), "sum")
            _close(x.mean(), a.mean(), "mean")  # per-device sums divided by numel: rounding differs
            _equal(x.sum(dtype=torch.float64), a.sum(dtype=torch.float64), "sum f64")
            dims = [inside] + ([outside] if outside < a.ndim else [])
            for d in dims:
                _equal(x.sum(d), a.sum(d), f"sum dim {d}")
                _close(x.mean(d, keepdim=True), a.mean(d, keepdim=True), f"mean dim {d}")
            if len(dims) == 2:
                _equal(x.sum(dims), a.sum(dims), "sum over inside+outside")
            kept = x.sum(outside) if outside < a.ndim else None
            if kept is not None:
                assert isinstance(kept.placements[0], RaggedShard), kept.placements

        def norms(a=a, p=p, inside=inside, outside=outside):
            x = distribute_tensor(a, mesh, [p])
            for order in (2, 1, 3, math.inf):
                _close(
                    torch.linalg.vector_norm(x, order), torch.linalg.vector_norm(a, order), f"norm {order}"
                )
                for d in [inside] + ([outside] if outside < a.ndim else []):
                    got = torch.linalg.vector_norm(x, order, dim=d, keepdim=True)
                    _close(
                        got, torch.linalg.vector_norm(a, order, dim=d, keepdim=True), f"norm {order} dim {d}"
                    )

        def norm_partial_to_ragged(a=a, p=p, inside=inside):
            # A partial norm (not a sum) must be reduced by its own rule before it is cut.
            x = distribute_tensor(a, mesh, [p])
            n = torch.linalg.vector_norm(x, dim=inside)
            target = RaggedShard((), (1,) + (0,) * (world - 1))
            _close(n.redistribute(mesh, [target]), torch.linalg.vector_norm(a, dim=inside), "norm partial")

        out[f"{c.name}:reductions"] = reductions
        out[f"{c.name}:norm_partial_to_ragged"] = norm_partial_to_ragged
        out[f"{c.name}:norms"] = norms

    def clip_grad_norm(foreach: bool):
        specs, dts, refs = _params(world, mesh)
        _set_grads(specs, dts, refs, mesh, seed=7)
        total = torch.nn.utils.clip_grad_norm_(dts, max_norm=0.5, foreach=foreach)
        want = torch.nn.utils.clip_grad_norm_(refs, max_norm=0.5, foreach=foreach)
        _close(total, want, "total norm")
        assert float(want) > 0.5, "the case must clip"
        for i, (d, r) in enumerate(zip(dts, refs)):
            _close(d.grad, r.grad, f"clipped grad {i}")

    out["clip_grad_norm:foreach"] = functools.partial(clip_grad_norm, True)
    out["clip_grad_norm:loop"] = functools.partial(clip_grad_norm, False)

    def shard_reductions_untouched():
        # The reduction handlers must leave non-ragged DTensors to torch's own rules.
        a = full((7, 4), 9)
        for placement in (Shard(0), Shard(1), Replicate()):
            x = distribute_tensor(a, mesh, [placement])
            _equal(x.mean(), a.mean(), f"{placement} mean")
            _equal(x.mean(0), a.mean(0), f"{placement} mean 0")
            _equal(x.sum(1), a.sum(1), f"{placement} sum 1")
            _close(
                torch.linalg.vector_norm(x, dim=0), torch.linalg.vector_norm(a, dim=0), f"{placement} norm"
            )

    out["non_ragged_reductions"] = shard_reductions_untouched
    return out


def _unsupported_cases(rank: int, world: int, mesh) -> dict:
    a = full((25, 3))
    p = RaggedShard((0,), (25,) + (0,) * (world - 1))
    q = RaggedShard((0,), (0,) * (world - 1) + (25,))

    def view():
        x = distribute_tensor(a, mesh, [p])
        _expect_unsupported(
            lambda: x.view(-1), "aten.view", "RaggedShard(dims=(0,)", "no RaggedShard sharding rule"
        )

    def matmul():
        x = distribute_tensor(a, mesh, [p])
        w = distribute_tensor(full((3, 4)), mesh, [Replicate()])
        _expect_unsupported(lambda: x @ w, "aten.mm", "RaggedShard(dims=(0,)")

    def cumsum():
        x = distribute_tensor(a, mesh, [p])
        _expect_unsupported(lambda: x.cumsum(0), "aten.cumsum", "RaggedShard(dims=(0,)")

    def mismatched_units():
        x, y = distribute_tensor(a, mesh, [p]), distribute_tensor(a, mesh, [q])
        _expect_unsupported(lambda: x + y, "aten.add.Tensor", "must share")

    def broadcasting():
        x = distribute_tensor(a, mesh, [p])
        row = distribute_tensor(full((3,)), mesh, [Replicate()])
        _expect_unsupported(lambda: x + row, "aten.add.Tensor", "(3,)")

    fns = (view, matmul, cumsum, broadcasting) + ((mismatched_units,) if world > 1 else ())
    return {f"unsupported:{f.__name__}": f for f in fns}


def _all_cases(rank: int, world: int, mesh) -> dict:
    return {
        **_unsupported_cases(rank, world, mesh),
        **_elementwise_cases(rank, world, mesh),
        **_optimizer_cases(rank, world, mesh),
        **_reduction_cases(rank, world, mesh),
    }


def checks(rank: int, world: int) -> dict:
    return run_cases(_all_cases(rank, world, init_device_mesh("cpu", (world,))))


_run = Launcher(__file__)
_PAIRS = [(w, name) for w in WORLDS for name in _all_cases(0, w, None)]


@pytest.mark.parametrize(("world", "case"), _PAIRS, ids=[f"w{w}-{n}" for w, n in _PAIRS])
def test_ops(world: int, case: str) -> None:
    assert_case(_run(world), case)
