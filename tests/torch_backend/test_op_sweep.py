"""The op battery: ops x RaggedShard layouts, initialisation, factories and bad locals, at 3 and 4 ranks.

Every op on a RaggedShard DTensor is compared with the same op on the full tensor in the same process
(values, shape and dtype), or must raise ``UnsupportedRaggedOp`` on every rank (a rank that raised alone
would leave the others in the barrier after each op, and the launch would time out). Layouts include
element, row, multi-row, multi-dim-prefix and whole-tensor granularities and devices that hold nothing.
Random initialisation must equal the single-process op with the same seed, down to the generator's
state afterwards.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.distributed.tensor as dtensor
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import ragged
from tests.torch_backend._dist import Launcher, assert_case, run_cases
from tests.torch_backend._ragged_cases import Case, cases, full, ragged_local
from torch_backend import RaggedShard, UnsupportedRaggedOp

WORLDS = (3, 4)
_PICK = (
    "25x3-d1-u25-multinomial",  # rows
    "25x3-d1-u5-zeros",  # 5-row blocks, device 0 holds nothing
    "3x26-d2-u78-zeros",  # elements, device 0 holds nothing
    "3x26-d2-u13-onehot",  # 2-element blocks, all on the last device
    "7-d1-u7-zeros",  # a vector
    "5x3x6x7-d2-u5-zeros",  # a two-dim prefix
    "5x3x6x7-d1-u5-multinomial",  # whole (3, 6, 7) slabs
)


def _layouts(world: int) -> list[tuple[Case, RaggedShard]]:
    picked = [(c, RaggedShard(c.dims, c.units)) for c in cases(world) if c.name in _PICK]
    whole = Case("4x5-whole-on-1", (4, 5), (), (0, 1) + (0,) * (world - 2))
    return picked + [(whole, RaggedShard.whole_on(1, world))]


def _norms(ords, **kw):
    return {f"norm{o}{kw}": (lambda x, o=o: torch.linalg.vector_norm(x.abs() + 1, o, **kw)) for o in ords}


# Ops that must match the op on the full tensor. ``x`` holds small integer-valued floats.
_VALUE_OPS = {
    "neg": lambda x: -x,
    "affine": lambda x: x * 2.5 - 1,
    "abs_sqrt": lambda x: x.abs().sqrt(),
    "clamp": lambda x: x.clamp(-2, 3),
    "where": lambda x: torch.where(x > 0, x, -2 * x),
    "compare": lambda x: x >= 1,
    "eq": lambda x: torch.eq(x, x.abs()),
    "maximum": lambda x: torch.maximum(x, -x),
    "to_f64": lambda x: x.to(torch.float64),
    "to_int": lambda x: x.to(torch.int32),
    "inplace_chain": lambda x: x.clone().mul_(3).add_(1).clamp_(-5, 5),
    "like": lambda x: torch.full_like(x, 3) + torch.zeros_like(x),
    "by_partial_scalar": lambda x: x / torch.linalg.vector_norm(x) - x.amax(),
    "sum": lambda x: x.sum(),
    "sum_int": lambda x: x.to(torch.int64).sum(),
    "sum_f64": lambda x: x.sum(dtype=torch.float64),
    "count": lambda x: (x > 0).sum(),
    "mean": lambda x: x.mean(),
    "sum_dim0": lambda x: x.sum(0),
    "sum_last_keep": lambda x: x.sum(-1, keepdim=True),
    "sum_all_keep": lambda x: x.sum(tuple(range(x.ndim)), keepdim=True),
    "mean_dim0_keep": lambda x: x.mean(0, keepdim=True),
    "mean_last": lambda x: x.mean(-1),
    "amax": lambda x: x.amax(),
    "amin": lambda x: x.amin(),
    "max": lambda x: x.max(),
    "min": lambda x: x.min(),
    "max_int": lambda x: x.to(torch.int32).max(),
    "amax_dim0": lambda x: x.amax(0),
    "amin_last_keep": lambda x: x.amin(-1, keepdim=True),
    "any": lambda x: (x > 6).any(),
    "all": lambda x: (x > -7).all(),
    **_norms((2, 1, 0.5, math.inf, -math.inf, 0, -1, -2)),
    **_norms((2, -1, -math.inf, 0), dim=0),
    **_norms((3,), dim=-1, keepdim=True),
    "linalg_norm": torch.linalg.norm,
    "norm_fro": lambda x: x.norm(p="fro"),
    "rms": lambda x: (x.pow(2).mean(-1, keepdim=True) + 1).rsqrt(),
    "masked_fill": lambda x: x.masked_fill(x > 0, 0.5),
    "all_finite": lambda x: torch.isfinite(x).all(),
    "foreach_norm2": lambda x: torch._foreach_norm([x, 2 * x]),
    "foreach_norm_inf": lambda x: torch._foreach_norm([x, 2 * x], math.inf),
    "foreach_max": lambda x: torch._foreach_max([x, -x]),
    "item_of_sum": lambda x: float(x.sum()),
    "item_of_any": lambda x: bool((x > 7).any()),
    "row0": lambda x: x[0],
    "row_last": lambda x: x[-1] * 1,
    "zero_a_row": lambda x: _zero_row(x.clone()),
}


def _zero_row(x):
    x[1 % x.shape[0]].zero_()  # HuggingFace's init.zeros_(weight[padding_idx])
    return x


# Ops that must raise UnsupportedRaggedOp on every rank.
_REFUSED_OPS = {
    "mask_index": lambda x: x[x > 0],
    "allclose": lambda x: torch.allclose(x, x),
    "nonzero": torch.nonzero,
    "transpose": lambda x: x.transpose(0, -1),
    "view": lambda x: x.view(1, -1),
    "unsqueeze": lambda x: x.unsqueeze(0),
    "cumsum": lambda x: x.cumsum(0),
    "sort": lambda x: x.sort(),
    "std": lambda x: x.std(),
    "prod": lambda x: x.prod(),
    "max_dim": lambda x: x.max(0),
    "argmax": lambda x: x.argmax(),
    "matmul": lambda x: x @ distribute_tensor(torch.ones(x.shape[-1], 2), x.device_mesh, [Replicate()]),
    "nansum": lambda x: x.nansum(),
    "count_nonzero": lambda x: x.count_nonzero(),
    "logsumexp": lambda x: x.logsumexp(-1),
    "var_mean": torch.var_mean,
    "aminmax": torch.aminmax,
    "expand_as": lambda x: x.expand_as(x),
    "broadcast_row": lambda x: x * x.amax(-1, keepdim=True) if x.ndim > 1 else x.view(1, -1),
    "select_inner": lambda x: x.select(-1, 0) if x.ndim > 1 else x.view(1, -1),
}


def _compare(got, want, what: str) -> None:
    if isinstance(want, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(want), f"{what}: {got} vs {want}"
        for i, (g, w) in enumerate(zip(got, want)):
            _compare(g, w, f"{what}[{i}]")
        return
    if isinstance(got, DTensor):
        got = got.full_tensor()
    if not isinstance(want, torch.Tensor):
        # Bound: a scalar reduction over shards in another order: a few fp32 eps (1e-6 ~ 8 eps).
        assert got == pytest.approx(want, rel=1e-6), f"{what}: {got} vs {want}"
        return
    assert isinstance(got, torch.Tensor) and not isinstance(got, DTensor), f"{what}: got {type(got)}"
    meta, want_meta = (got.shape, got.dtype), (want.shape, want.dtype)
    assert meta == want_meta, f"{what}: {meta} vs {want_meta}"
    # Bound: ops whose reductions (matmul, norms, softmax) sum across shard boundaries in another order; 1e-5
    # ~ 80 fp32 eps covers the sweep's longest reductions, atol the entries near 0.
    ok = torch.allclose(got.double(), want.double(), rtol=1e-5, atol=1e-6, equal_nan=True)
    assert ok, f"{what}: {got} vs {want}"


def _refused(fn, x, what: str) -> None:
    try:
        fn(x)
    except UnsupportedRaggedOp:
        return
    except Exception as e:  # the op may be wrapped by torch; the project's error must be the cause
        cause = e.__cause__
        assert isinstance(cause, UnsupportedRaggedOp), f"{what}: {type(e).__name__}: {e}"
        return
    raise AssertionError(f"{what}: no UnsupportedRaggedOp raised")


def _sweep(mesh, case: Case, placement: RaggedShard) -> None:
    a = full(case.shape, 3)
    x = distribute_tensor(a, mesh, [placement], src_data_rank=None)  # every op below leaves x as is
    failures = []
    for name, fn in _VALUE_OPS.items():
        try:
            _compare(fn(x), fn(a.clone()), name)
        except Exception as e:
            failures.append(f"{name}: {type(e).__name__}: {str(e)[:300]}")
    for name, fn in _REFUSED_OPS.items():
        try:
            _refused(fn, x, name)
        except Exception as e:
            failures.append(f"{name}: {type(e).__name__}: {str(e)[:300]}")
        dist.barrier()  # a rank that raised alone leaves the others here: the launch then fails
    _compare(x, a, "x after the sweep")
    assert not failures, "\n".join(failures)


# Initialisation recipes: each must equal the single-process op on the full tensor with the same seed.
_INITS = {
    "normal_": lambda t: nn.init.normal_(t, 0.5, 2.0),
    "uniform_": lambda t: nn.init.uniform_(t, -1.0, 3.0),
    "trunc_normal_": lambda t: nn.init.trunc_normal_(t, std=1.0),
    "trunc_normal_narrow": lambda t: nn.init.trunc_normal_(t, std=1.0, a=-0.3, b=0.2),
    "kaiming_uniform_": lambda t: nn.init.kaiming_uniform_(t, a=math.sqrt(5)),
    "kaiming_normal_": lambda t: nn.init.kaiming_normal_(t, mode="fan_out"),
    "xavier_uniform_": nn.init.xavier_uniform_,
    "xavier_normal_": nn.init.xavier_normal_,
    "zeros_": nn.init.zeros_,
    "ones_": nn.init.ones_,
    "constant_": lambda t: nn.init.constant_(t, 0.25),
    "fill_zero_": lambda t: t.fill_(-3).add_(t.clone().zero_()),
    "copy_full": lambda t: t.copy_(torch.arange(t.numel(), dtype=t.dtype).reshape(t.shape)),
    "copy_broadcast": lambda t: t.copy_(torch.arange(t.shape[-1], dtype=t.dtype)),
    "generator": lambda t: t.normal_(generator=torch.Generator().manual_seed(3)),
    "hf_embedding": lambda t: _zero_row(nn.init.normal_(t, std=0.02)),
    "bernoulli_": lambda t: t.bernoulli_(0.3),
    "exponential_": lambda t: t.exponential_(),
    "random_": lambda t: t.random_(0, 10),
    "randn_like": torch.randn_like,
    "rand_like_f64": lambda t: torch.rand_like(t, dtype=torch.float64),
    "dirac_": nn.init.dirac_,  # zero_ then x[i, j, k, l] = 1: chained selects of the flat local
}
_FAN_INITS = ("kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_")
# Recipes that need the whole matrix (QR, views): refused on every rank, by the dims they accept.
_REFUSED_INITS = {
    "orthogonal_": (2, nn.init.orthogonal_),
    "eye_": (2, nn.init.eye_),
    "sparse_": (2, lambda t: nn.init.sparse_(t, 0.5)),
}


def _init(mesh, case: Case, placement: RaggedShard) -> None:
    failures = []
    for name, init in _INITS.items():
        if (name in _FAN_INITS and len(case.shape) < 2) or (name == "dirac_" and len(case.shape) != 4):
            continue
        torch.manual_seed(1234)
        ref = torch.empty(case.shape)
        ref_out, ref_after = init(ref), torch.rand(3)
        x = distribute_tensor(torch.zeros(case.shape), mesh, [placement])
        torch.manual_seed(1234)
        out, after = init(x), torch.rand(3)
        try:
            if ref_out is ref:  # in place: the DTensor itself holds the values
                assert out is x, f"{name} returned a new tensor"
            _compare(out, ref_out, name)
            assert torch.equal(after, ref_after), f"{name}: the generator advanced differently"
        except Exception as e:
            failures.append(f"{name}: {type(e).__name__}: {str(e)[:300]}")
        dist.barrier()
    for name, (ndim, init) in _REFUSED_INITS.items():
        if len(case.shape) == ndim:
            try:
                _refused(init, distribute_tensor(torch.zeros(case.shape), mesh, [placement]), name)
            except Exception as e:
                failures.append(f"{name}: {type(e).__name__}: {str(e)[:300]}")
            dist.barrier()
    assert not failures, "\n".join(failures)


def _module_init(mesh, world: int) -> None:
    """nn.Linear.reset_parameters on RaggedShard parameters equals the seeded single-process init."""
    torch.manual_seed(5)
    ref = nn.Linear(6, 5)
    layout = {
        "weight": RaggedShard((0, 1), (0, *([1] * (world - 2)), 30 - world + 2)),
        "bias": RaggedShard((0,), (0,) * (world - 1) + (5,)),
    }
    lin = nn.Linear(6, 5)
    for name, p in list(lin.named_parameters()):
        setattr(lin, name, nn.Parameter(distribute_tensor(p.detach(), mesh, [layout[name]])))
    torch.manual_seed(5)
    lin.reset_parameters()
    for name, p in ref.named_parameters():
        _compare(getattr(lin, name), p.detach(), name)


def _hf_init_weights(mesh, world: int) -> None:
    """HuggingFace's own _init_weights (normal_, zeros_ of the padding row, ones_) on a tiny Llama."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, pad_token_id=3, tie_word_embeddings=False,
    )
    ref, model = LlamaForCausalLM(cfg), LlamaForCausalLM(cfg)
    for name, p in list(model.named_parameters()):
        rows = p.shape[0]
        units = (0, *([1] * (world - 2)), rows - (world - 2))  # device 0 holds nothing
        owner, attr = name.rpartition(".")[::2]
        ragged_p = distribute_tensor(p.detach(), mesh, [RaggedShard((0,), units)])
        setattr(model.get_submodule(owner), attr, nn.Parameter(ragged_p))
    torch.manual_seed(7)
    ref.apply(ref._init_weights)
    torch.manual_seed(7)
    model.apply(model._init_weights)
    for (name, want), got in zip(ref.named_parameters(), model.parameters()):
        _compare(got, want.detach(), name)


