"""Policies of ``fully_shard`` (frozen values; this module imports no sibling)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


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

    Raises:
        TypeError: a dtype that is not a floating ``torch.dtype``.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        for field_name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, field_name)
            if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
                raise TypeError(f"MixedPrecisionPolicy.{field_name}={value!r} must be a floating torch.dtype")

    def compute_dtype(self, master: torch.dtype) -> torch.dtype:
        """The dtype of the unsharded parameters for a master dtype."""
        return self.param_dtype or master

    def reduction_dtype(self, master: torch.dtype) -> torch.dtype:
        """The dtype gradients are reduced in for a master dtype."""
        return self.reduce_dtype or self.param_dtype or master
