"""What test_accelerate runs in each gloo worker: ``transformers.Trainer`` with accelerate's FSDP2 plugin.

``Trainer`` trains an HF causal LM (Llama) and an HF MoE (Qwen3-MoE) with ``fsdp_config={"version": 2}``:
accelerate's ``fsdp2_prepare_model`` shards each decoder layer, the embedding, the norm with the head,
then the root, with PyTorch FSDP2's ``fully_shard`` or, inside ``use_in_accelerate()``, with ours. A
single-process loop with the Trainer's optimizer (AdamW, constant learning rate, gradients clipped to
norm 1) on the whole batches is the reference. Each run saves a checkpoint (DCP, accelerate's
``SHARDED_STATE_DICT``) halfway; ours built from another seed resumes from ours' and must end where the
unbroken run ended. Last, accelerate's ``cpu_ram_efficient_loading`` preparation (rank 0's weights into
the model sharded on the meta device), ours and FSDP2, against the reference.
"""

from __future__ import annotations

import contextlib
import os
import shutil

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tests.torch_backend import _user_model_workers as U
from tests.torch_backend._dist import run_cases, shared_dir
from torch_backend import RaggedShard
from torch_backend.integrations import use_in_accelerate

STEPS, SAVE_AT, LR, MAX_GRAD_NORM = 4, 2, 1e-2, 1.0
MODELS = {"llama": ("llama_untied", "LlamaDecoderLayer"), "qwen3_moe": ("qwen3_moe", "Qwen3MoeDecoderLayer")}


def build(name: str, seed: int = 0) -> torch.nn.Module:
    """The model in float64 (tests/parity.py; the Trainer keeps a model's dtype without bf16/fp16 flags)."""
    torch.manual_seed(seed)
    return U.MODELS[MODELS[name][0]]().double()


class Batches(torch.utils.data.Dataset):
    """``STEPS`` batches of ``U.batch`` one row after another: accelerate's sharded sampler gives rank ``r``
    rows ``r * b, ..., (r + 1) * b - 1`` of each step's batch (``b`` rows per device, sequential order)."""

    def __init__(self) -> None:
        self.rows = torch.cat([U.batch(step) for step in range(STEPS)])

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def adamw_steps(model: torch.nn.Module, rows: slice = slice(None)) -> dict:
    """The Trainer's optimizer (AdamW, constant learning rate, gradients clipped to norm 1) for ``STEPS``
    steps on ``rows`` of each batch; returns each step's loss and gradient norm and the final parameters."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses, norms = [], []
    for step in range(STEPS):
        tokens = U.batch(step)[rows]
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        norms.append(float(norm.full_tensor() if isinstance(norm, DTensor) else norm))
    return {"losses": losses, "norms": norms, "params": U.full_params(model)}


def reference(name: str) -> dict:
    """Single-process training with the Trainer's optimizer on the whole batches."""
    return adamw_steps(build(name))


def _fsdp_on_cpu(plugin_args: dict) -> None:
    """Give accelerate's shared state the FSDP setting it gives GPU jobs.

    accelerate turns ``FullyShardedDataParallelPlugin`` on only for accelerator devices (``AcceleratorState``
    checks ``MULTI_GPU``, ``MULTI_XPU``, ...); a CPU gloo job stays ``MULTI_CPU`` and ``Trainer`` would wrap
    the model in DDP. This sets the state as a GPU job's would be (``distributed_type`` FSDP and the
    plugin built from the Trainer's own arguments), before ``Trainer`` makes its ``Accelerator``, which
    then finds the state made. Test set-up only: on GPUs accelerate does this itself.
    """
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    AcceleratorState._reset_state(reset_partial_state=True)
    state = Accelerator(cpu=True).state
    state.fsdp_plugin = FullyShardedDataParallelPlugin(**plugin_args)
    state.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP


