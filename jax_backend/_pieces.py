"""A jaxpr traced on full-shape parameters, run on each device's pieces of them (inside ``shard_map``).

Device ``d`` holds, of each tensor, one contiguous piece of its flattened storage (``Layout.local_pieces``).
The pieces differ in length between devices, but SPMD code has one static shape, so each tensor gets a
*window*: ``size`` elements (its longest piece on any device) of the device's shard, placed so that it
covers the device's piece and stays inside the shard; a mask marks the piece inside the window. Every
number comes from the core ``Layout``; the per-device ones are small tables indexed by ``axis_index``.

``Evaluator.run`` walks the jaxpr with three kinds of values:

- ``Windowed(i, (size,))``: the device's window of a full-shape value derived from parameter ``i`` (its
  gradient, its state, itself); values outside the mask are never read by a reduction or written back;
- ``Fill(scalar, shape)``: a full-shape constant (``zeros_like``, a broadcast mask), kept as its scalar so
  that no device materialises a whole parameter;
- anything else: an ordinary value, the same on every device of the shard axis.

Element-wise primitives run on the windows. A primitive that keeps the flat order (reshape, squeeze, a
broadcast that only adds unit dims) keeps the piece. A full reduction of a parameter's value
(``reduce_sum`` / ``max`` / ``min`` / ``and`` / ``or`` over every axis, a ``dot_general`` contracting
every axis) is the masked local reduction, then ``psum`` / ``pmax`` / ``pmin`` over the shard axis: an
ordinary value again, so norms, trust ratios and global norms combine freely. A ``cond`` on parameter
values (``MultiSteps``, ``apply_if_finite``) runs every branch and selects. HSDP replicas hold equal
values (the step all-reduced the gradients over them), so nothing reduces over the replica axis. Anything
else applied to a piece (a transpose, a reduction over some axes, mixing two parameters element by
element) raises ``UnsupportedOptimizerError`` naming the primitive and the parameter.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jex_core

import ragged
from ragged import Layout


class UnsupportedOptimizerError(ragged.RaggedError):
    """An optax transformation whose result on the units' shards would differ from optax on full params."""


# Primitives that act element by element (scalar operands broadcast): their result at an element depends
# only on their operands at that element, so they commute with any flat sharding of a parameter.
ELEMENTWISE = frozenset("""
    abs acos acosh add and asin asinh atan atan2 atanh cbrt ceil clamp conj convert_element_type copy copy_p
    cos cosh digamma div eq erf erf_inv erfc exp exp2 expm1 floor ge gt imag integer_pow is_finite le lgamma
    log log1p logistic lt max min mul ne neg nextafter not or pow real reduce_precision rem round rsqrt
    select_n sign sin sinh sqrt square sub tan tanh xor
""".split())
# Primitives that wrap a sub-jaxpr run inline (jit, custom derivatives): their body is evaluated instead.
CALLS = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
         "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr",
         "custom_vjp_call_jaxpr": "fun_jaxpr", "remat": "jaxpr", "checkpoint": "jaxpr"}
_RESHAPES = frozenset({"reshape", "squeeze", "broadcast_in_dim", "expand_dims"})
# Sharding annotations (a trace inside ``shard_map`` adds them): the values they carry are unchanged.
_ANNOTATIONS = frozenset({"reshard", "sharding_constraint", "mesh_cast"})
# reduction -> (collective over the shard axis, identity of the masked-out elements)
_REDUCTIONS = {"reduce_sum": (lax.psum, lambda dt: 0), "reduce_max": (lax.pmax, lambda dt: _lowest(dt)),
               "reduce_min": (lax.pmin, lambda dt: -_lowest(dt)), "reduce_and": (lax.pmin, lambda dt: True),
               "reduce_or": (lax.pmax, lambda dt: False)}


def _lowest(dtype: Any) -> Any:
    return -jnp.inf if jnp.issubdtype(dtype, jnp.floating) else jnp.iinfo(dtype).min


