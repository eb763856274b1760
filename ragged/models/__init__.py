"""Models described by their tensor shapes, before anything is allocated.

- presets of public models: ``model_names``, ``model_shapes`` (a ``ModelShapes``: its ``UnitShapes``),
  ``LlamaConfig``, ``llama_shapes``, ``LLAMA_TINY`` (the llama both runtimes train);
- mixture-of-experts decoders: ``MoeConfig``, ``MOE_CONFIGS`` (full-size presets and CPU-sized ``*-tiny``
  ones), ``moe_shapes``, ``expert_shapes``; expert parallelism composed with FSDP:
  ``plan_expert_parallel`` (an ``ExpertParallelUnit`` per MoE layer, its tensors' ``ExpertSource``);
- tensor parallelism of the llamas: ``LLAMA_TP_SPLIT`` (Megatron's split, the one both runtimes apply),
  ``tp_split_dim``, ``check_tensor_parallel``, ``tp_local_shapes``, ``llama_tp_shapes``,
  ``TensorParallelError``;
- your own model: ``read_shapes_file`` / ``parse_shapes`` (JSON), ``model_units`` (a preset's units with
  granularities resolved); both give ``UnitSpecs``;
- estimates: ``memory_plan`` / ``MemoryPlan`` (per-device memory of a training run), ``flops_per_token``,
  ``trained_model`` / ``trained_shapes`` / ``trained_model_names`` (the model the runtimes build for a
  preset), ``trained_llama`` (a dense llama of the same active width), ``gib``.

``ModelShapes``, ``UnitShapes`` and ``UnitSpecs`` are defined in the core (``ragged/_units.py``) because
``plan_model`` reads them.
"""

from ragged._units import ModelShapes, UnitShapes, UnitSpecs
from ragged.models._expert_parallel import ExpertParallelUnit, ExpertSource, plan_expert_parallel
from ragged.models._memory import (
    MemoryPlan,
    flops_per_token,
    gib,
    memory_plan,
    trained_llama,
    trained_model,
    trained_model_names,
    trained_shapes,
)
from ragged.models._moe import MOE_CONFIGS, MoeConfig, expert_shapes, moe_shapes
from ragged.models._presets import LLAMA_TINY, LlamaConfig, llama_shapes, model_names, model_shapes
from ragged.models._shapes_file import model_units, parse_shapes, read_shapes_file
from ragged.models._tensor_parallel import (
    LLAMA_TP_SPLIT,
    TensorParallelError,
    check_tensor_parallel,
    llama_tp_shapes,
    tp_local_shapes,
    tp_split_dim,
)

__all__ = [
    "ModelShapes",
    "UnitShapes",
    "UnitSpecs",
    "model_names",
    "model_shapes",
    "LlamaConfig",
    "llama_shapes",
    "LLAMA_TINY",
    "MoeConfig",
    "MOE_CONFIGS",
    "moe_shapes",
    "expert_shapes",
    "ExpertParallelUnit",
    "ExpertSource",
    "plan_expert_parallel",
    "LLAMA_TP_SPLIT",
    "TensorParallelError",
    "check_tensor_parallel",
    "llama_tp_shapes",
    "tp_local_shapes",
    "tp_split_dim",
    "model_units",
    "parse_shapes",
    "read_shapes_file",
    "MemoryPlan",
    "memory_plan",
    "flops_per_token",
    "trained_llama",
    "trained_model",
    "trained_model_names",
    "trained_shapes",
    "gib",
]
