"""What test_fsdp_tp runs in each gloo worker: ragged FSDP composed with tensor parallelism (TP).

Every case applies TP first and FSDP after, torchtitan's order: the project's llama with its plan
(``torch_backend.models.tensor_parallel``: sequence parallel included) and a HuggingFace
``LlamaForCausalLM`` with the torchtitan-style plan below, on (dp, tp) meshes and on (replicate, dp, tp)
for HSDP. Each trains STEPS AdamW steps (clipped) on its dp rank's rows; the single-process reference
trains the same model, data and seed in the worker itself; PyTorch FSDP2 + TP runs the same case as the
baseline. Results are rank 0's worst relative loss and parameter errors against the reference (the
parameters read back with ``full_tensor()``, the placement's own gather).
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from ragged.models import LLAMA_TINY
from tests.torch_backend._user_model_workers import rel_errors

B, T, STEPS = 8, 8, 5  # 8 rows split over dp 1, 2 and 4; T splits over tp 2 (sequence parallel)
LR, WEIGHT_DECAY, MAX_NORM, SEED = 1e-3, 0.1, 1.0, 0


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


def hf_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """torchtitan's split of the projections (Megatron's), without sequence parallelism: HF builds its
    causal mask and positions from the embedding output, which must stay a whole (replicated) tensor."""
    parallelize_module(model, tp_mesh, {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    })
    for layer in model.model.layers:
        parallelize_module(layer, tp_mesh, {
            "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(),
        })
    return model


def logits_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return out if isinstance(out, torch.Tensor) else out.logits


def shard_llama(model: nn.Module, dp_mesh: DeviceMesh, which: str) -> None:
    from torch_backend.models import parallelize

    if which == "ours":
        parallelize(model, dp_mesh)
        return
    from torch.distributed.fsdp import fully_shard

    fully_shard(model.tok_embeddings, mesh=dp_mesh)
    for layer in model.layers:
        fully_shard(layer, mesh=dp_mesh)
    fully_shard([model.norm, model.output], mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)


def shard_hf(model: nn.Module, dp_mesh: DeviceMesh, which: str) -> None:
    if which == "ours":
        from torch_backend import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    for layer in model.model.layers:
        fully_shard(layer, mesh=dp_mesh)
    fully_shard(model.model.embed_tokens, mesh=dp_mesh)
    fully_shard([model.model.norm, model.lm_head], mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)


MODELS = {"llama": (llama, "ours", shard_llama), "hf": (hf_llama, "hf", shard_hf)}


def build(kind: str, mesh: DeviceMesh | None, which: str, dp: tuple[str, ...] = ("dp",)) -> nn.Module:
    """The model of ``kind``: plain for the reference (``mesh`` None), else TP on ``mesh["tp"]`` and then
    ``which`` FSDP ("ours" or "fsdp2") on ``mesh[dp]``."""
    make, tp_plan, shard = MODELS[kind]
    model = make()
    if mesh is None:
        return model
    if tp_plan == "hf":
        hf_tensor_parallel(model, mesh["tp"])
    else:
        from torch_backend.models import apply_tensor_parallel

        apply_tensor_parallel(model, mesh["tp"])
    shard(model, mesh[dp], which)
    return model


# ----- training -------------------------------------------------------------------------------------
def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, LLAMA_TINY.vocab_size, (B, T + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def clip(model: nn.Module, which: str) -> None:
    """Clip by the total gradient norm: ours over its buffers, FSDP2's and the reference's on full tensors
    (FSDP2's parameters may sit on two meshes, which torch's clip_grad_norm_ cannot stack)."""
    if which == "ours":
        from torch_backend import clip_grad_norm_

        clip_grad_norm_(model, MAX_NORM)
        return
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    full = [g.full_tensor() if isinstance(g, DTensor) else g for g in grads]
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in full]))
    coef = torch.clamp(MAX_NORM / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef)


def train(model: nn.Module, which: str, dp_rank: int = 0, dp_size: int = 1, steps: int = STEPS,
          opt: torch.optim.Optimizer | None = None) -> tuple[list[float], torch.optim.Optimizer]:
    """``steps`` AdamW steps on this dp rank's rows; the mean loss over the batch of every step."""
    from torch_backend.models import cross_entropy

    opt = opt or torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    rows = slice(dp_rank * B // dp_size, (dp_rank + 1) * B // dp_size)
    losses = []
    for step in range(steps):
        x, y = batch(step)
        loss = cross_entropy(logits_of(model, x[rows]), y[rows])
        loss.backward()
        clip(model, which)
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        if dist.is_initialized() and dp_size > 1:
            dist.all_reduce(total)  # every TP rank of a dp rank holds the same loss: divide by the world
            total /= dist.get_world_size()
        losses.append(float(total))
    return losses, opt


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in model.named_parameters()}


def errors(losses: list[float], params: dict, ref: dict) -> dict:
    return {"loss": max(abs(a - b) / abs(b) for a, b in zip(losses, ref["losses"])),
            "params": rel_errors(params, ref["params"])}


def reference(kind: str) -> dict:
    model = build(kind, None, "reference")
    losses, _ = train(model, "reference")
    return {"losses": losses, "params": full_params(model)}


def composed(kind: str, mesh: DeviceMesh, dp: tuple[str, ...], ref: dict) -> dict:
    """Ours and FSDP2 on the same TP case, each against the reference; and the placements ours shows."""
    dp_rank, dp_size = 0, 1
    for name in dp:  # HSDP: the replicas' rows, then the shards' within a replica
        dp_rank, dp_size = dp_rank * mesh.size(mesh.mesh_dim_names.index(name)) + mesh.get_local_rank(name), \
            dp_size * mesh.size(mesh.mesh_dim_names.index(name))
    out = {}
    for which in ("ours", "fsdp2"):
        model = build(kind, mesh, which, dp)
        losses, _ = train(model, which, dp_rank, dp_size)
        out[which] = errors(losses, full_params(model), ref)
        if which == "ours":
            out["placements"] = {n: [str(q) for q in p.placements] for n, p in model.named_parameters()}
    return out


# ----- checks ---------------------------------------------------------------------------------------
def _run(checks: dict[str, Callable[[], object]]) -> dict:
    out = {}
    for name, check in checks.items():
        try:
            out[name] = check()
        except BaseException:
            out[name] = {"error": traceback.format_exc()}
    return out


def checks(rank: int, world: int, ckpt_dir: str) -> dict:
    torch.manual_seed(0)
    if world == 4:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        return _run({
            "llama": lambda: composed("llama", mesh, ("dp",), reference("llama")),
            "hf": lambda: composed("hf", mesh, ("dp",), reference("hf")),
        })
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("replicate", "dp", "tp"))
    return _run({
        "llama_hsdp": lambda: composed("llama", mesh, ("replicate", "dp"), reference("llama")),
    })


if __name__ == "__main__":  # a quick manual run: python -m tests.torch_backend._tp_workers
    from tests.torch_backend._dist import launch

    print(launch(os.path.abspath(__file__), "checks", 4, "/tmp/tp_ckpt", timeout_s=600))
