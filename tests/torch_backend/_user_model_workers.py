"""What test_fsdp_user_models runs in each gloo worker: everyday models under ``fully_shard``.

Every case builds its model from a seed on every rank, trains three AdamW steps single-process (the
reference, on the whole batch), under our ``fully_shard`` and under PyTorch FSDP2 (each rank on its
rows of the batch), and returns the worst relative differences of losses and parameters against the
reference. HuggingFace models are tiny configs built in code (nothing is downloaded); one
``fully_shard`` per decoder layer, then the root.
"""

from __future__ import annotations

import copy
import functools
import os
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from tests.torch_backend._dist import run_cases

os.environ.setdefault("HF_HUB_OFFLINE", "1")
B, T, STEPS, VOCAB, SEED = 8, 8, 3, 128, 0  # 8 rows split evenly over 2 and 4 ranks
LR, WEIGHT_DECAY = 1e-2, 0.1


# ----- models ---------------------------------------------------------------------------------------
def _llama(tied: bool = False, **kwargs) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=T,
                         tie_word_embeddings=tied, attn_implementation="eager", **kwargs)
    return LlamaForCausalLM(config)


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=T, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager")
    return GPT2LMHeadModel(config)


def _bert() -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=T, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, attn_implementation="eager")
    return BertForMaskedLM(config)


def _qwen3_moe() -> nn.Module:
    """Experts in HF's eager loop: its default, grouped_mm, has no float64 kernel."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            num_experts=4, num_experts_per_tok=2, max_position_embeddings=T,
                            attn_implementation="eager", experts_implementation="eager")
    return Qwen3MoeForCausalLM(config)


def _lora_llama() -> nn.Module:
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_llama(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj",
                                                                                      "down_proj"]))
    for name, p in model.named_parameters():  # peft starts lora_B at zero: make the adapters matter
        if "lora_B" in name:
            nn.init.normal_(p, std=0.02)
    return model


MODELS: dict[str, Callable[[], nn.Module]] = {
    "gpt2": _gpt2, "llama_untied": _llama, "llama_tied": lambda: _llama(tied=True), "bert_mlm": _bert,
    "qwen3_moe": _qwen3_moe, "lora_llama": _lora_llama,
}


def _layers(model: nn.Module) -> list[nn.Module]:
    for path in ("base_model.model.model.layers", "model.layers", "transformer.h", "bert.encoder.layer"):
        m = model
        try:
            for part in path.split("."):
                m = getattr(m, part)
        except AttributeError:
            continue
        return list(m)
    raise AttributeError(f"no decoder layers found in {type(model).__name__}")


def build(name: str) -> nn.Module:
    torch.manual_seed(SEED)
    return MODELS[name]()


# ----- training -------------------------------------------------------------------------------------
def batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(100 + step))


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy (a masked LM's: of each token itself) in float32 or the model's wider
    dtype: HF's own loss casts the logits to float32, whose rounding would bound a float64 comparison.
    No padding: every row has the same tokens, so the mean over ranks is the mean over the batch."""
    logits = model(input_ids=tokens).logits
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if not type(model).__name__.endswith("ForMaskedLM"):
        logits, tokens = logits[:, :-1], tokens[:, 1:]
    return F.cross_entropy(logits.flatten(0, 1), tokens.flatten())


def train(model: nn.Module, rows: slice = slice(None)) -> list[float]:
    """Three AdamW steps on ``rows`` of each batch; returns the mean loss over every rank."""
    return adamw_steps(model, lambda step: _loss(model, batch(step)[rows]), STEPS, rows != slice(None))