def trainer_run(which: str, name: str, output_dir: str, *, seed: int = 0, resume: str | None = None) -> dict:
    """``Trainer.train`` for ``STEPS`` steps (checkpoint at ``SAVE_AT``), optionally resuming from a
    checkpoint; returns the logged losses and gradient norms and the full parameters at the end."""
    from transformers import Trainer, TrainingArguments

    world = dist.get_world_size()
    args = TrainingArguments(
        output_dir=output_dir, use_cpu=True, per_device_train_batch_size=U.B // world, max_steps=STEPS,
        learning_rate=LR, lr_scheduler_type="constant", optim="adamw_torch", weight_decay=0.0,
        max_grad_norm=MAX_GRAD_NORM, train_sampling_strategy="sequential", logging_steps=1,
        save_strategy="steps", save_steps=SAVE_AT, report_to="none", disable_tqdm=True,
        fsdp="full_shard", fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": [MODELS[name][1]],
                                        "state_dict_type": "SHARDED_STATE_DICT"})
    _fsdp_on_cpu(args.fsdp_plugin_args)
    trainer = Trainer(model=build(name, seed), args=args, train_dataset=Batches())
    with use_in_accelerate() if which == "ours" else contextlib.nullcontext():
        trainer.train(resume_from_checkpoint=resume)
    logs = [log for log in trainer.state.log_history if "loss" in log]
    return {"steps": [log["step"] for log in logs], "losses": [log["loss"] for log in logs],
            "norms": [float(log["grad_norm"]) for log in logs], "params": U.full_params(trainer.model),
            "ragged": _sharded_by_ours(trainer.model)}


def _sharded_by_ours(model: torch.nn.Module) -> bool:
    return any(isinstance(p.placements[0], RaggedShard) for p in model.parameters())


def _worst(got: list[float], want: list[float]) -> float:
    return max(abs(g - w) / abs(w) for g, w in zip(got, want))


def _errors(run: dict, ref: dict) -> dict:
    """Worst relative errors of the logged losses and gradient norms (a resumed run's log starts with the
    checkpoint's steps) and of the final parameters."""
    at = [step - 1 for step in run["steps"]]
    return {"loss": _worst(run["losses"], [ref["losses"][s] for s in at]),
            "grad_norm": _worst(run["norms"], [ref["norms"][s] for s in at]),
            "params": U.rel_errors(run["params"], ref["params"]), "steps": run["steps"],
            "ragged": run["ragged"]}


def trains_and_resumes(name: str) -> dict:
    """Ours and FSDP2 against the reference and each other; ours from another seed resumed at
    ``SAVE_AT`` from ours' checkpoint against the unbroken run."""
    ref = reference(name)
    out, runs, path = {}, {}, shared_dir()
    for which in ("ours", "fsdp2"):
        runs[which] = trainer_run(which, name, os.path.join(path, which))
        out[which] = _errors(runs[which], ref)
    out["ours_vs_fsdp2"] = U.rel_errors(runs["ours"]["params"], runs["fsdp2"]["params"])
    out["clipped"] = min(ref["norms"]) > MAX_GRAD_NORM  # every step compared clips its gradients
    resumed = trainer_run("ours", name, os.path.join(path, "resumed"), seed=1,
                          resume=os.path.join(path, "ours", f"checkpoint-{SAVE_AT}"))
    out["resumed"] = {**_errors(resumed, ref),
                      "vs_unbroken": U.rel_errors(resumed["params"], runs["ours"]["params"])}
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path)
    return out


def loads_rank0_weights(name: str) -> dict:
    """accelerate's ``cpu_ram_efficient_loading``: ``fsdp2_prepare_model`` moves every rank's model to the
    meta device, shards it there and gives it rank 0's weights by ``load_state_dict(assign=True)``
    (``fsdp2_load_full_state_dict``); then the reference's steps. The other ranks' models are built from
    another seed, so only rank 0's weights can give the reference's result. accelerate refuses the option
    on CPU when the plugin is made, so it is set on the plugin afterwards; ours and FSDP2."""
    from accelerate import Accelerator
    from accelerate.utils import fsdp2_prepare_model

    ref = reference(name)
    world, rank = dist.get_world_size(), dist.get_rank()
    rows = slice(rank * U.B // world, (rank + 1) * U.B // world)
    out = {}
    for which in ("ours", "fsdp2"):
        _fsdp_on_cpu({"fsdp_version": 2, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                      "transformer_cls_names_to_wrap": MODELS[name][1]})
        accelerator = Accelerator(cpu=True)  # finds the state just made
        accelerator.state.fsdp_plugin.cpu_ram_efficient_loading = True
        with use_in_accelerate() if which == "ours" else contextlib.nullcontext():
            model = fsdp2_prepare_model(accelerator, build(name, seed=0 if rank == 0 else 1))
        run = adamw_steps(model, rows)
        out[which] = {"params": U.rel_errors(run["params"], ref["params"]),
                      "ragged": _sharded_by_ours(model)}
    return out


def checks(rank: int, world: int) -> dict:
    # what torchrun sets, which accelerate reads (the process group itself is the harness's)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", HF_HUB_OFFLINE="1")
    cases = {name: lambda name=name: trains_and_resumes(name) for name in MODELS}
    cases["llama_rank0_weights"] = lambda: loads_rank0_weights("llama")
    return run_cases(cases)
