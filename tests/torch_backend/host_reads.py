"""Count the calls that read device memory on the host: on a GPU each one waits for the stream (a sync).

``torch.cuda.set_sync_debug_mode`` reports syncs only on CUDA; on CPU nothing syncs, so this counts the
calls that would: ``item`` / ``bool`` / ``int`` (``_local_scalar_dense``), ``tolist``, and the ops whose
output size depends on the data (``nonzero``, ``unique``, ``masked_select``, a boolean index,
``repeat_interleave`` without ``output_size``). ``tolist`` reads a CPU tensor without dispatching, so it
is counted where it is called; the others where they dispatch, wherever they were called from.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_DATA_SIZED = {"aten::nonzero", "aten::_unique2", "aten::unique_dim", "aten::unique_consecutive",
               "aten::masked_select"}


def _reads_host(func, args) -> bool:
    name = func._schema.name
    if name == "aten::_local_scalar_dense" or name in _DATA_SIZED:
        return True
    if name == "aten::repeat_interleave" and func._overloadname == "Tensor":
        return args[-1] is None if len(args) > 1 else True  # output_size given: no read
    if name == "aten::index":
        return any(i is not None and i.dtype == torch.bool for i in args[1])
    return False


class _Dispatched(TorchDispatchMode):
    def __init__(self, counts: Counter) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _reads_host(func, args):
            self.counts[func._schema.name] += 1
        return func(*args, **(kwargs or {}))


class host_reads(TorchFunctionMode):
    """``with host_reads() as reads: ...``; ``reads.counts`` is a Counter by op, ``reads.total`` their sum."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()
        self._dispatched = _Dispatched(self.counts)

    def __enter__(self):
        self._dispatched.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        return self._dispatched.__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.tolist:
            self.counts["tolist"] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.counts.values())
