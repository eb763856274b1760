"""``simulate``: one training step of a model on N GPUs for ours, FSDP2 and Megatron-FSDP.

Per unit it turns the exact buffer bytes (``_workload``) into seconds with the alpha-beta collective
model (``_collectives``), HBM bandwidth (copies, elementwise kernels, the optimizer) and FLOP/s (GEMMs,
attention), each at its ``Efficiency``; ``_schedule`` overlaps them on a compute and a communication
stream. Memory is the memory plan (``ragged.models.memory_plan``) with each method's own shard and
buffer sizes, its transient copies and its allocator reserve.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from ragged import RaggedError
from ragged.bench._sweep import compare_units
from ragged.models import LlamaConfig, ModelShapes, UnitShapes, UnitSpecs, model_units
from ragged.models._memory import DTYPE_BYTES, OPTIMIZER_STATE_BYTES, MemoryPlan, flops_per_token, memory_plan
from ragged.simulate._collectives import collective_time
from ragged.simulate._efficiency import Efficiency
from ragged.simulate._hardware import Hardware
from ragged.simulate._schedule import COMPUTE, Op, UnitTimes, build_step, schedule
from ragged.simulate._workload import METHODS, UnitCost, unit_costs

# HBM bytes per shard element of one optimizer step: AdamW reads parameter, gradient and two moments
# (fp32) and writes parameter and moments; 8-bit Adam's moments are one byte each; Muon keeps one
# momentum (its Newton-Schulz FLOPs are not modelled).
AC_POLICIES = (True, False, "full", "none", "selective-op")
OPTIMIZER_HBM_BYTES = {"adamw": 28.0, "adam8bit": 16.0, "muon": 20.0}


@dataclass(frozen=True)
class StepConfig:
    """What is trained and how: per-device batch, sequence, precision, optimizer, recomputation, HSDP."""

    gpus: int
    replicas: int = 1
    batch_per_device: int = 1
    seq_len: int = 4096
    granularity: str = "rows:1"
    dtype: str = "bf16"
    optimizer: str = "adamw"
    # True (or "full"): recompute each layer's forward in backward; False: none; "selective-op": torchtitan's
    # op-level policy (it saves every matmul and attention output but every second matmul's).
    activation_checkpointing: bool | str = True

    def __post_init__(self) -> None:
        if self.activation_checkpointing not in AC_POLICIES:
            raise RaggedError(f"simulate: activation_checkpointing must be one of {list(AC_POLICIES)}, got "
                              f"{self.activation_checkpointing!r}")
        for name in ("gpus", "replicas", "batch_per_device", "seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise RaggedError(f"simulate: {name} must be an int >= 1, got {value!r}")
        if self.gpus % self.replicas:
            raise RaggedError(f"simulate: {self.replicas} HSDP replicas must divide {self.gpus} GPUs")

    @property
    def group_size(self) -> int:
        return self.gpus // self.replicas

    @property
    def tokens_per_device(self) -> int:
        return self.batch_per_device * self.seq_len


@dataclass(frozen=True)
class StepResult:
    """One method's simulated step (seconds, bytes) and its timeline (``ops``)."""

    method: str
    label: str
    hardware: str
    config: StepConfig
    step_s: float
    compute_s: float
    copy_s: float
    comm_s: float
    exposed_comm_s: float
    tokens_per_s: float
    mfu: float
    padding_ratio: float
    allgather_bytes: int  # one device receives per step (forward, and backward but for the last unit)
    memory: MemoryPlan
    transient_bytes: int
    reserve: float
    units: tuple[UnitCost, ...]
    times: tuple[UnitTimes, ...]
    ops: tuple[Op, ...]

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_s / self.config.gpus

    @property
    def held_bytes(self) -> int:
        """The memory plan with this method's buffers plus its transient copies (no allocator reserve)."""
        return self.memory.total + self.transient_bytes

    @property
    def peak_bytes(self) -> float:
        """``held_bytes`` with the allocator reserve the paper measured for the method."""
        return self.held_bytes * (1 + self.reserve)

    def fits(self, hw: Hardware) -> bool:
        return self.peak_bytes <= hw.hbm_bytes

    def summary(self) -> dict[str, Any]:
        """The scalar results, JSON-ready."""
        return {"method": self.method, "hardware": self.hardware, "gpus": self.config.gpus,
                "replicas": self.config.replicas, "group_size": self.config.group_size,
                "step_s": self.step_s, "compute_s": self.compute_s, "copy_s": self.copy_s,
                "comm_s": self.comm_s, "exposed_comm_s": self.exposed_comm_s,
                "tokens_per_s": self.tokens_per_s, "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
                "mfu": self.mfu, "padding_ratio": self.padding_ratio, "allgather_bytes": self.allgather_bytes,
                "memory_plan_bytes": self.memory.total, "transient_bytes": self.transient_bytes,
                "held_bytes": self.held_bytes, "reserve": self.reserve, "peak_bytes": self.peak_bytes}