class Window(NamedTuple):
    """Where one tensor's piece lies in each device's shard. Tables are ``(world_size,)`` int32."""

    unit: str
    size: int  # elements of the window: the tensor's longest piece on any device
    numel: int
    start: np.ndarray  # where the window starts in the device's shard (so it ends inside the shard)
    lo: np.ndarray  # where the device's piece starts in the window
    length: np.ndarray  # the piece's length (0: the device holds nothing of the tensor)
    first: np.ndarray  # the tensor's flat index at the window's first element (may lie before 0)


def windows(layouts: Sequence[Layout]) -> dict[str, Window]:
    """``{fqn: Window}`` of every tensor of ``layouts``, from ``Layout.local_pieces``."""
    out = {}
    for lay in layouts:
        pieces: dict[str, dict[int, ragged.Piece]] = {t.name: {} for t in lay.tensors}
        for d in range(lay.world_size):
            for p in lay.local_pieces(d):
                pieces[p.name][d] = p
        for t in lay.tensors:
            size = max((p.stop - p.start for p in pieces[t.name].values()), default=0)
            table = np.zeros((4, lay.world_size), np.int32)
            for d, p in pieces[t.name].items():
                start = min(p.local_offset, lay.shard_size - size)
                lo = p.local_offset - start
                table[:, d] = start, lo, p.stop - p.start, p.start - lo
            out[t.name] = Window(lay.name, size, int(np.prod(t.shape, dtype=np.int64)), *table)
    return out


class Windowed(NamedTuple):
    """A full-shape value derived from parameter ``param``, held as the device's window ``(size,)`` of it
    (the core's ``Piece`` is the part of a tensor a device holds; the window covers it)."""

    param: int
    value: jax.Array


class Fill(NamedTuple):
    """A full-shape value whose every element is ``value`` (a 0-d array)."""

    value: jax.Array
    shape: tuple[int, ...]


def _bind(eqn: Any, args: Sequence[Any]) -> list:
    out = eqn.primitive.bind(*args, **eqn.params)
    return list(out) if eqn.primitive.multiple_results else [out]


