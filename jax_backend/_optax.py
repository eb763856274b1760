"""Which optax transformations the FSDP step honors on flat unit shards, checked before the first step.

The step applies the optimizer to each unit's flat local shard ``(S,)``. That equals optax on the full
parameter pytree only when the transformation runs the *same element-wise program on every parameter*:
then each element's update depends on that element alone, wherever the layout put it. Anything else would
be silently wrong on shards: a reduction (``clip_by_global_norm`` sees the local shard's norm, LAMB's trust
ratio mixes parameters), a reshape or a dot of a parameter, or a mask or label that treats parameters
differently (``weight_decay`` only on ``ndim > 1``: every shard is 1-D, so nothing would decay).

``check_optimizer`` traces ``update`` once on the full-shape abstract params pytree (``jax.ShapeDtypeStruct``
leaves with the Layouts' FQNs), follows which parameter each value of the jaxpr derives from, and raises
``UnsupportedOptimizerError`` naming the primitive and the parameter when a value of one parameter goes
through a primitive that is not element-wise, when two parameters' values meet, or when two parameters get
different programs (primitives, constants). Optimizers that know the layout (``jax_backend.optim``'s
``adamw8bit(blocks=...)`` and ``muon(plan=...)``) are passed through ``on_shards`` to skip the check.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.extend import core as jex_core

import ragged
from ragged import Layout

# Primitives that act element by element (scalar operands broadcast): their result at an element depends
# only on their operands at that element, so they commute with any flat sharding of a parameter.
_ELEMENTWISE = frozenset("""
    abs acos acosh add and asin asinh atan atan2 atanh cbrt ceil clamp conj convert_element_type copy copy_p
    cos cosh digamma div eq erf erf_inv erfc exp exp2 expm1 floor ge gt imag integer_pow is_finite le lgamma
    log log1p logistic lt max min mul ne neg nextafter not or pow real reduce_precision rem round rsqrt
    select_n sign sin sinh sqrt square sub tan tanh xor
""".split())
# Primitives that wrap a sub-jaxpr run inline (jit, custom derivatives): their body is checked instead.
_CALLS = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
          "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr",
          "custom_vjp_call_jaxpr": "fun_jaxpr",
          "remat": "jaxpr", "checkpoint": "jaxpr"}


class UnsupportedOptimizerError(ragged.RaggedError):
    """An optax transformation whose result on flat unit shards would differ from optax on the full params."""


class OnShards(optax.GradientTransformation):
    """A transformation written for the FSDP step's ``{unit: (S,)}`` shards; ``check_optimizer`` skips it."""


def on_shards(tx: optax.GradientTransformation) -> OnShards:
    """Mark ``tx`` as layout-aware: it takes the step's ``{unit: shard}`` dict and knows the Layouts itself.

    For ``jax_backend.optim.adamw8bit(..., blocks=shard_blocks(...))`` and ``muon(..., plan=muon_plan(...))``,
    whose block ids and Newton-Schulz roots come from the core's tables, not from the params pytree.
    """
    return OnShards(tx.init, tx.update)


def global_norm(shards: Any, axis: str) -> jax.Array:
    """``optax.global_norm`` of the full params from the step's ``{unit: shard}`` dict (inside ``shard_map``).

    Padding is zero, so the local shards' squares summed over the shard axis are the full params'; not
    over the replica axis, since HSDP replicas hold equal shards.
    """
    return jnp.sqrt(lax.psum(sum(jnp.sum(jnp.square(u)) for u in jax.tree.leaves(shards)), axis))


def clip_by_global_norm(max_norm: float, axis: str) -> OnShards:
    """``optax.clip_by_global_norm`` for the step's ``{unit: shard}`` dict (inside ``shard_map``).

    The norm is ``global_norm`` of the shards. Chain it with element-wise transformations and pass the
    chain through ``on_shards``: ``on_shards(optax.chain(clip_by_global_norm(1.0, fsdp.axis), adamw))``.
    """

    def update(updates: Any, state: optax.EmptyState, params: Any = None) -> tuple:
        del params
        norm = global_norm(updates, axis)
        trigger = norm < max_norm
        return jax.tree.map(lambda t: lax.select(trigger, t, (t / norm.astype(t.dtype)) * max_norm),
                            updates), state

    return OnShards(lambda params: optax.EmptyState(), update)


def abstract_params(layouts: Sequence[Layout], dtype: Any = "float32") -> dict[str, jax.ShapeDtypeStruct]:
    """``{fqn: ShapeDtypeStruct}`` of every tensor of ``layouts``: the pytree unsharded optax would see."""
    return {t.name: jax.ShapeDtypeStruct(t.shape, dtype) for lay in layouts for t in lay.tensors}


