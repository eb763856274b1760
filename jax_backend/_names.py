"""Parameter names: a pytree path as the dotted FQN the core's Layouts use (``layers.0.wq.weight``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax


def fqn(path: Sequence[Any]) -> str:
    """The dotted name of a pytree path: ``('layers', 0, 'wq', 'weight', .value)`` -> ``layers.0.wq.weight``.

    flax NNX Variables flatten to an extra ``.value`` attribute key, which is not part of the name.
    """
    parts = []
    for key in path:
        if isinstance(key, jax.tree_util.DictKey):
            parts.append(str(key.key))
        elif isinstance(key, jax.tree_util.SequenceKey):
            parts.append(str(key.idx))
        elif isinstance(key, jax.tree_util.GetAttrKey) and key.name != "value":
            parts.append(key.name)
    return ".".join(parts)


def flatten_params(tree: Any) -> dict[str, jax.Array]:
    """A params pytree (nested dicts, an NNX ``State``) as ``{fqn: array}`` in flattening order."""
    return {fqn(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}