def _init_2d(world: int) -> None:
    """Random fills, copy_ and rand on a 2x2 mesh: RaggedShard inside a Shard / Replicate box."""
    mesh = init_device_mesh("cpu", (2, 2))
    for placements in (
        (Shard(0), RaggedShard((0,), (1, 3))),
        (RaggedShard((0, 1), (0, 24)), Shard(1)),
        (Replicate(), RaggedShard((0,), (3, 5))),
    ):
        for name, init in (("normal_", nn.init.normal_), ("copy_full", _INITS["copy_full"])):
            torch.manual_seed(3)
            ref = init(torch.empty(8, 6))
            x = distribute_tensor(torch.zeros(8, 6), mesh, placements)
            torch.manual_seed(3)
            _compare(init(x), ref, f"{name} {placements}")
        torch.manual_seed(4)
        got = dtensor.rand(8, 6, device_mesh=mesh, placements=placements)
        torch.manual_seed(4)
        _compare(got, torch.rand(8, 6), f"rand {placements}")


def _item_of_other_placements(mesh, world: int) -> None:
    """.item() of Replicate, Shard and Partial DTensors (the handler must not change torch's answers)."""
    a = full((world, 3), 8)
    for placement in (Replicate(), Shard(0)):
        x = distribute_tensor(a, mesh, [placement])
        assert x.sum().item() == a.sum().item(), placement
        assert x.amax().item() == a.amax().item(), placement
    part = DTensor.from_local(a[dist.get_rank()], mesh, [Partial()])
    assert part[0].item() == a[:, 0].sum().item()


