"""What test_fsdp_tp runs in each gloo worker: ragged FSDP composed with tensor parallelism (TP).

Every case applies TP first and FSDP after, torchtitan's order: the project's llama with its plan
(``torch_backend.models.tensor_parallel``: sequence parallel included) and a HuggingFace
``LlamaForCausalLM`` with the torchtitan-style plan beside it (``apply_hf_llama_tensor_parallel``), on
(dp, tp) meshes and on (replicate, dp, tp) for HSDP; both with loss parallelism (the logits stay split by
vocabulary, the loss runs under ``loss_parallel()``) unless a case turns it off. Each trains STEPS AdamW
steps (clipped) on its dp rank's rows; the single-process reference trains the same model, data and seed;
PyTorch FSDP2 + TP runs the same case (the same loss parallelism) as the baseline. The ``structured``
cases train with 8-bit Adam and Muon instead, against the same optimizer in one process. Results are rank
0's worst relative loss and parameter errors against the reference (the parameters read back with
``full_tensor()``, the placement's own gather).

Everything that can runs in float64 (``FULL``: models, batches' activations, gloo's reductions; Muon
computes in at least its parameters' dtype). What cannot, bf16 mixed precision and 8-bit Adam (its moments
are 8-bit codes of fp32 values), runs with fp32 masters against ``micro_reference``: one process, each
step's rows in the run's dp micro-batches (each one's gradient apart, on a bf16 copy of the master under the
policy), also trained on SPREAD_ORDERS row permutations (the orders' distances bound the run's,
``tests.parity.assert_within_spread``). The references are trained once per launch, side by side on the
ranks (``_dist.shared``), not once per rank and case.
"""

from __future__ import annotations

import functools
import math
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import loss_parallel

from ragged.models import LLAMA_TINY
from tests.parity import SPREAD_ORDERS
from tests.torch_backend._dist import run_cases, shared
from tests.torch_backend._user_model_workers import rel_errors

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)  # torch's: both take it
FULL = torch.float64  # the parity cases' dtype (tests/parity.py); bf16 and 8-bit Adam keep fp32 masters
B, T, STEPS = 8, 8, 5  # 8 rows split over dp 1, 2 and 4; T splits over tp 2 (sequence parallel)
LR, WEIGHT_DECAY, MAX_NORM, SEED = 1e-3, 0.1, 1.0, 0
MUON_LR = 0.02
# 8-bit Adam's tile for the TP runs: llama-tiny's TP parts (wk: 16 x 64, w2: 64 x 88 of 64 x 176) cut its
# default 32x32 tiles (that refusal is a case below), and 8x8 tiles divide every part.
TP_TILE = (8, 8)


# ----- models ---------------------------------------------------------------------------------------
def llama() -> nn.Module:
    from torch_backend.models import Llama

    model = Llama()
    model.init_weights(SEED)
    return model


def hf_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    c = LLAMA_TINY
    config = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.dim, intermediate_size=c.ffn_dim,
                         num_hidden_layers=2, num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads,
                         head_dim=c.head_dim, max_position_embeddings=T, tie_word_embeddings=False,
                         attn_implementation="sdpa")
    torch.manual_seed(SEED)
    return LlamaForCausalLM(config)


def logits_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return out if isinstance(out, torch.Tensor) else out.logits


def shard_llama(model: nn.Module, dp_mesh: DeviceMesh, which: str, **kwargs) -> None:
    from torch_backend.models import parallelize

    if which == "ours":
        parallelize(model, dp_mesh, **kwargs)
        return
    from torch.distributed.fsdp import fully_shard

    fully_shard(model.tok_embeddings, mesh=dp_mesh, **kwargs)
    for layer in model.layers:
        fully_shard(layer, mesh=dp_mesh, **kwargs)
    fully_shard([model.norm, model.output], mesh=dp_mesh, **kwargs)
    fully_shard(model, mesh=dp_mesh, **kwargs)


def shard_hf(model: nn.Module, dp_mesh: DeviceMesh, which: str, **kwargs) -> None:
    if which == "ours":
        from torch_backend import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    for layer in model.model.layers:
        fully_shard(layer, mesh=dp_mesh, **kwargs)
    fully_shard(model.model.embed_tokens, mesh=dp_mesh, **kwargs)
    fully_shard([model.model.norm, model.lm_head], mesh=dp_mesh, **kwargs)
    fully_shard(model, mesh=dp_mesh, **kwargs)