class Evaluator:
    """Runs a jaxpr traced on full params on this device's windows of them.

    Args:
        windows: the ``Window`` of each parameter, indexed like the params pytree's leaves.
        names: each parameter's FQN (for errors).
        axis: the shard axis (inside ``shard_map``); ``None`` evaluates as device 0 without collectives,
            which is enough for shapes and for the checks.
    """

    def __init__(self, windows: Sequence[Window], names: Sequence[str], axis: str | None):
        self.windows, self.names, self.axis = list(windows), list(names), axis
        # every window's (start, lo, length, first) on this device: one row of one small table
        table = np.stack([np.stack([w.start, w.lo, w.length, w.first], -1) for w in self.windows], axis=1)
        device = lax.axis_index(axis) if axis is not None else 0
        self.row = lax.dynamic_index_in_dim(jnp.asarray(table), device, keepdims=False)  # (params, 4)
        self._valid: dict[int, jax.Array] = {}

    # ----- windows of unit shards ------------------------------------------------------------------
    def valid(self, i: int) -> jax.Array:
        """``(size,)`` bool: which elements of parameter ``i``'s window are the device's piece."""
        if i not in self._valid:
            k = lax.iota(jnp.int32, self.windows[i].size)
            lo, length = self.row[i, 1], self.row[i, 2]
            self._valid[i] = (k >= lo) & (k < lo + length)
        return self._valid[i]

    def read(self, shard: jax.Array, i: int) -> Windowed:
        """Parameter ``i``'s window of its unit's local shard ``(S,)``."""
        return Windowed(i, lax.dynamic_slice(shard, (self.row[i, 0],), (self.windows[i].size,)))

    def write(self, shard: jax.Array, i: int, value: Any) -> jax.Array:
        """``shard`` with parameter ``i``'s piece replaced by that of ``value`` (full-shape, any kind)."""
        start = self.row[i, 0]
        old = lax.dynamic_slice(shard, (start,), (self.windows[i].size,))
        new = jnp.where(self.valid(i), self.window(i, value), old).astype(shard.dtype)
        return lax.dynamic_update_slice(shard, new, (start,))

    def window(self, i: int, x: Any, what: str = "") -> Any:
        """``x`` (a value of parameter ``i``'s full shape, or a scalar) as parameter ``i``'s window."""
        w = self.windows[i]
        if isinstance(x, Windowed):
            if x.param != i:
                raise UnsupportedOptimizerError(
                    f"the optimizer combines values of parameters {self.names[x.param]} and {self.names[i]} "
                    f"element by element{what}: on shards they lie on different devices; only reductions of "
                    "a parameter (norms, sums) may meet another parameter's")
            return x.value
        if isinstance(x, Fill):
            return jnp.broadcast_to(x.value, (w.size,))
        if not jnp.ndim(x):  # broadcast: ``select_n`` takes no scalar case (a 0-d parameter's operands are)
            return jnp.broadcast_to(x, (w.size,))
        if jnp.size(x) != w.numel:
            raise UnsupportedOptimizerError(
                f"the optimizer meets parameter {self.names[i]} (numel {w.numel}) with a value of shape "
                f"{jnp.shape(x)}{what}: only scalars and values of the parameter's shape apply element-wise")
        # a full-shape array that does not derive from the parameter (rare: constants are Fills)
        flat = jnp.pad(jnp.ravel(x), (w.size, w.size))
        return lax.dynamic_slice(flat, (self.row[i, 3] + w.size,), (w.size,))

    # ----- the jaxpr ---------------------------------------------------------------------------------
    def run(self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list:
        env: dict = dict(zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, args))

        def read(v: Any) -> Any:
            return v.val if isinstance(v, jex_core.Literal) else env[v]

        for eqn in jaxpr.eqns:
            env.update(zip(eqn.outvars, self._eqn(eqn, [read(v) for v in eqn.invars])))
        return [read(v) for v in jaxpr.outvars]

    def _eqn(self, eqn: Any, ins: list) -> list:
        name = eqn.primitive.name
        owners = sorted({x.param for x in ins if isinstance(x, Windowed)})
        lazy = owners or any(isinstance(x, Fill) for x in ins)
        if name in CALLS and CALLS[name] in eqn.params and lazy:
            sub = eqn.params[CALLS[name]]
            return self.run(getattr(sub, "jaxpr", sub), getattr(sub, "consts", ()), ins)
        if name in _ANNOTATIONS and lazy:
            return list(ins)
        if name == "cond" and lazy and not isinstance(ins[0], Windowed):
            return self._cond(eqn, ins)
        out_shape = tuple(eqn.outvars[0].aval.shape)
        if not owners:
            if name in _RESHAPES and len(ins) == 1 and (isinstance(ins[0], Fill) or jnp.size(ins[0]) == 1):
                value = ins[0].value if isinstance(ins[0], Fill) else jnp.reshape(ins[0], ())
                return [Fill(value, out_shape)]
            if name in ELEMENTWISE and all(isinstance(x, Fill) or not jnp.ndim(x) for x in ins) and lazy:
                return [Fill(*_bind(eqn, [x.value if isinstance(x, Fill) else x for x in ins]), out_shape)]
            return _bind(eqn, [jnp.broadcast_to(x.value, x.shape) if isinstance(x, Fill) else x for x in ins])
        what = f" in `{name}`"
        if len(owners) > 1 and name not in ELEMENTWISE and name != "dot_general":
            got = " and ".join(self.names[i] for i in owners)
            raise UnsupportedOptimizerError(
                f"the optimizer combines values of parameters {got}{what}: on shards they lie on different "
                "devices; only full reductions of one parameter (norms, sums) may meet another parameter's")
        i = owners[0]
        in_avals = [v.aval for v in eqn.invars]
        if name in ELEMENTWISE:
            return [Windowed(i, out) for out in _bind(eqn, [self.window(i, x, what) for x in ins])]
        if name in _RESHAPES and self._keeps_flat_order(eqn, in_avals[0]):
            return [ins[0]]
        if name in _REDUCTIONS and tuple(eqn.params.get("axes", ())) == tuple(range(len(in_avals[0].shape))):
            collective, identity = _REDUCTIONS[name]
            x = self.window(i, ins[0], what)
            masked = jnp.where(self.valid(i), x, identity(x.dtype)).astype(x.dtype)
            local = eqn.primitive.bind(masked, **{**eqn.params, "axes": (0,)})
            return [self._over_shards(collective, local)]
        if name == "dot_general" and self._full_contraction(eqn, in_avals):
            a, b = (self.window(i, x, what) for x in ins)
            dtype = eqn.outvars[0].aval.dtype
            local = jnp.sum(jnp.where(self.valid(i), a.astype(dtype) * b.astype(dtype), 0), dtype=dtype)
            return [self._over_shards(lax.psum, local)]
        raise UnsupportedOptimizerError(
            f"the optimizer applies `{name}` to parameter {self.names[i]} (shape {tuple(in_avals[0].shape)}) "
            f"with params {_short(eqn.params)}: on shards each device holds a flat piece of the parameter, "
            "so only element-wise primitives, reshapes and full reductions (sum, max, min, norms) are "
            "honored; a transpose, a reduction over some axes (adafactor's factored statistics) or a "
            "gather would see another device's elements. Use a transformation without it, or write one "
            "for the step's {unit: shard} dict and pass it as jax_backend.on_shards(tx)")

    def _cond(self, eqn: Any, ins: list) -> list:
        """``lax.cond`` / ``switch`` on parameter values: every branch runs (on every device alike, so their
        collectives match), then ``select_n`` by the index picks each output."""
        index, operands = (ins[0].value if isinstance(ins[0], Fill) else ins[0]), ins[1:]
        branches = [self.run(b.jaxpr, b.consts, operands) for b in eqn.params["branches"]]
        outs = []
        for results, var in zip(zip(*branches), eqn.outvars):
            owner = next((x.param for x in results if isinstance(x, Windowed)), None)
            if owner is not None:
                windows = [self.window(owner, x, " in `cond`") for x in results]
                outs.append(Windowed(owner, lax.select_n(index, *(jnp.broadcast_to(w, windows[0].shape)
                                                               for w in windows))))
            elif all(isinstance(x, Fill) for x in results):
                outs.append(Fill(lax.select_n(index, *(x.value for x in results)), tuple(var.aval.shape)))
            else:
                outs.append(lax.select_n(index, *(jnp.broadcast_to(x.value, x.shape) if isinstance(x, Fill)
                                                  else x for x in results)))
        return outs

    def _over_shards(self, collective: Any, local: jax.Array) -> jax.Array:
        if self.axis is None:
            return local
        if local.dtype == jnp.bool_:
            return collective(local.astype(jnp.int32), self.axis).astype(jnp.bool_)
        return collective(local, self.axis)

    @staticmethod
    def _keeps_flat_order(eqn: Any, aval: Any) -> bool:
        out = eqn.outvars[0].aval
        return eqn.params.get("dimensions") is None if eqn.primitive.name == "reshape" else (
            int(np.prod(out.shape)) == int(np.prod(aval.shape)))

    @staticmethod
    def _full_contraction(eqn: Any, avals: list) -> bool:
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        dims = tuple(range(len(avals[0].shape)))
        return not lb and not rb and tuple(lc) == tuple(rc) == dims and avals[0].shape == avals[1].shape


def _short(params: dict) -> str:
    return "{" + ", ".join(f"{k}={v}" for k, v in params.items() if not hasattr(v, "eqns"))[:120] + "}"
