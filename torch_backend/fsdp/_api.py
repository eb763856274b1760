"""Policies of ``fully_shard`` (frozen values; this module imports no sibling).

``MixedPrecisionPolicy`` has FSDP2's fields in FSDP2's order, so ``torch.distributed.fsdp``'s own policy
object converts field for field (``as_mp_policy``). Offloading takes torch's own ``OffloadPolicy`` and
``CPUOffloadPolicy`` as they are (``offloads_to_cpu``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """FSDP2's mixed precision: an fp32 sharded master, a low-precision unsharded compute buffer.

    The sharded parameters (what the optimizer steps) keep their own dtype. Before the all-gather the
    local shard is cast once into a ``param_dtype`` shard, so the unsharded buffer and every unsharded
    parameter view are ``param_dtype``; gradients accumulate in ``param_dtype`` and are reduced in
    ``reduce_dtype`` (``param_dtype`` when None), then land in the master dtype.

    Args:
        param_dtype: dtype of the unsharded (compute) parameters; None keeps the master dtype.
        reduce_dtype: dtype of the gradient reduce-scatter (and HSDP all-reduce); None means
            ``param_dtype``.
        output_dtype: the dtype floating-point forward outputs are cast to (None: left as computed).
        cast_forward_inputs: cast the floating-point tensors among the forward's inputs to
            ``param_dtype`` (when it is set) before each module's forward, as FSDP2 does by default.

    Raises:
        TypeError: a dtype that is not a floating ``torch.dtype``.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for field_name in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, field_name)
            if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
                raise TypeError(f"MixedPrecisionPolicy.{field_name}={value!r} must be a floating torch.dtype")

    def compute_dtype(self, master: torch.dtype) -> torch.dtype:
        """The dtype of the unsharded parameters for a master dtype."""
        return self.param_dtype or master

    def reduction_dtype(self, master: torch.dtype) -> torch.dtype:
        """The dtype gradients are reduced in for a master dtype."""
        return self.reduce_dtype or self.param_dtype or master


def as_mp_policy(policy: object) -> MixedPrecisionPolicy:
    """Ours as is; torch's ``MixedPrecisionPolicy`` (or any object with its fields) field for field.

    Raises:
        TypeError: an object that lacks one of the policy's fields.
    """
    if policy is None:
        return MixedPrecisionPolicy()
    if isinstance(policy, MixedPrecisionPolicy):
        return policy
    names = [f.name for f in fields(MixedPrecisionPolicy)]
    missing = [n for n in names if not hasattr(policy, n)]
    if missing:
        raise TypeError(f"fully_shard: mp_policy={policy!r} is not a MixedPrecisionPolicy (no {missing}); "
                        "pass torch_backend's or torch.distributed.fsdp's MixedPrecisionPolicy")
    return MixedPrecisionPolicy(**{n: getattr(policy, n) for n in names})


def offloads_to_cpu(policy: object) -> tuple[bool, bool]:
    """``(offload, pin_memory)`` for torch's ``OffloadPolicy()`` (none) or ``CPUOffloadPolicy(pin_memory)``.

    Raises:
        TypeError: anything else (a policy this runtime does not know would be silently ignored).
    """
    if policy is None or type(policy) is OffloadPolicy:
        return False, False
    if isinstance(policy, CPUOffloadPolicy):
        return True, bool(policy.pin_memory)
    raise TypeError(f"fully_shard: offload_policy={policy!r} is not torch.distributed.fsdp's OffloadPolicy() "
                    "or CPUOffloadPolicy(pin_memory=...)")
