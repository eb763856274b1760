"""Importing this module applies the torch bug named by ``$RAGGED_BUG`` (experiments/bug_injection.py).

experiments.bug_injection names it in ``$RAGGED_WORKER_PRELOAD``, the modules that the forkserver which
tests/torch_backend/_dist.py forks its gloo workers from imports: every worker computes with the bug.
"""

from experiments.bug_injection import apply_named_bug

apply_named_bug(stacks=("torch",))