MODELS = {"llama": (llama, "ours", shard_llama), "hf": (hf_llama, "hf", shard_hf)}


def build(kind: str, mesh: DeviceMesh | None, which: str, dp: tuple[str, ...] = ("dp",),
          loss_parallel: bool = True, dtype: torch.dtype = FULL, **shard_kwargs) -> nn.Module:
    """The model of ``kind`` in ``dtype``: plain for the reference (``mesh`` None), else TP on ``mesh["tp"]``
    (the logits split by vocabulary under ``loss_parallel``) and then ``which`` FSDP ("ours" or "fsdp2") on
    ``mesh[dp]`` with ``shard_kwargs``."""
    make, tp_plan, shard = MODELS[kind]
    model = make().to(dtype)
    if mesh is None:
        return model
    from torch_backend.models import apply_hf_llama_tensor_parallel, apply_tensor_parallel

    plan = apply_hf_llama_tensor_parallel if tp_plan == "hf" else apply_tensor_parallel
    plan(model, mesh["tp"], loss_parallel=loss_parallel)
    shard(model, mesh[dp], which, **shard_kwargs)
    return model


# ----- training -------------------------------------------------------------------------------------
def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, LLAMA_TINY.vocab_size, (B, T + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def clip(model: nn.Module, which: str) -> float:
    """Clip by the total gradient norm and return it: ours over its buffers, the reference with torch's
    ``clip_grad_norm_``, FSDP2 by hand (its parameters may sit on two meshes, which torch's
    ``clip_grad_norm_`` cannot stack): each rank's squares of its gradient shards, each over the number of
    ranks holding that shard (the world over the mesh dims that split it: a power of two, exact), summed
    by one all-reduce over the world -- the norm of the full gradients, without gathering them."""
    if which == "ours":
        from torch_backend import clip_grad_norm_

        return float(clip_grad_norm_(model, MAX_NORM))
    if which == "reference":
        return float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
    grads = [p.grad for p in model.parameters() if p.grad is not None]  # DTensors: FSDP2 shards them all
    squares = torch.zeros((), dtype=grads[0].dtype)
    for g in grads:  # Shard or FSDP2's _StridedShard (under TP's Shard) split a dim, Replicate copies it
        assert not any(q.is_partial() for q in g.placements), g.placements  # a partial sum is no shard
        shards = math.prod(g.device_mesh.size(d) for d, q in enumerate(g.placements) if not q.is_replicate())
        squares += g.to_local().square().sum() * (shards / dist.get_world_size())
    dist.all_reduce(squares)
    total = squares.sqrt()
    coef = torch.clamp(MAX_NORM / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef)
    return float(total)


def train(model: nn.Module, which: str, dp_rank: int = 0, dp_size: int = 1, steps: range = range(STEPS),
          opt: torch.optim.Optimizer | None = None) -> tuple[dict, torch.optim.Optimizer]:
    """``steps`` of ``opt`` (default AdamW) on this dp rank's rows: the mean loss over the batch and the
    gradient norm of each, and the shape of the logits this rank holds (its TP part under loss parallel).
    Forward and backward run under ``loss_parallel()``, as torchtitan's training step: it acts on logits
    split by vocabulary only, so gathered logits and the reference train as without it."""
    from torch_backend.models import cross_entropy

    opt = opt or torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    rows = slice(dp_rank * B // dp_size, (dp_rank + 1) * B // dp_size)
    out = {"losses": [], "norms": []}
    for step in steps:
        x, y = batch(step)
        with loss_parallel():
            logits = logits_of(model, x[rows])
            loss = cross_entropy(logits, y[rows])
            loss.backward()
        out["logits"] = list((logits.to_local() if isinstance(logits, DTensor) else logits).shape)
        out["norms"].append(clip(model, which))
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        if dist.is_initialized() and dp_size > 1:
            dist.all_reduce(total)  # every TP rank of a dp rank holds the same loss: divide by the world
            total /= dist.get_world_size()
        out["losses"].append(float(total))
    return out, opt


def structured_optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    """8-bit Adam (``TP_TILE`` tiles) or Muon over ``model``'s named parameters."""
    from torch_backend.optim import Adam8bit, Muon

    if name == "adam8bit":
        return Adam8bit(model.named_parameters(), lr=LR, weight_decay=WEIGHT_DECAY, tile=TP_TILE)
    return Muon(model.named_parameters(), lr=MUON_LR, weight_decay=WEIGHT_DECAY, adamw_lr=LR)


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in model.named_parameters()}


def rel(got: list[float], want: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(got, want))


def reference(kind: str, optimizer: str | None = None, more: int = 0) -> dict:
    """Single-process training in ``FULL`` on the whole batch (AdamW, or ``structured_optimizer``), STEPS
    steps; ``more``: then that many steps on, under ``"more"`` (their losses and the parameters after them:
    what the checkpoint's loaders train on to)."""
    model = build(kind, None, "reference")
    out, opt = train(model, "reference", opt=structured_optimizer(optimizer, model) if optimizer else None)
    ref = {**out, "params": full_params(model)}
    if more:
        after, _ = train(model, "reference", steps=range(STEPS, STEPS + more), opt=opt)
        ref["more"] = {**after, "params": full_params(model)}
    return ref


def micro_reference(kind: str, micro: int, compute: torch.dtype = torch.float32, optimizer: str | None = None,
                    order: int | None = None) -> dict:
    """Single-process training with fp32 masters in the run's ``micro`` dp micro-batches, each on the master
    cast to ``compute`` (``_policy_reference.train``), clipped, then AdamW (or ``structured_optimizer``);
    ``order``: the rows permuted, the same training summed in another order."""
    from tests.torch_backend import _policy_reference
    from torch_backend.models import cross_entropy

    master = build(kind, None, "reference", dtype=torch.float32)
    opt = structured_optimizer(optimizer, master) if optimizer else torch.optim.AdamW(
        master.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)

    def loss_of(call, rows):
        out = call(rows[0])
        return cross_entropy(out if isinstance(out, torch.Tensor) else out.logits, rows[1])

    out = _policy_reference.train(master, batch, loss_of, STEPS, micro, opt, compute, order,
                                  clip=lambda m: clip(m, "reference"))
    return {**out, "params": full_params(master)}


def distances(got: dict, ref: dict) -> dict:
    """A run's (or another order's) worst relative loss, gradient-norm and parameter errors from ``ref``."""
    return {"loss": rel(got["losses"], ref["losses"]), "norm": rel(got["norms"], ref["norms"]),
            "params": rel_errors(got["params"], ref["params"])}


def dp_position(mesh: DeviceMesh, dp: tuple[str, ...]) -> tuple[int, int]:
    """This rank's index among the data-parallel ranks and their number (HSDP: replica-major)."""
    rank, size = 0, 1
    for name in dp:
        n = mesh.size(mesh.mesh_dim_names.index(name))
        rank, size = rank * n + mesh.get_local_rank(name), size * n
    return rank, size


def composed(kind: str, mesh: DeviceMesh, dp: tuple[str, ...], ref: dict, loss_parallel: bool = True,
             dtype: torch.dtype = FULL, orders: list[dict] = (), also: dict | None = None,
             keep: dict | None = None, **shard_kwargs) -> dict:
    """Ours and FSDP2 on the same TP case (the same ``loss_parallel``, models in ``dtype``) against the
    reference ``ref`` and against each other; ours' placements and the logits shape each holds. ``orders``:
    ``ref`` trained in other orders (their distances from it: ``orders``); ``also``: more references, each
    run's distances from them (``{which}_vs_{label}``); ``keep``: given, ours' trained model and optimizer
    are left in it (``"ours"``), for ``dcp_save``."""
    from torch_backend import debug_counter

    out, params = {}, {}
    for which in ("ours", "fsdp2"):
        model = build(kind, mesh, which, dp, loss_parallel, dtype, **shard_kwargs)
        with debug_counter() as counter:
            got, opt = train(model, which, *dp_position(mesh, dp))
        if which == "ours":  # zero-copy with TP too: no bytes copied outside collectives, one reduce per unit
            if keep is not None:
                keep["ours"] = model, opt
            out["copy_bytes"] = counter.copy_bytes
            out["reduce_scatters"] = sorted(set(counter.per_label("reduce_scatter").values()))
        params[which] = full_params(model)
        out[which] = {**distances({**got, "params": params[which]}, ref), "logits": got["logits"]}
        for label, other in (also or {}).items():
            out[f"{which}_vs_{label}"] = distances({**got, "params": params[which]}, other)
        if which == "ours":
            out["placements"] = {n: [str(q) for q in p.placements] for n, p in model.named_parameters()}
            out["dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
    out["ours_vs_fsdp2"] = rel_errors(params["ours"], params["fsdp2"])
    out["orders"] = [distances(o, ref) for o in orders]
    return out


def structured(kind: str, mesh: DeviceMesh, optimizer: str, ref: dict, dp: tuple[str, ...] = ("dp",),
               orders: list[dict] = ()) -> dict:
    """8-bit Adam (fp32 masters) or Muon (``FULL``) on ours + TP (FSDP on ``mesh[dp]``) against the same
    optimizer on the same model in one process (``ref``; 8-bit Adam's in the run's micro-batches, with
    ``orders``: the same in other orders)."""
    import ragged.quant

    dtype = torch.float32 if optimizer == "adam8bit" else FULL
    tiles = {"granularity": lambda name, shape: ragged.quant.tile_granularity(shape, tile=TP_TILE)}
    model = build(kind, mesh, "ours", dp, dtype=dtype, **(tiles if optimizer == "adam8bit" else {}))
    got, _ = train(model, "ours", *dp_position(mesh, dp), opt=structured_optimizer(optimizer, model))
    initial = full_params(build(kind, None, "reference", dtype=dtype))
    return {**distances({**got, "params": full_params(model)}, ref),
            "moved": rel_errors(ref["params"], initial), "orders": [distances(o, ref) for o in orders]}


def redistributed(mesh: DeviceMesh) -> dict:
    """Our sharded parameters redistributed to Replicate everywhere and to their TP placement alone (the
    unsharded TP form) hold the reference's initial values: the worst absolute difference of each."""
    want = {n: p.detach() for n, p in full_params(build("llama", None, "reference")).items()}
    model = build("llama", mesh, "ours")
    worst = {"replicate": 0.0, "tp_only": 0.0}
    for n, p in model.named_parameters():
        everywhere = p.redistribute(p.device_mesh, [Replicate()] * p.device_mesh.ndim).to_local()
        worst["replicate"] = max(worst["replicate"], float((everywhere - want[n]).abs().max()))
        tp = p.placements[1:]  # (RaggedShard on dp, the TP placement on tp): gather over dp only
        local = p.redistribute(p.device_mesh, [Replicate(), *tp]).to_local()
        expected = want[n]
        if tp and isinstance(tp[0], Shard):
            expected = expected.chunk(mesh["tp"].size(), dim=tp[0].dim)[mesh.get_local_rank("tp")]
        worst["tp_only"] = max(worst["tp_only"], float((local - expected).abs().max()))
    return worst


def refusals(mesh: DeviceMesh) -> dict[str, str]:
    """What fully_shard and the structure-aware optimizers refuse of TP DTensors, each on every rank
    before any collective."""
    import ragged.quant
    from torch_backend import fully_shard
    from torch_backend.optim import Adam8bit

    def attempt(weight: DTensor, dp_mesh: DeviceMesh = mesh["dp"]) -> str:
        layer = nn.Linear(4, 4, bias=False)
        layer.weight = nn.Parameter(weight)
        try:
            fully_shard(layer, mesh=dp_mesh)
        except Exception as e:  # noqa: BLE001
            return f"{type(e).__name__}: {e}"
        return "no error"

    def adam8bit_32x32() -> str:  # llama-tiny's wk (32 x 64, colwise): 16 rows per TP rank
        tiles = ragged.quant.tile_granularity
        model = build("llama", mesh, "ours", granularity=lambda _, shape: tiles(shape))
        try:
            Adam8bit(model.named_parameters(), lr=LR)
        except Exception as e:  # noqa: BLE001
            return f"{type(e).__name__}: {e}"
        return "no error"

    def loss_outside_loss_parallel() -> str:  # TP alone: the logits split by vocabulary, no FSDP state
        from torch_backend.models import apply_tensor_parallel, cross_entropy

        x, y = batch(0)
        try:
            cross_entropy(apply_tensor_parallel(llama(), mesh["tp"])(x), y)
        except Exception as e:  # noqa: BLE001
            return f"{type(e).__name__}: {e}"
        return "no error"

    other = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    return {
        "adam8bit": adam8bit_32x32(),
        "loss_parallel": loss_outside_loss_parallel(),
        "partial": attempt(DTensor.from_local(torch.ones(4, 4), mesh["tp"], [Partial()])),
        "uneven": attempt(distribute_tensor(torch.ones(3, 4), mesh["tp"], [Shard(0)])),
        "other_mesh": attempt(distribute_tensor(torch.ones(4, 4), other["b"], [Shard(0)])),
        "same_dims": attempt(distribute_tensor(torch.ones(4, 4), mesh["dp"], [Shard(0)])),
        "dp_uses_tp": attempt(distribute_tensor(torch.ones(4, 4), mesh["tp"], [Shard(0)]), mesh["dp", "tp"]),
    }


def _saved_file(ckpt_dir: str) -> Path:
    return Path(ckpt_dir) / "tp2x2_full.pt"


def dcp_save(trained: dict, ckpt_dir: str, ref: dict) -> dict:
    """Save a DCP checkpoint of our llama trained STEPS steps at (dp 2, tp 2) (the ``llama`` case's run,
    ``composed``'s ``keep``), and keep (rank 0) the full parameters and AdamW state it holds for the loaders
    to compare with, beside ``ref``: the reference of the loaders' step on (``reference``'s ``more``)."""
    from torch_backend import save_dcp_checkpoint

    model, opt = trained["ours"]
    save_dcp_checkpoint(Path(ckpt_dir) / "tp2x2", model, opt)  # FULL: the checkpoint holds float64
    full = {"params": full_params(model), "state": full_state(model, opt), "reference": ref}
    if dist.get_rank() == 0:
        torch.save(full, _saved_file(ckpt_dir))
    dist.barrier()
    first = opt.state[next(iter(model.parameters()))]
    return {"placements": sorted({str(v.placements) for v in first.values() if isinstance(v, DTensor)})}


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    return {f"{n}.{k}": (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for n, p in model.named_parameters() for k, v in opt.state[p].items()}


def dcp_load(mesh: DeviceMesh, ckpt_dir: str) -> dict:
    """Load the (dp 2, tp 2) checkpoint at this mesh: parameters and AdamW state equal to what was saved
    (worst absolute difference), then one more step against the reference's step STEPS + 1 (saved beside
    them: ``reference("llama", more=1)["more"]``)."""
    from torch_backend import load_dcp_checkpoint

    saved = torch.load(_saved_file(ckpt_dir))
    ref = saved["reference"]
    model = build("llama", mesh, "ours")
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    load_dcp_checkpoint(Path(ckpt_dir) / "tp2x2", model, opt)
    params, state = full_params(model), full_state(model, opt)
    out = {"params": max(float((params[n] - v).abs().max()) for n, v in saved["params"].items()),
           "state": max(float((state[k] - v).abs().max()) for k, v in saved["state"].items()),
           "state_keys": sorted(state) == sorted(saved["state"])}
    got, _ = train(model, "ours", *dp_position(mesh, ("dp",)), steps=range(STEPS, STEPS + 1), opt=opt)
    out["loss"] = rel(got["losses"], ref["losses"])
    out["after"] = rel_errors(full_params(model), ref["params"])
    return out


# ----- checks ---------------------------------------------------------------------------------------
def references(world: int) -> dict:
    """Every reference a launch of ``world`` ranks compares with, each trained once (``_dist.shared``):
    float64 AdamW of each model (llama's with the checkpoint's extra step, at 4 ranks: the 2-rank launch
    finds it in the checkpoint's directory), float64 Muon, and the fp32 micro-batched references of bf16
    and 8-bit Adam with their SPREAD_ORDERS other orders (dp 2, or the 4 data-parallel ranks of HSDP at 8
    ranks)."""
    micro = 2 if world == 4 else 4
    jobs = {"llama": functools.partial(reference, "llama", more=1 if world == 4 else 0),
            "hf": functools.partial(reference, "hf"),
            "llama muon": functools.partial(reference, "llama", "muon")}
    spread = [("llama", "adam8bit", torch.float32)]
    if world == 4:
        jobs |= {"hf muon": functools.partial(reference, "hf", "muon")}
        spread += [("hf", "adam8bit", torch.float32), ("llama", None, torch.bfloat16)]
    for kind, optimizer, compute in spread:
        for order in (None, *range(SPREAD_ORDERS)):
            jobs[(kind, optimizer, str(compute), order)] = functools.partial(
                micro_reference, kind, micro, compute, optimizer, order)
    return shared(jobs)


def spread_of(refs: dict, kind: str, optimizer: str | None, compute: torch.dtype) -> tuple[dict, list[dict]]:
    """A micro-batched reference and its other orders."""
    key = (kind, optimizer, str(compute))
    return refs[(*key, None)], [refs[(*key, k)] for k in range(SPREAD_ORDERS)]


def checks(rank: int, world: int, ckpt_dir: str) -> dict:
    torch.manual_seed(0)
    if world == 2:  # after the 4-rank launch wrote the checkpoint
        return run_cases({"dcp_load_dp1_tp2": lambda: dcp_load(
            init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp")), ckpt_dir)})
    refs = references(world)
    llama, hf = refs["llama"], refs["hf"]
    if world == 4:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        policy, policy_orders = spread_of(refs, "llama", None, torch.bfloat16)
        llama8, llama8_orders = spread_of(refs, "llama", "adam8bit", torch.float32)
        hf8, hf8_orders = spread_of(refs, "hf", "adam8bit", torch.float32)
        trained: dict = {}  # the llama case's run, which dcp_save checkpoints
        return run_cases({
            "llama": lambda: composed("llama", mesh, ("dp",), llama, keep=trained),
            "hf": lambda: composed("hf", mesh, ("dp",), hf),
            "llama_gathered_logits": lambda: composed("llama", mesh, ("dp",), llama, loss_parallel=False),
            "llama_bf16": lambda: composed("llama", mesh, ("dp",), policy, dtype=torch.float32,
                                           orders=policy_orders, also={"full": llama}, mp_policy=BF16),
            "llama_adam8bit": lambda: structured("llama", mesh, "adam8bit", llama8, orders=llama8_orders),
            "llama_muon": lambda: structured("llama", mesh, "muon", refs["llama muon"]),
            "hf_adam8bit": lambda: structured("hf", mesh, "adam8bit", hf8, orders=hf8_orders),
            "hf_muon": lambda: structured("hf", mesh, "muon", refs["hf muon"]),
            "redistribute": lambda: redistributed(mesh),
            "refusals": lambda: refusals(mesh),
            "dcp_save": lambda: dcp_save(trained, ckpt_dir, llama["more"]),
            "dcp_load_dp4_tp1": lambda: dcp_load(
                init_device_mesh("cpu", (4, 1), mesh_dim_names=("dp", "tp")), ckpt_dir),
        })
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("replicate", "dp", "tp"))
    hsdp = ("replicate", "dp")
    adam8bit, adam8bit_orders = spread_of(refs, "llama", "adam8bit", torch.float32)
    return run_cases({
        "llama_hsdp": lambda: composed("llama", mesh, hsdp, llama),
        "hf_hsdp": lambda: composed("hf", mesh, hsdp, hf),
        "llama_hsdp_adam8bit": lambda: structured("llama", mesh, "adam8bit", adam8bit, hsdp, adam8bit_orders),
        "llama_hsdp_muon": lambda: structured("llama", mesh, "muon", refs["llama muon"], hsdp),
    })


if __name__ == "__main__":  # a manual run: python -m tests.torch_backend._tp_workers WORLD
    import sys

    from tests.torch_backend._dist import launch

    world = int(sys.argv[1])
    print(launch(os.path.abspath(__file__), "checks", world, "/tmp/tp_ckpt", timeout_s=600)[0])
