"""Per-device memory plan and model FLOPs of a training run, from shapes alone (before anything is allocated).

``memory_plan`` plans the model's units for the shard group (``gpus / (replicas x tp)`` devices; HSDP
replicates over ``replicas``, tensor parallelism splits each tensor over ``tp``) and adds up what one
device holds during a step. ``sharding="fsdp2"`` counts the same run under FSDP2's per-parameter
``Shard(0)`` instead of the planner (``ragged._baselines.fsdp2``: every tensor's dim 0 padded to a multiple
of the group, so a unit's shard and all-gather buffer carry that padding; everything else is counted alike):

- parameters: the fp32 master shards (the planner's ``S`` per unit, padding included);
- gradients: the fp32 gradient shards;
- optimizer state per shard element: AdamW 8 bytes (two fp32 moments), 8-bit Adam 2.008 (two int8
  moments and one fp32 scale per 32x32 tile and moment), Muon 4 (one fp32 momentum; its non-matrix
  parameters use AdamW, which this counts as Muon: they are under 1% of a llama);
- unsharded units: the largest unit gathered in the compute dtype twice (the one running and the one
  prefetched), plus its unsharded gradient in the compute and the reduce (fp32) dtypes;
- activations, an estimate for the llama forward that the runtimes train (eager attention through
  ``scaled_dot_product_attention``, no ``T x T`` score matrix kept): per token and layer, the tensors
  autograd saves (``2 dim + 6 n_heads head_dim + 4 ffn`` values in the compute dtype and the fp32 norm
  inputs, ``ffn`` the width a token goes through); an MoE layer also keeps its ``top_k`` gathered copies
  of the token and its fp32 routing probabilities; with activation checkpointing only each layer's input
  is kept, plus one layer recomputed;
- logits: ``tokens x vocab`` in the compute dtype, fp32 for the loss, and its fp32 gradient.

Tensor parallelism (llamas, ``tp > 1``), modelled as the runtimes run it (torchtitan's plan with sequence
parallelism between the blocks): the units are planned from the TP-local shapes (``ragged.models.
LLAMA_TP_SPLIT``), so every buffer term is the TP rank's; a TP group's ``tp`` devices train the same
``tokens``; of the activations, the heads' and hidden units' terms (``6 n_heads head_dim + 4 ffn``) and the
sequence-split ones between the blocks (the fp32 norm inputs, a checkpointed layer's input) are ``1/tp``,
while the normed input each block gathers over the sequence for its column-parallel matmuls (the
``2 dim``) is kept whole on every TP rank (DTensor saves the gathered tensor); with loss parallelism
(``loss_parallel=True``: torchtitan's default, what both runtimes do) the logits stay split by vocabulary
and the loss runs on the parts, so each of their three terms is ``tokens x vocab / tp``; without it the
head's output is gathered to the full vocabulary on every TP rank before the loss. TP's own
communication buffers (and loss parallelism's per-token max and sum) are not counted.

Expert parallelism (MoE, ``ep > 1``), torchtitan's arrangement as ``plan_expert_parallel`` plans it: each
MoE layer's routed experts leave the layer's unit and form one unit of ``E/ep`` experts per EP rank,
sharded over ``shard group / ep`` devices; the layer's unit and its experts are gathered together. At
balanced routing a device's experts receive ``top_k x tokens`` rows, as without EP, so the activations
are unchanged; the exchange adds the all-to-all token buffers of one MoE layer: dispatch and combine,
each a send and a receive buffer of ``top_k x tokens x dim`` in the compute dtype (torch's uneven
all-to-all; the JAX stack's static capacity pads them, up to ``E / top_k`` times at its default).

``trained_model(name)`` is the model both runtimes build for a preset: a ``LlamaConfig`` for the
llamas, an ``MoeConfig`` for the mixture-of-experts presets (``ragged.models._moe``), each with the shapes
``trained_shapes`` lists. ``trained_llama(name)`` is the dense stand-in the simulator still uses for the
MoE presets: the preset's embedding, attention and depth with a feed-forward as wide as
what one token goes through (the same FLOPs per token; its parameter count is the *active* count).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ragged._baselines import fsdp2
from ragged._errors import RaggedError
from ragged._granularity import Granularity, granularity_for
from ragged._layout import TensorSpec
from ragged._model_plan import plan_model
from ragged._planner import plan
from ragged._units import ModelShapes, UnitShapes
from ragged.models._expert_parallel import plan_expert_parallel
from ragged.models._moe import MOE_CONFIGS, MoeConfig, moe_shapes
from ragged.models._presets import LLAMA_CONFIGS, LlamaConfig, llama_shapes
from ragged.models._tensor_parallel import check_tensor_parallel, tp_local_shapes
from ragged.quant._tiles import tile_granularity

ModelConfig = LlamaConfig | MoeConfig

_LLAMAS: dict[str, tuple[LlamaConfig, str]] = {
    **{name: (c, "the preset's llama") for name, c in LLAMA_CONFIGS.items()},
    "llama3.2-1b": (LlamaConfig(128256, 2048, 16, 32, 8, 64, 8192), "Llama 3.2 1B (untied head)"),
}


def _describe(c: MoeConfig) -> str:
    shared = f" + a shared expert of {c.shared_expert_dim}" if c.shared_expert_dim else ""
    dense = f", {c.n_dense_layers} dense layer(s) first" if c.n_dense_layers else ""
    return (f"MoE: {c.n_experts} {c.experts} experts of {c.expert_dim}, top-{c.top_k} {c.scoring} "
            f"routing{shared}{dense}; llama attention")

OPTIMIZER_STATE_BYTES = {"adamw": 8.0, "adam8bit": 2.0 + 8 / 1024, "muon": 4.0}
DTYPE_BYTES = {"fp32": 4, "bf16": 2}
SHARDINGS = ("ragged", "fsdp2")


def trained_model_names() -> tuple[str, ...]:
    return (*_LLAMAS, *MOE_CONFIGS)


def _known(name: str) -> None:
    if name not in _LLAMAS and name not in MOE_CONFIGS:
        raise RaggedError(f"unknown model {name!r}; trainable models: {', '.join(trained_model_names())}")


def trained_model(name: str) -> tuple[ModelConfig, str]:
    """The model both runtimes train for preset ``name`` and one line saying what it is."""
    _known(name)
    if name in MOE_CONFIGS:
        return MOE_CONFIGS[name], _describe(MOE_CONFIGS[name])
    return _LLAMAS[name]


def trained_shapes(name: str, c: ModelConfig) -> ModelShapes:
    """The units of model ``c`` under the FQNs the runtimes' models use."""
    return moe_shapes(name, c) if isinstance(c, MoeConfig) else llama_shapes(name, c)


