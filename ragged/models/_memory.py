"""Per-device memory plan and model FLOPs of a training run, from shapes alone (before anything is allocated).

``memory_plan`` plans the model's units for the shard group (``gpus / replicas`` devices, HSDP replicates
over the rest) and adds up what one device holds during a step:

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
  inputs); with activation checkpointing only each layer's input is kept, plus one layer recomputed;
- logits: ``tokens x vocab`` in the compute dtype, fp32 for the loss, and its fp32 gradient.

``trained_llama(name)`` is the llama the runtimes build for a preset: the preset's own config for the
llamas; for the mixture-of-experts presets a dense llama with the preset's embedding, attention width and
depth whose feed-forward is as wide as the experts active per token (same FLOPs per token; routing, MLA
and attention sinks are not modelled, so its parameter count is the preset's *active* count).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ragged._errors import RaggedError
from ragged._layout import TensorSpec
from ragged._model_plan import plan_model
from ragged._planner import plan
from ragged._units import ModelShapes
from ragged.models._presets import LLAMA_CONFIGS, LlamaConfig, llama_shapes
from ragged.quant._tiles import tile_granularity

_TRAINED: dict[str, tuple[LlamaConfig, str]] = {
    **{name: (c, "the preset's llama") for name, c in LLAMA_CONFIGS.items()},
    "llama3.2-1b": (LlamaConfig(128256, 2048, 16, 32, 8, 64, 8192), "Llama 3.2 1B (untied head)"),
    "mixtral-8x7b": (LlamaConfig(32000, 4096, 32, 32, 8, 128, 2 * 14336, rope_theta=1e6),
                     "dense llama, FFN = 2 active experts x 14336 (router not modelled)"),
    "gpt-oss-120b": (LlamaConfig(201088, 2880, 36, 64, 8, 64, 4 * 2880, rope_theta=150000.0),
                     "dense llama, FFN = 4 active experts x 2880 (router, biases, sinks not modelled)"),
    "deepseek-v3": (LlamaConfig(129280, 7168, 61, 128, 128, 128, 9 * 2048, rope_theta=10000.0),
                    "dense llama, MHA instead of MLA, FFN = 8 routed + 1 shared expert x 2048"),
}

OPTIMIZER_STATE_BYTES = {"adamw": 8.0, "adam8bit": 2.0 + 8 / 1024, "muon": 4.0}
DTYPE_BYTES = {"fp32": 4, "bf16": 2}


def trained_model_names() -> tuple[str, ...]:
    return tuple(_TRAINED)


def trained_llama(name: str) -> tuple[LlamaConfig, str]:
    """The llama trained for preset ``name`` and one line saying what it models."""
    if name not in _TRAINED:
        raise RaggedError(f"unknown model {name!r}; trainable models: {', '.join(_TRAINED)}")
    return _TRAINED[name]


def flops_per_token(c: LlamaConfig, seq_len: int) -> float:
    """Training FLOPs per token: ``6 N + 12 n_layers n_heads head_dim seq_len`` (PaLM's convention).

    ``N`` counts the matmul parameters (every weight but the embedding table, which is a lookup).
    """
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
    tokens_per_device: int
    activation_checkpointing: bool
    numel: int
    padding_ratio: float
    params: int
    grads: int
    optimizer_state: int
    unsharded: int
    activations: int
    logits: int

    @property
    def shard_group(self) -> int:
        return self.gpus // self.replicas

    @property
    def total(self) -> int:
        return (self.params + self.grads + self.optimizer_state + self.unsharded + self.activations
                + self.logits)

    def rows(self) -> list[tuple[str, int]]:
        return [("parameters (fp32 master shards)", self.params), ("gradients (fp32 shards)", self.grads),
                (f"optimizer state ({self.optimizer})", self.optimizer_state),
                ("unsharded units (largest, x2 prefetch, + grads)", self.unsharded),
                ("activations (estimate)", self.activations), ("logits and loss", self.logits),
                ("total per device", self.total)]

    def describe(self) -> str:
        """The plan as plain text lines (what ``--dry-run`` prints)."""
        size = f"{self.numel / 1e9:.2f} B" if self.numel >= 1e8 else f"{self.numel / 1e6:.2f} M"
        head = (f"memory plan per device: {self.model} ({size} params), {self.gpus} "
                f"devices = {self.replicas} replica(s) x {self.shard_group} shards, {self.granularity}, "
                f"{self.dtype}, {self.optimizer}, {self.tokens_per_device} tokens/device, activation "
                f"checkpointing {'on' if self.activation_checkpointing else 'off'}; planner padding "
                f"{self.padding_ratio:.2%}")
        width = max(len(name) for name, _ in self.rows())
        return "\n".join([head, *(f"  {name:<{width}}  {gib(b):>10}" for name, b in self.rows())])


def gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


def _unit_sizes(shapes: ModelShapes, world: int, granularity: str) -> list[tuple[int, int]]:
    """``(S, world * S)`` per unit; ``granularity="tiles"`` is 8-bit Adam's rule (``tile_granularity``)."""
    if granularity != "tiles":
        return [(lay.shard_size, lay.total_numel) for lay in plan_model(shapes, world, granularity)]
    planned: dict[tuple, tuple[int, int]] = {}  # units with the same shapes plan alike
    for unit in shapes.units:
        key = tuple(shape for _, shape in unit.tensors)
        if key not in planned:
            specs = [TensorSpec(n, s, tile_granularity(s)) for n, s in unit.tensors]
            lay = plan(specs, world, name=unit.name)
            planned[key] = (lay.shard_size, lay.total_numel)
    return [planned[tuple(shape for _, shape in unit.tensors)] for unit in shapes.units]


def memory_plan(model: str, c: LlamaConfig, gpus: int, *, replicas: int = 1, granularity: str = "rows:1",
                dtype: str = "bf16", optimizer: str = "adamw", batch_per_device: int = 1, seq_len: int = 2048,
                activation_checkpointing: bool = False, shapes: ModelShapes | None = None) -> MemoryPlan:
    """Plan ``c`` (or ``shapes``) for ``gpus`` devices and estimate the bytes one device holds.

    ``granularity`` is a ``ragged`` granularity string for every matrix, or ``"tiles"`` for 8-bit Adam's
    32 x 32 tiles where a matrix tiles (``tile_granularity``), as the runtimes plan it.

    Raises:
        RaggedError: ``replicas`` does not divide ``gpus``, or an unknown dtype or optimizer.
        PlanningError / GranularityError: as ``plan_model``.
    """
    if gpus < 1 or replicas < 1 or gpus % replicas:
        raise RaggedError(f"memory_plan: {replicas} HSDP replicas must divide {gpus} devices")
    if dtype not in DTYPE_BYTES:
        raise RaggedError(f"memory_plan: dtype {dtype!r} is not one of {sorted(DTYPE_BYTES)}")
    if optimizer not in OPTIMIZER_STATE_BYTES:
        raise RaggedError(f"memory_plan: optimizer {optimizer!r} is not one of "
                          f"{sorted(OPTIMIZER_STATE_BYTES)}")
    shapes = shapes or llama_shapes(model, c)
    sizes = _unit_sizes(shapes, gpus // replicas, granularity)
    shard = sum(s for s, _ in sizes)
    biggest = max(total for _, total in sizes)
    cb = DTYPE_BYTES[dtype]
    tokens = batch_per_device * seq_len
    per_layer = cb * (2 * c.dim + 6 * c.n_heads * c.head_dim + 4 * c.ffn_dim) + 2 * 4 * c.dim
    if activation_checkpointing:
        activations = tokens * (c.n_layers * c.dim * cb + per_layer)
    else:
        activations = tokens * c.n_layers * per_layer
    buffers = sum(total for _, total in sizes)
    return MemoryPlan(
        model=model, gpus=gpus, replicas=replicas, granularity=granularity, dtype=dtype, optimizer=optimizer,
        tokens_per_device=tokens, activation_checkpointing=activation_checkpointing, numel=shapes.numel,
        padding_ratio=1 - shapes.numel / buffers, params=4 * shard, grads=4 * shard,
        optimizer_state=math.ceil(OPTIMIZER_STATE_BYTES[optimizer] * shard),
        unsharded=biggest * (2 * cb + cb + 4), activations=activations,
        logits=tokens * c.vocab_size * (cb + 8))