def simulate(units: ModelShapes | Sequence[UnitSpecs], c: LlamaConfig, hw: Hardware, config: StepConfig, *,
             methods: Sequence[str] = tuple(METHODS), efficiency: Efficiency | None = None,
             name: str = "model") -> list[StepResult]:
    """Simulate one training step of ``units`` for each of ``methods``.

    Args:
        units: a preset's ``ModelShapes`` or the units of a shapes file (``UnitSpecs``), in model order:
            these give the parameter buffers.
        c: the llama whose compute, activations and logits stand in (``ragged.models.trained_llama``).
        hw: the hardware profile.
        config: GPUs, HSDP replicas, batch, sequence, precision, optimizer, activation checkpointing.
        methods: any of ``ours``, ``fsdp2``, ``megatron``.
        efficiency: fractions of peak (defaults stated in ``Efficiency``; calibrate to replace them).
        name: the model's name, for the memory plan.

    Returns:
        One ``StepResult`` per method, in the order given.

    Raises:
        RaggedError: an unknown method, dtype or optimizer, or a bad ``config``.

    Example:
        >>> from ragged.models import model_shapes, trained_llama
        >>> from ragged.simulate import StepConfig, hardware, simulate
        >>> c, _ = trained_llama("llama3-8b")
        >>> [r.method for r in simulate(model_shapes("llama3-8b"), c, hardware("h100"), StepConfig(8))]
        ['ours', 'fsdp2', 'megatron']
    """
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise RaggedError(f"simulate: unknown method(s) {unknown}; known: {', '.join(METHODS)}")
    if config.optimizer not in OPTIMIZER_HBM_BYTES:
        raise RaggedError(f"simulate: optimizer {config.optimizer!r} is not one of "
                          f"{sorted(OPTIMIZER_HBM_BYTES)}")
    specs = model_units(units, config.granularity) if isinstance(units, ModelShapes) else tuple(units)
    shapes = units if isinstance(units, ModelShapes) else ModelShapes(
        name, tuple(UnitShapes(u.name, tuple((t.name, t.shape) for t in u.tensors)) for u in specs))
    plan = memory_plan(name, c, config.gpus, replicas=config.replicas, granularity=config.granularity,
                       dtype=config.dtype, optimizer=config.optimizer,
                       batch_per_device=config.batch_per_device, seq_len=config.seq_len,
                       activation_checkpointing=config.activation_checkpointing in (True, "full"),
                       shapes=shapes)
    compared = compare_units(specs, config.group_size)
    eff = efficiency or Efficiency()
    return [_simulate_method(m, specs, compared, plan, c, hw, config, eff) for m in methods]