def adamw_steps(model: nn.Module, step_loss: Callable[[int], torch.Tensor], steps: int,
                sharded: bool) -> list[float]:
    """``steps`` AdamW steps on ``step_loss(step)``; returns each step's loss, averaged over the ranks
    when ``sharded`` (each rank's loss is the mean over its rows)."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR,
                            weight_decay=WEIGHT_DECAY)
    losses = []
    for step in range(steps):
        loss = step_loss(step)
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss = loss.detach()
        if sharded:
            dist.all_reduce(loss)
            loss /= dist.get_world_size()
        losses.append(loss.item())
    return losses


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters(remove_duplicate=False)}


def _errors(got: dict, want: dict) -> dict[str, float]:
    """``||a - b|| / max(||b||, 0.01 * sqrt(numel))`` per tensor.

    The floor (an RMS of 0.01, the init scale) matters only for tensors that stay near zero because
    their exact gradient is zero (a key bias under softmax): Adam turns their rounding-level gradients
    into steps of arbitrary sign, on FSDP2 as on ours.
    """
    if got.keys() != want.keys():
        raise AssertionError(f"parameter names differ: {sorted(got.keys() ^ want.keys())}")
    return {n: float((got[n] - want[n]).norm() / max(float(want[n].norm()), 0.01 * want[n].numel() ** 0.5))
            for n in want}


def rel_errors(got: dict, want: dict) -> float:
    """The worst relative parameter error over tensors (the tests' parameter metric)."""
    return max(_errors(got, want).values())


def _worst(got: dict, want: dict) -> str:
    errors = _errors(got, want)
    return max(errors, key=errors.get)


def shard(model: nn.Module, mesh, which: str, **kwargs) -> nn.Module:
    if which == "ours":
        from torch_backend import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    for layer in _layers(model):
        fully_shard(layer, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    return model


def against(ref: Callable[[], dict], losses: list[float], params: dict) -> dict:
    """Worst relative loss and parameter errors against a single-process run, on rank 0 only (the
    other ranks would repeat the same run; the tests read rank 0's results)."""
    if dist.get_rank() != 0:
        return {}
    r = ref()
    return {"loss": max(abs(a - b) / abs(b) for a, b in zip(losses, r["losses"])),
            "params": rel_errors(params, r["params"]), "worst": _worst(params, r["params"])}


def compare(name: str, mesh, rank: int, world: int) -> dict:
    """Ours and FSDP2 on model ``name`` against its single-process training."""
    rows = slice(rank * B // world, (rank + 1) * B // world)
    out = {}
    for which in ("ours", "fsdp2"):
        model = shard(build(name), mesh, which)
        losses = train(model, rows)
        out[which] = against(lambda: reference(name), losses, full_params(model))
        out[which]["num_params"] = len(list(model.parameters()))
    out["reference_num_params"] = len(list(build(name).parameters()))
    return out


@functools.cache
def reference(name: str) -> dict:
    """Single-process training of model ``name`` on the whole batches."""
    model = _meta_initialized() if name == "meta_llama" else build(name)
    init = full_params(model)
    losses = train(model)
    return {"losses": losses, "params": full_params(model), "init": init}


# ----- the checks of one launch ---------------------------------------------------------------------
def checks(rank: int, world: int) -> dict:
    torch.set_default_dtype(torch.float64)  # every model and batch below but bf16's: parity far from rounding
    mesh = init_device_mesh("cpu", (world,))
    cases = {}
    for name in MODELS:
        cases[name] = lambda name=name: compare(name, mesh, rank, world)
    cases["bf16_llama"] = lambda: _bf16(mesh, rank, world)
    cases["meta_llama"] = lambda: _meta_llama(mesh, rank, world)
    cases["requires_grad_after_wrap"] = lambda: _requires_grad_after_wrap(mesh, rank, world)
    cases["unused_and_0d"] = lambda: _unused_and_0d(mesh)
    cases["sibling_tied"] = lambda: _sibling_tied(mesh)
    cases["state_dicts"] = lambda: _state_dicts(mesh)
    cases["forward_method"] = lambda: _forward_method(mesh)
    if world == 4:
        cases["small_mesh"] = _small_mesh
    return run_cases(cases)


def policy_reference(world: int, order: int | None = None) -> dict:
    """llama_untied trained in one process under the bf16 policy's casts: fp32 masters, each step's rows in
    ``world`` micro-batches (the ranks), each on a bf16 cast of the master, the gradients summed in fp32
    (``_policy_reference.train``); ``order``: the rows permuted, the same training summed in another order."""
    from tests.torch_backend import _policy_reference

    model = build("llama_untied").float()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR,
                            weight_decay=WEIGHT_DECAY)

    def loss_of(call, rows):
        logits = call(rows[0]).logits.float()[:, :-1]
        return F.cross_entropy(logits.flatten(0, 1), rows[0][:, 1:].flatten())

    out = _policy_reference.train(model, lambda step: (batch(step),), loss_of, STEPS, world, opt,
                                  torch.bfloat16, order)
    return {"losses": out["losses"], "params": out["params"]}


def _bf16(mesh, rank: int, world: int) -> dict:
    """Ours and FSDP2 under the same bf16 policy (fp32 masters and reductions), against each other and
    against the policy reference, with that reference's distances in other orders (``orders``)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy

    from tests.parity import SPREAD_ORDERS
    from tests.torch_backend._dist import shared
    from torch_backend import MixedPrecisionPolicy

    refs = shared({order: functools.partial(policy_reference, world, order)
                   for order in (None, *range(SPREAD_ORDERS))})
    policy = refs[None]

    def distances(losses: list[float], params: dict) -> dict:
        return {"loss": max(abs(a - b) / abs(b) for a, b in zip(losses, policy["losses"])),
                "params": rel_errors(params, policy["params"])}

    rows = slice(rank * B // world, (rank + 1) * B // world)
    losses, params = {}, {}
    for which, mp in (("ours", MixedPrecisionPolicy(torch.bfloat16, torch.float32)),
                      ("fsdp2", TorchPolicy(torch.bfloat16, torch.float32))):
        model = shard(build("llama_untied").float(), mesh, which, mp_policy=mp)
        losses[which] = train(model, rows)
        params[which] = {n: p.double() for n, p in full_params(model).items()}
    return {"loss": max(abs(a - b) / abs(b) for a, b in zip(losses["ours"], losses["fsdp2"])),
            "params": rel_errors(params["ours"], params["fsdp2"]),
            "ours_vs_policy": distances(losses["ours"], params["ours"]),
            "fsdp2_vs_policy": distances(losses["fsdp2"], params["fsdp2"]),
            "orders": [distances(refs[k]["losses"], refs[k]["params"]) for k in range(SPREAD_ORDERS)]}


def _meta_initialized(mesh=None) -> nn.Module:
    """Meta device, (``fully_shard`` when ``mesh``), ``to_empty``, then the model's own ``init_weights``."""
    with torch.device("meta"):
        model = MODELS["llama_untied"]()
    if mesh is not None:
        shard(model, mesh, "ours")
    model.to_empty(device="cpu")
    torch.manual_seed(SEED)
    model.init_weights()  # HF skips modules it initialised already: only a meta-built model runs it
    return model


def _meta_llama(mesh, rank: int, world: int) -> dict:
    """The meta-device recipe sharded trains like the same recipe single-process (same seed), and FSDP2
    trains the same initial values (built on CPU by the same recipe) on the same rows, as the baseline."""
    from torch_backend.fsdp import units

    model = _meta_initialized(mesh)
    storage = lambda t: t.untyped_storage().data_ptr()  # noqa: E731
    views = all(storage(r.module._parameters[r.attr].to_local()) == storage(u.master.shard)
                for u in units(model) for r in u.refs)
    init = full_params(model)
    rows = slice(rank * B // world, (rank + 1) * B // world)
    losses = train(model, rows)
    out = against(lambda: reference("meta_llama"), losses, full_params(model))
    fsdp2 = shard(_meta_initialized(), mesh, "fsdp2")
    fsdp2_losses = train(fsdp2, rows)
    baseline = against(lambda: reference("meta_llama"), fsdp2_losses, full_params(fsdp2))
    if rank == 0:
        out["init"] = rel_errors(init, reference("meta_llama")["init"])
        out["fsdp2"] = baseline
    return out | {"views": views}


def _requires_grad_after_wrap(mesh, rank: int, world: int) -> dict:
    """Built frozen, wrapped, then unfrozen: trains like a model that was never frozen."""
    model = build("llama_untied").requires_grad_(False)
    shard(model, mesh, "ours")
    model.requires_grad_(True)
    rows = slice(rank * B // world, (rank + 1) * B // world)
    losses = train(model, rows)
    return against(lambda: reference("llama_untied"), losses, full_params(model))


class _Scaled(nn.Module):
    """A 0-d learned scale and a layer that forward never uses."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.used, self.unused = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * self.used(x)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """Reads a parameter outside ``forward`` (like ``generate``-style helpers)."""
        return x @ self.used.weight.t()


def _unused_and_0d(mesh) -> dict:
    from torch_backend import fully_shard

    torch.manual_seed(SEED)
    plain = _Scaled()
    model = fully_shard(copy.deepcopy(plain), mesh=mesh)
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(1))
    for m in (plain, model):
        opt = torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
        for _ in range(STEPS):
            m(x).square().mean().backward()
            grads_none = {n: p.grad is None for n, p in m.named_parameters()}
            opt.step()
            opt.zero_grad()
    return {"scale_shape": list(model.scale.shape), "grad_none": grads_none,
            "params": rel_errors(full_params(model), full_params(plain))}


class _TiedPair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens))


def _sibling_tied(mesh) -> str:
    """Tied weights whose uses sit in sibling units: FSDP2's error, before any collective."""
    from torch_backend import fully_shard

    model = _TiedPair()
    fully_shard(model.embed, mesh=mesh)
    fully_shard(model.head, mesh=mesh)
    fully_shard(model, mesh=mesh)
    try:
        model(torch.zeros(2, 3, dtype=torch.long))
    except ValueError as e:
        return str(e)
    return "no error"


def _state_dicts(mesh) -> dict:
    """DCP's state-dict API, full and sharded, with and without broadcast from rank 0."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    plain = build("llama_untied")
    want = {k: v.detach().clone() for k, v in plain.state_dict().items()}
    out = {}
    model = shard(build("llama_untied"), mesh, "ours")
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    out["get_full"] = rel_errors(full, want)
    out["get_sharded"] = rel_errors({k: v.full_tensor() for k, v in get_model_state_dict(model).items()},
                                    want)
    for broadcast in (False, True):
        torch.manual_seed(123)
        other = shard(MODELS["llama_untied"](), mesh, "ours")
        source = dict(want) if not broadcast or dist.get_rank() == 0 else {}  # torch fills it in place
        set_model_state_dict(other, source, options=StateDictOptions(full_state_dict=True,
                                                                     broadcast_from_rank0=broadcast))
        out[f"set_full_broadcast={broadcast}"] = rel_errors(full_params(other), want)
    torch.manual_seed(123)
    other = shard(MODELS["llama_untied"](), mesh, "ours")
    other.load_state_dict(dict(want))
    out["load_state_dict_full"] = rel_errors(full_params(other), want)

    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    _loss(model, batch(0)).backward()
    opt.step()
    saved = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    fresh_opt = torch.optim.AdamW(other.parameters(), lr=LR)
    set_optimizer_state_dict(other, fresh_opt, saved, options=StateDictOptions(full_state_dict=True))
    again = get_optimizer_state_dict(other, fresh_opt, options=StateDictOptions(full_state_dict=True))
    out["optim_full_roundtrip"] = max(
        rel_errors({k: v for k, v in again["state"][n].items() if k != "step"},
                   {k: v for k, v in saved["state"][n].items() if k != "step"}) for n in saved["state"])
    sharded = get_optimizer_state_dict(model, opt)
    sharded_opt = torch.optim.AdamW(other.parameters(), lr=LR)
    set_optimizer_state_dict(other, sharded_opt, sharded)
    again = get_optimizer_state_dict(other, sharded_opt, options=StateDictOptions(full_state_dict=True))
    out["optim_sharded_roundtrip"] = max(
        rel_errors({k: v for k, v in again["state"][n].items() if k != "step"},
                   {k: v for k, v in saved["state"][n].items() if k != "step"}) for n in saved["state"])
    return out


def _forward_method(mesh) -> dict:
    """A method other than ``forward`` that transposes a parameter: refused naming the fix, then run
    through the hooks once registered."""
    from torch_backend import fully_shard, register_fsdp_forward_method

    torch.manual_seed(SEED)
    plain = _Scaled()
    model = fully_shard(copy.deepcopy(plain), mesh=mesh)
    x = torch.randn(3, 4)
    try:
        model.project(x)
        unregistered = "no error"
    except NotImplementedError as e:
        unregistered = str(e)
    register_fsdp_forward_method(model, "project")
    with torch.no_grad():
        return {"unregistered": unregistered,
                "registered": float((model.project(x) - plain.project(x)).abs().max())}


def _small_mesh() -> str:
    """A mesh over ranks 0 and 1 of 4: the same error on every rank, no rank left blocked."""
    from torch.distributed.device_mesh import DeviceMesh

    from torch_backend import fully_shard

    mesh = DeviceMesh("cpu", [0, 1])
    try:
        fully_shard(nn.Linear(4, 4), mesh=mesh)
    except ValueError as e:
        return str(e)
    return "no error"
