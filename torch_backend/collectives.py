"""The flat-buffer collectives ``fully_shard`` issues, for code built on DBuffer shards and for benchmarks.

Each call is one asynchronous collective on a whole flat buffer (the local shard is the all-gather input
and the reduce-scatter output as it is) and returns a ``Pending`` whose ``wait()`` finishes it or raises
a ``CollectiveError`` naming the collective, its label and the rank. On gloo ``reduce_scatter`` is one
all-to-all and a local sum (``torch_backend/_collectives.py`` says why).
"""

from torch_backend._collectives import CollectiveError, Pending, all_gather, all_reduce, reduce_scatter

__all__ = ["CollectiveError", "Pending", "all_gather", "all_reduce", "reduce_scatter"]