def _simulate_method(method: str, specs: Sequence[UnitSpecs], compared: list, plan: MemoryPlan,
                     c: LlamaConfig, hw: Hardware, config: StepConfig, eff: Efficiency) -> StepResult:
    cb = DTYPE_BYTES[config.dtype]
    costs = unit_costs(specs, method, config.group_size, c, tokens=config.tokens_per_device,
                       seq_len=config.seq_len, compute_bytes=cb, compared=compared)
    times = [unit_times(u, hw, config, eff) for u in costs]
    shard = sum(u.shard_numel for u in costs)
    opt_s = shard * OPTIMIZER_HBM_BYTES[config.optimizer] / (eff.optimizer * hw.hbm_bandwidth)
    ops = build_step(times, opt_s)
    step = schedule(ops)
    busy = sum(o.seconds for o in ops if o.stream == COMPUTE)
    copy_s = sum(o.seconds for o in ops if o.kind in ("copy_in", "copy_out"))
    comm_s = sum(o.seconds for o in ops if o.kind in ("all_gather", "reduce_scatter", "all_reduce"))
    tokens = config.gpus * config.tokens_per_device / step
    m = METHODS[method]
    biggest = max(u.buffer_numel for u in costs)
    return StepResult(
        method, m.label, hw.name, config, step, compute_s=busy - sum(
            o.seconds for o in ops if o.stream == COMPUTE and o.kind == "copy_out"),
        copy_s=copy_s, comm_s=comm_s, exposed_comm_s=step - busy, tokens_per_s=tokens,
        mfu=flops_per_token(c, config.seq_len) * tokens / config.gpus / hw.peak_flops,
        padding_ratio=1 - sum(u.used_numel for u in costs) / sum(u.buffer_numel for u in costs),
        allgather_bytes=(2 * sum(u.allgather_received_bytes for u in costs)
                         - costs[-1].allgather_received_bytes),
        memory=with_buffers(plan, [(u.shard_numel, u.buffer_numel) for u in costs]),
        transient_bytes=m.transient_units * biggest * cb, reserve=m.reserve,
        units=tuple(costs), times=tuple(times), ops=tuple(ops))


def unit_times(u: UnitCost, hw: Hardware, config: StepConfig, eff: Efficiency) -> UnitTimes:
    """Seconds of each piece of unit ``u``'s step on ``hw`` (see the module docstrings)."""
    g, r = config.group_size, config.replicas
    hbm = hw.hbm_bandwidth
    fwd = (u.gemm_flops / (eff.gemm * hw.peak_flops) + u.attention_flops / (eff.attention * hw.peak_flops)
           + u.elementwise_bytes / (eff.elementwise * hbm))
    ac = config.activation_checkpointing
    if ac in (True, "full"):
        recompute = fwd
    elif ac == "selective-op":  # its elementwise kernels run again; attention's output is saved
        recompute = (u.selective_op_gemm_flops / (eff.gemm * hw.peak_flops)
                     + u.elementwise_bytes / (eff.elementwise * hbm))
    else:
        recompute = 0.0
    return UnitTimes(
        u.name,
        all_gather=collective_time("all_gather", hw, g, u.ag_shard_bytes, efficiency=eff.all_gather),
        reduce_scatter=collective_time("reduce_scatter", hw, g, u.rs_shard_bytes,
                                       efficiency=eff.reduce_scatter),
        all_reduce=collective_time("all_reduce", hw, r, u.rs_shard_bytes, stride=g,
                                   efficiency=eff.all_reduce),
        ag_copy_in=u.ag_copy_in_bytes / (eff.copy * hbm), ag_copy_out=u.ag_copy_out_bytes / (eff.copy * hbm),
        rs_copy_in=u.rs_copy_in_bytes / (eff.cast_copy * hbm),
        rs_copy_out=u.rs_copy_out_bytes / (eff.copy * hbm),
        forward=fwd, backward=2 * fwd + recompute)


def with_buffers(plan: MemoryPlan, sizes: Sequence[tuple[int, int]]) -> MemoryPlan:
    """``plan`` with its buffer terms recomputed from ``(shard, buffer)`` elements per unit.

    The same terms as ``memory_plan``: fp32 parameter and gradient shards, the optimizer state per shard
    element, and the largest unit gathered twice in the compute dtype plus its gradient in the compute and
    fp32 reduce dtypes. For our own layouts this returns ``plan`` unchanged (a test checks it).
    """
    shard = sum(s for s, _ in sizes)
    biggest = max(b for _, b in sizes)
    cb = DTYPE_BYTES[plan.dtype]
    return replace(plan, params=4 * shard, grads=4 * shard,
                   optimizer_state=math.ceil(OPTIMIZER_STATE_BYTES[plan.optimizer] * shard),
                   unsharded=biggest * (2 * cb + cb + 4),
                   padding_ratio=1 - plan.numel / sum(b for _, b in sizes))