def _factories(mesh, case: Case, placement: RaggedShard) -> None:
    shape = case.shape
    kw = {"device_mesh": mesh, "placements": [placement]}
    own = placement.core.local_numel(shape, dist.get_rank())
    for name, make, want in (
        ("zeros", lambda: dtensor.zeros(*shape, **kw), torch.zeros(shape)),
        ("ones", lambda: dtensor.ones(*shape, **kw), torch.ones(shape)),
        ("full", lambda: dtensor.full(shape, 2.5, **kw), torch.full(shape, 2.5)),
        ("empty", lambda: dtensor.empty(*shape, **kw).zero_(), torch.zeros(shape)),
    ):
        x = make()
        assert x.to_local().shape == (own,), f"{name}: local {tuple(x.to_local().shape)}, layout gives {own}"
        _compare(x, want, name)
    for name, make, ref in (("rand", dtensor.rand, torch.rand), ("randn", dtensor.randn, torch.randn)):
        torch.manual_seed(11)
        x, after = make(*shape, **kw), torch.rand(2)
        torch.manual_seed(11)
        want, ref_after = ref(shape), torch.rand(2)
        _compare(x, want, name)
        assert torch.equal(after, ref_after), f"{name}: the generator advanced differently"


def _bad_from_local(mesh, world: int) -> None:
    """A local of the wrong size on one rank: every rank raises the same error at from_local."""
    a = full((25, 3), 2)
    p = RaggedShard((0,), (0, *([1] * (world - 2)), 25 - (world - 2)))
    rank = dist.get_rank()
    good = ragged_local(a, p.local_units, rank).clone()
    _compare(DTensor.from_local(good, mesh, [p], shape=a.shape, stride=a.stride()), a, "good local")
    bad = torch.cat([good, good[:3]]) if rank == world - 1 else good
    with pytest.raises(ragged.PlacementError, match=rf"from_local: .*index {world - 1} has"):
        DTensor.from_local(bad, mesh, [p], shape=a.shape, stride=a.stride())