def check_optimizer(tx: optax.GradientTransformation, layouts: Sequence[Layout], params: Any = None) -> None:
    """Raise ``UnsupportedOptimizerError`` unless ``tx`` on flat unit shards equals ``tx`` on ``params``.

    Args:
        tx: the user's transformation (an ``OnShards`` one is not checked).
        layouts: the units' Layouts (their FQNs and shapes).
        params: the abstract full params pytree (default: ``abstract_params(layouts)``, ``{fqn: struct}``).

    Raises:
        UnsupportedOptimizerError: naming the parameter, the primitive and why, before anything runs.
    """
    if isinstance(tx, OnShards):
        return
    params = abstract_params(layouts) if params is None else params
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    names = [jax.tree_util.keystr(path) for path, _ in leaves]
    try:
        state = jax.eval_shape(tx.init, params)
        closed = jax.make_jaxpr(tx.update)(params, state, params)
    except Exception as err:  # noqa: BLE001 - any failure on the full params is reported the same way
        raise UnsupportedOptimizerError(
            f"the optimizer fails on the full params pytree ({type(err).__name__}: {err}); if it is written "
            "for the step's {unit: shard} dict (jax_backend.optim's adamw8bit(blocks=...), "
            "muon(plan=...)), pass it as jax_backend.on_shards(tx)"
        ) from err
    # Which parameter each input derives from: updates and params by position, state leaves by path
    # (optax state mirrors the params tree, so a moment's path ends with its parameter's path).
    n = len(leaves)
    state_ids = [_owner(path, leaf, leaves) for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]]
    owners = list(range(n)) + state_ids + list(range(n))
    programs: dict[int, list] = {i: [] for i in range(n)}
    _walk(closed.jaxpr, [frozenset() if o is None else frozenset({o}) for o in owners], programs, names)
    first = programs[0] if n else []
    for i in range(1, n):
        if programs[i] != first:
            raise UnsupportedOptimizerError(
                f"the optimizer runs a different program on parameter {names[i]} ({_summary(programs[i])}) "
                f"than on {names[0]} ({_summary(first)}): a mask, label or shape-dependent rule (e.g. weight "
                "decay only on ndim > 1, optax.masked, optax.multi_transform) cannot be honored on flat unit "
                "shards, where every leaf is a whole unit's 1-D shard; apply one rule to every parameter"
            )


def _owner(path: Any, leaf: Any, leaves: list) -> int | None:
    """The parameter a state leaf belongs to: the one whose path ends its path, with the same shape."""
    if not getattr(leaf, "ndim", 0):
        return None
    best = None
    for i, (p, x) in enumerate(leaves):
        if len(p) <= len(path) and tuple(path[len(path) - len(p):]) == tuple(p) and x.shape == leaf.shape:
            if best is None or len(p) > len(leaves[best][0]):
                best = i
    return best


def _walk(jaxpr: Any, owners: list, programs: dict, names: list) -> list:
    """Propagate parameter ownership through ``jaxpr``; record each parameter's element-wise program."""
    env: dict = {v: o for v, o in zip(jaxpr.invars, owners)}
    # What a value not derived from any parameter is (its primitives and constants, hashed): a constant
    # that differs between parameters (``u * jnp.full(u.shape, u.ndim)``) makes their programs differ.
    consts: dict = {v: ("input", k) for k, v in enumerate(jaxpr.invars)}

    def read(v: Any) -> frozenset:
        return frozenset() if isinstance(v, jex_core.Literal) else env.get(v, frozenset())

    def const(v: Any) -> Any:
        return repr(v.val) if isinstance(v, jex_core.Literal) else consts.get(v)

    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        owned = frozenset().union(*ins)
        name = eqn.primitive.name
        if name in _CALLS and _CALLS[name] in eqn.params:
            sub = eqn.params[_CALLS[name]]
            outs = _walk(getattr(sub, "jaxpr", sub), ins, programs, names)
        elif not owned:
            outs = [frozenset()] * len(eqn.outvars)
            params = () if name == "broadcast_in_dim" else repr(sorted(eqn.params.items()))
            made = hash((name, params, tuple(const(v) for v in eqn.invars)))
            consts.update((v, (made, k)) for k, v in enumerate(eqn.outvars))
        elif len(owned) > 1:
            got = ", ".join(names[i] for i in sorted(owned))
            raise UnsupportedOptimizerError(
                f"the optimizer combines values of different parameters ({got}) in `{name}`: a global "
                "reduction (e.g. clip_by_global_norm, optax.global_norm) needs every shard and every "
                "parameter, which flat unit shards do not see; clip or log the norm outside the optimizer"
            )
        elif name not in _ELEMENTWISE:
            (i,) = owned
            raise UnsupportedOptimizerError(
                f"the optimizer applies `{name}` to parameter {names[i]} (shape {_shape(eqn)}): only "
                "element-wise transformations (adam, adamw, sgd, lion, rmsprop, ...) give the same result on "
                "flat unit shards; reductions (clip_by_global_norm, LAMB's or scale_by_trust_ratio's norms, "
                "adafactor's factored statistics), reshapes, transposes and dots see only the local shard"
            )
        else:
            (i,) = owned
            operands = tuple(None if o else const(v) for o, v in zip(ins, eqn.invars))
            programs[i].append((name, operands, repr(sorted(eqn.params.items()))))
            outs = [owned] * len(eqn.outvars)
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def _shape(eqn: Any) -> tuple:
    return tuple(next(v.aval.shape for v in eqn.invars if hasattr(v.aval, "shape")))


def _summary(program: list) -> str:
    ops = ", ".join(p[0] for p in program[:8])
    return f"{len(program)} element-wise ops: {ops}{' ...' * (len(program) > 8)}"
