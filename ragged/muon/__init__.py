"""Distributed Muon's plan: which device runs Newton-Schulz on each matrix (its *NS device*), in what
order, at what cost, and how one matrix too large for one device splits over a group.

Both runtimes execute these plans; nothing here touches a tensor of a framework.

- ``assign_ns_devices``: one NS device per matrix (greedy largest-first over the FLOPs);
  ``ns_device_buckets``: the overlapped schedule (bucket ``j``: the ``j``-th matrix of every NS device);
  ``bucket_holdings``: one bucket's matrices as one redistribution;
- ``assign_groups``: NS devices per matrix, splitting matrices over groups to reach a ``max / mean``
  target; ``group_load`` and ``split_newton_schulz_*``: its costs and a numpy reference;
- ``newton_schulz_flops`` / ``newton_schulz_load``, ``NS_COEFFS`` / ``NS_STEPS``, ``muon_scale``;
- ``muon_matrices``: which parameters are matrices (3-D stacks of fused experts: one per expert);
  ``matrix_holdings``: what each device holds of one matrix of a stack; ``matrix_layout``: a unit's
  matrices as the tensors of a Layout.
"""

from ragged.muon._matrices import matrix_holdings, matrix_layout, muon_matrices
from ragged.muon._ns_devices import (
    NS_COEFFS,
    NS_STEPS,
    assign_ns_devices,
    bucket_holdings,
    muon_scale,
    newton_schulz_flops,
    newton_schulz_load,
    ns_device_buckets,
)
from ragged.muon._split import (
    assign_groups,
    group_load,
    split_newton_schulz_bytes,
    split_newton_schulz_flops,
    split_newton_schulz_reference,
)

__all__ = [
    "NS_COEFFS",
    "NS_STEPS",
    "muon_scale",
    "muon_matrices",
    "matrix_holdings",
    "matrix_layout",
    "newton_schulz_flops",
    "newton_schulz_load",
    "assign_ns_devices",
    "ns_device_buckets",
    "bucket_holdings",
    "assign_groups",
    "group_load",
    "split_newton_schulz_flops",
    "split_newton_schulz_bytes",
    "split_newton_schulz_reference",
]