def _clip_inf(mesh, world: int, foreach: bool) -> None:
    """clip_grad_norm_(inf) over parameters some ranks hold nothing of."""
    layouts = [RaggedShard(c.dims, c.units) for c, _ in _layouts(world)[1:4]]
    shapes = [c.shape for c, _ in _layouts(world)[1:4]]
    refs = [nn.Parameter(full(s, 20 + i)) for i, s in enumerate(shapes)]
    dts = [nn.Parameter(distribute_tensor(r.detach(), mesh, [p])) for r, p in zip(refs, layouts)]
    for i, (r, d, p) in enumerate(zip(refs, dts, layouts)):
        r.grad = full(r.shape, 40 + i) / 4
        d.grad = distribute_tensor(r.grad, mesh, [p])
    for norm_type in (math.inf, 2.0):
        total = nn.utils.clip_grad_norm_(dts, 0.5, norm_type=norm_type, foreach=foreach)
        want = nn.utils.clip_grad_norm_(refs, 0.5, norm_type=norm_type, foreach=foreach)
        _compare(total, want, f"total norm {norm_type}")
        for i, (d, r) in enumerate(zip(dts, refs)):
            _compare(d.grad, r.grad, f"clipped grad {i} ({norm_type})")


def _all_cases(rank: int, world: int, mesh) -> dict:
    out = {}
    for case, placement in _layouts(world):
        out[f"sweep:{case.name}"] = lambda c=case, p=placement: _sweep(mesh, c, p)
        out[f"init:{case.name}"] = lambda c=case, p=placement: _init(mesh, c, p)
        out[f"factories:{case.name}"] = lambda c=case, p=placement: _factories(mesh, c, p)
    out["init:linear_reset_parameters"] = lambda: _module_init(mesh, world)
    out["item:other_placements"] = lambda: _item_of_other_placements(mesh, world)
    if world == 4:
        out["init:2d_mesh"] = lambda: _init_2d(world)
    if world == 3:  # importing transformers costs seconds per worker: one world size suffices
        out["init:hf_llama_init_weights"] = lambda: _hf_init_weights(mesh, world)
    out["from_local:wrong_size"] = lambda: _bad_from_local(mesh, world)
    out["clip_grad_norm_inf:foreach"] = lambda: _clip_inf(mesh, world, True)
    out["clip_grad_norm_inf:loop"] = lambda: _clip_inf(mesh, world, False)
    return out


def checks(rank: int, world: int) -> dict:
    return run_cases(_all_cases(rank, world, init_device_mesh("cpu", (world,))))


_run = Launcher(__file__)
_PAIRS = [(w, name) for w in WORLDS for name in _all_cases(0, w, None)]


@pytest.mark.parametrize(("world", "case"), _PAIRS, ids=[f"w{w}-{n}" for w, n in _PAIRS])
def test_op_sweep(world: int, case: str) -> None:
    assert_case(_run(world), case)