def trained_llama(name: str) -> tuple[LlamaConfig, str]:
    """A dense llama for preset ``name`` and one line saying what it models (for MoE presets, the stand-in
    with the active feed-forward width that the simulator uses)."""
    _known(name)
    if name in MOE_CONFIGS:
        c = MOE_CONFIGS[name]
        return c.llama(c.active_ffn_dim), (f"dense llama stand-in, FFN = {c.top_k} active experts x "
                                           f"{c.expert_dim}" + (" + 1 shared" if c.shared_expert_dim else "")
                                           + " (routing not modelled)")
    return _LLAMAS[name]


def _ffn_dim(c: ModelConfig) -> int:
    """The feed-forward width one token goes through (an MoE layer's active experts)."""
    return c.active_ffn_dim if isinstance(c, MoeConfig) else c.ffn_dim


def flops_per_token(c: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: ``6 N + 12 n_layers n_heads head_dim seq_len`` (PaLM's convention).

    ``N`` counts the matmul parameters a token uses (every weight but the embedding table, which is a
    lookup; of an MoE layer, the router and the active experts).
    """
    if isinstance(c, MoeConfig):
        dense = llama_shapes("model", c.llama(c.dense_ffn_dim)).units[1].numel
        moe = llama_shapes("model", c.llama(c.active_ffn_dim)).units[1].numel + c.n_experts * c.dim
        n = c.n_dense_layers * dense + (c.n_layers - c.n_dense_layers) * moe + c.vocab_size * c.dim + c.dim
    else:
        n = llama_shapes("model", c).numel - c.vocab_size * c.dim
    return 6.0 * n + 12.0 * c.n_layers * c.n_heads * c.head_dim * seq_len


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes one device holds at the peak of a training step (see the module docstring)."""

    model: str
    gpus: int
    replicas: int
    granularity: str
    dtype: str
    optimizer: str
    tokens_per_device: int  # the tokens one data-parallel rank trains per step (its TP group shares them)
    activation_checkpointing: bool
    numel: int
    padding_ratio: float
    params: int
    grads: int
    optimizer_state: int
    unsharded: int
    activations: int
    logits: int
    sharding: str = "ragged"
    tp: int = 1  # tensor-parallel degree: each tensor split over tp devices (llamas)
    ep: int = 1  # expert-parallel degree: each EP rank of the shard group holds E / ep experts (MoE)
    all_to_all: int = 0  # bytes of one MoE layer's all-to-all token buffers (EP only)
    loss_parallel: bool = True  # under TP: the logits and the loss split by vocabulary (vocab / tp each)

    @property
    def shard_group(self) -> int:
        """The devices each unit is sharded over (``gpus / (replicas x tp)``)."""
        return self.gpus // (self.replicas * self.tp)

    @property
    def total(self) -> int:
        return (self.params + self.grads + self.optimizer_state + self.unsharded + self.activations
                + self.logits + self.all_to_all)

    def rows(self) -> list[tuple[str, int]]:
        exchange = [("all-to-all token buffers (one MoE layer)", self.all_to_all)] if self.ep > 1 else []
        return [("parameters (fp32 master shards)", self.params), ("gradients (fp32 shards)", self.grads),
                (f"optimizer state ({self.optimizer})", self.optimizer_state),
                ("unsharded units (largest, x2 prefetch, + grads)", self.unsharded),
                ("activations (estimate)", self.activations), ("logits and loss", self.logits), *exchange,
                ("total per device", self.total)]

    def _grid(self) -> str:
        tp = f" x TP {self.tp}" if self.tp > 1 else ""
        ep = f" (EP {self.ep} x {self.shard_group // self.ep} for the experts)" if self.ep > 1 else ""
        return f"{self.replicas} replica(s) x {self.shard_group} shards{tp}{ep}"

    def describe(self) -> str:
        """The plan as plain text lines (what ``--dry-run`` prints)."""
        size = f"{self.numel / 1e9:.2f} B" if self.numel >= 1e8 else f"{self.numel / 1e6:.2f} M"
        tokens = (f"{self.tokens_per_device} tokens/device" if self.tp == 1 else
                  f"{self.tokens_per_device} tokens per TP group, loss parallel "
                  f"{'on' if self.loss_parallel else 'off'}")
        head = (f"memory plan per device: {self.model} ({size} params), {self.gpus} "
                f"devices = {self._grid()}, {self.granularity}, "
                f"{self.dtype}, {self.optimizer}, {tokens}, activation "
                f"checkpointing {'on' if self.activation_checkpointing else 'off'}; "
                f"{'planner' if self.sharding == 'ragged' else 'FSDP2 Shard(0)'} padding "
                f"{self.padding_ratio:.2%}")
        width = max(len(name) for name, _ in self.rows())
        return "\n".join([head, *(f"  {name:<{width}}  {gib(b):>10}" for name, b in self.rows())])


def gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


def _unit_sizes(shapes: ModelShapes, world: int, granularity: str, sharding: str = "ragged"
                ) -> list[tuple[int, int]]:
    """``(S, world * S)`` per unit; ``granularity="tiles"`` is 8-bit Adam's rule (``tile_granularity``);
    ``sharding="fsdp2"``: FSDP2's padded per-parameter ``Shard(0)`` (the blocks only count cuts there)."""
    if granularity != "tiles" and sharding == "ragged":
        return [(lay.shard_size, lay.total_numel) for lay in plan_model(shapes, world, granularity)]
    matrix = None if granularity == "tiles" else Granularity.parse(granularity)
    planned: dict[tuple, tuple[int, int]] = {}  # units with the same shapes plan alike
    for unit in shapes.units:
        key = tuple(shape for _, shape in unit.tensors)
        if key not in planned:
            specs = [TensorSpec(n, s, tile_granularity(s) if matrix is None else granularity_for(s, matrix))
                     for n, s in unit.tensors]
            shard = fsdp2(specs, world, 4).shard_size if sharding == "fsdp2" else \
                plan(specs, world, name=unit.name).shard_size  # align 4: plan's default for fp32
            planned[key] = (shard, world * shard)
    return [planned[tuple(shape for _, shape in unit.tensors)] for unit in shapes.units]


def _check(gpus: int, replicas: int, tp: int, ep: int, dtype: str, optimizer: str, sharding: str,
           seq_len: int, c: ModelConfig) -> None:
    if tp < 1 or gpus < 1 or gpus % tp:
        raise RaggedError(f"memory_plan: TP {tp} must divide the {gpus} devices")
    if replicas < 1 or (gpus // tp) % replicas:
        raise RaggedError(f"memory_plan: {replicas} HSDP replicas must divide {gpus // tp} data-parallel "
                          f"devices ({gpus} devices / TP {tp})")
    if tp > 1 and isinstance(c, MoeConfig):
        raise RaggedError(f"memory_plan: TP {tp} is modelled for the llamas (Megatron's split); split a "
                          "mixture of experts with ep instead")
    if tp > 1 and seq_len % tp:
        raise RaggedError(f"memory_plan: TP {tp} must divide seq_len={seq_len} (sequence parallelism splits "
                          "the sequence between the blocks)")
    if ep > 1 and not isinstance(c, MoeConfig):
        raise RaggedError(f"memory_plan: EP {ep} splits the experts of a mixture of experts; the model has "
                          "none")
    if ep < 1 or (gpus // (tp * replicas)) % ep:
        raise RaggedError(f"memory_plan: EP {ep} must divide the shard group of {gpus // (tp * replicas)} "
                          "devices (each EP rank's experts are sharded over shard group / EP devices)")
    if ep > 1 and sharding != "ragged":
        raise RaggedError(f"memory_plan: EP {ep} is planned with the planner only, not sharding={sharding!r}")
    if dtype not in DTYPE_BYTES:
        raise RaggedError(f"memory_plan: dtype {dtype!r} is not one of {sorted(DTYPE_BYTES)}")
    if optimizer not in OPTIMIZER_STATE_BYTES:
        raise RaggedError(f"memory_plan: optimizer {optimizer!r} is not one of "
                          f"{sorted(OPTIMIZER_STATE_BYTES)}")
    if sharding not in SHARDINGS:
        raise RaggedError(f"memory_plan: sharding {sharding!r} is not one of {SHARDINGS}")


def _expert_parallel_sizes(c: MoeConfig, shapes: ModelShapes, group: int, ep: int, granularity: str
                           ) -> tuple[list[tuple[int, int]], int, int]:
    """``(S, buffer)`` per unit, the largest set gathered at once and the buffer elements, under EP ``ep``.

    Each MoE layer's routed experts leave its unit and form their own (``plan_expert_parallel``: ``E/ep``
    experts over ``group / ep`` devices); a device holds one shard of each, and during the layer it gathers
    the layer's unit and its EP rank's experts together (the experts unit nests in the layer's).
    """
    rule = (lambda _, s: tile_granularity(s)) if granularity == "tiles" else granularity
    experts = {u.name: u.local for u in plan_expert_parallel(c, ep, group // ep, rule)}
    rest = ModelShapes(shapes.name, tuple(
        UnitShapes(u.name, tuple((n, s) for n, s in u.tensors if not n.startswith(f"{_experts_of(u.name)}.")))
        for u in shapes.units))
    sizes = _unit_sizes(rest, group, granularity)
    gathered = [total + (experts[_experts_of(u.name)].total_numel if _experts_of(u.name) in experts else 0)
                for u, (_, total) in zip(rest.units, sizes)]
    buffers = sum(t for _, t in sizes) + ep * sum(e.total_numel for e in experts.values())  # ep copies
    return sizes + [(e.shard_size, e.total_numel) for e in experts.values()], max(gathered), buffers


def _experts_of(layer: str) -> str:
    """The name ``plan_expert_parallel`` gives the experts unit of decoder layer ``layer``."""
    return f"{layer}.feed_forward.experts"


def _activations(c: ModelConfig, tokens: int, cb: int, tp: int, activation_checkpointing: bool) -> int:
    """Bytes of the activations autograd keeps for ``tokens`` tokens of a TP group (see the module docstring).

    Under TP the heads and hidden units a device computes are ``1/tp`` of them and, with sequence
    parallelism, so are the tokens between the blocks (the norms' fp32 inputs, a checkpointed layer's
    input); the normed input each block gathers over the sequence before its column-parallel matmuls is
    kept whole on every TP rank (DTensor saves the gathered tensor; Megatron re-gathers it instead).
    """
    split = cb * (6 * c.n_heads * c.head_dim + 4 * _ffn_dim(c)) // tp
    per_layer = tokens * (cb * 2 * c.dim + split) + tokens // tp * 2 * 4 * c.dim
    if isinstance(c, MoeConfig):
        per_layer += tokens * (cb * c.top_k * c.dim + 4 * c.n_experts)
    if activation_checkpointing:
        return tokens // tp * c.n_layers * c.dim * cb + per_layer
    return c.n_layers * per_layer


def memory_plan(model: str, c: ModelConfig, gpus: int, *, replicas: int = 1, tp: int = 1, ep: int = 1,
                granularity: str = "rows:1", dtype: str = "bf16", optimizer: str = "adamw",
                batch_per_device: int = 1, seq_len: int = 2048, activation_checkpointing: bool = False,
                shapes: ModelShapes | None = None, sharding: str = "ragged", loss_parallel: bool = True
                ) -> MemoryPlan:
    """Plan ``c`` (or ``shapes``) for ``gpus`` devices and estimate the bytes one device holds.

    ``gpus = replicas x shard group x tp``: ``tp`` devices split each llama tensor (``LLAMA_TP_SPLIT``) and
    the units are planned from the TP-local shapes over the shard group; ``ep`` EP ranks of the shard group
    each hold ``E/ep`` experts of every MoE layer (``plan_expert_parallel``). ``batch_per_device`` is the
    sequences each data-parallel rank trains (the ``tp`` devices of a TP group share them).
    ``granularity`` is a ``ragged`` granularity string for every matrix, or ``"tiles"`` for 8-bit Adam's
    32 x 32 tiles where a matrix tiles (``tile_granularity``), as the runtimes plan it. ``sharding`` is
    ``"ragged"`` (the planner) or ``"fsdp2"`` (FSDP2's padded per-parameter ``Shard(0)``, for comparison).
    ``loss_parallel`` (under TP): the logits stay split by vocabulary through the loss (torchtitan's
    ``loss_parallel``), ``vocab / tp`` columns per device; False counts them gathered to the full vocabulary.

    Raises:
        RaggedError: ``tp``, ``replicas`` or ``ep`` not dividing the devices as above, TP on a mixture of
            experts or EP on a dense model, or an unknown dtype, optimizer or sharding.
        TensorParallelError: ``tp`` does not divide the heads, the hidden units or the vocabulary.
        PlanningError / GranularityError: as ``plan_model`` and ``plan_expert_parallel``.
    """
    _check(gpus, replicas, tp, ep, dtype, optimizer, sharding, seq_len, c)
    shapes = shapes or trained_shapes(model, c)
    group = gpus // (tp * replicas)
    if tp > 1:
        check_tensor_parallel(c, tp)
    local = tp_local_shapes(shapes, tp) if tp > 1 else shapes
    if ep > 1:
        sizes, biggest, buffers = _expert_parallel_sizes(c, local, group, ep, granularity)
    else:
        sizes = _unit_sizes(local, group, granularity, sharding)
        biggest, buffers = max(total for _, total in sizes), sum(total for _, total in sizes)
    shard = sum(s for s, _ in sizes)
    cb = DTYPE_BYTES[dtype]
    tokens = batch_per_device * seq_len
    vocab = c.vocab_size // tp if loss_parallel else c.vocab_size  # the logits' columns on one device
    return MemoryPlan(
        model=model, gpus=gpus, replicas=replicas, granularity=granularity, dtype=dtype, optimizer=optimizer,
        tokens_per_device=tokens, activation_checkpointing=activation_checkpointing, numel=shapes.numel,
        padding_ratio=1 - local.numel / buffers, params=4 * shard, grads=4 * shard,
        optimizer_state=math.ceil(OPTIMIZER_STATE_BYTES[optimizer] * shard),
        unsharded=biggest * (2 * cb + cb + 4),
        activations=_activations(c, tokens, cb, tp, activation_checkpointing),
        logits=tokens * vocab * (cb + 8), sharding=sharding, tp=tp, ep=ep,
        all_to_all=4 * cb * c.top_k * tokens * c.dim if ep > 1 else 0, loss_parallel=loss_parallel)
