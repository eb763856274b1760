"""Forward and backward hooks that drive the units, and the root's per-step bookkeeping.

Mechanism (FSDP2's): a forward pre-hook unshards the unit (one all-gather) and prefetches the next one;
a forward hook reshards it (when ``reshard_after_forward``) and hooks the outputs so that the first
gradient reaching them unshards the unit again before its backward and prefetches the previous unit.
Gradients land in the unit's unsharded gradient buffer (set up by a hook on the unit's first
gradient). A unit's backward is over when all its gradients landed or when its inputs' gradients are
computed (FSDP2's post-backward trigger); it then reshards, and its reduce-scatter is issued once every
unit after it in forward order has issued its own. The root (the outermost unit, found at the first
forward) queues a callback at the end of backward that reduces the units left, finishes every reduce
and reshards whatever is still unsharded.

Collectives never depend on the data. Every rank reduce-scatters every training unit that ran forward,
in reverse forward order, whether or not its parameters were used on that rank (zeros where none
were); one all-reduce at the end of backward tells every rank which parameters got a gradient on some
rank (those get their ``.grad`` everywhere; one no rank used keeps None, as in single-process training).
Which units run forward and get a gradient must not depend on the data: before each unit's forward and
backward the ranks agree on it (``RootContext.agree``) and raise together, before the first mismatched
collective, when their data took them down different paths. The reduce-scatters ride on the backward
checks: each also takes the MIN over the unit's ranks of how many units of its mesh, at the head of the
reduce order, have finished their backward, and every rank issues exactly that many there (a unit done
on one rank first waits for the others); at the end of backward one check per mesh with units left
precedes their reduce-scatters.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torch_backend._collectives import all_reduce
from torch_backend._torch_internals import pytree, queue_backward_callback
from torch_backend.fsdp._api import MixedPrecisionPolicy
from torch_backend.fsdp._unit import Unit

# The ranks agree on each unit event before it communicates: one 3-int all-reduce per unit and event (2
# per unit and step, forward and backward, plus one per mesh at the end of backward; on CUDA each is a
# host sync). A model whose units run and get gradients alike on every rank whatever the data may turn
# the checks off.
CHECK_EVENTS = os.environ.get("RAGGED_FSDP_CHECK_EVENTS", "1") != "0"
FORWARD, BACKWARD, END = range(3)
_EVENTS = ("forward", "backward", "end of backward")


def _eager(fn: Callable) -> Callable:
    """``fn`` as a hook that runs eagerly when a ``torch.compile``'d model calls it, as FSDP2's hooks do.

    A dynamo-disabled function registered as the module hook itself: dynamo then runs it outside the
    graph without breaking it (a Python wrapper around it would be traced and break the graph at each
    call). Dynamo is imported here, at the first ``fully_shard``, not when the package is imported.
    """
    return torch.compiler.disable(fn, recursive=True)


class FSDPState:
    """The hooks of one ``fully_shard`` call: its modules, its unit (None without parameters), prefetch."""

    modules: tuple[nn.Module, ...]
    unit: Unit | None
    reshard_after_forward: bool | int | None  # None: FSDP2's default (all but the root); int: group size
    unshard_in_backward: bool  # False: backward never gathers the unit (its weights are not read there)
    mp_policy: MixedPrecisionPolicy  # casts of the forward's inputs and outputs
    forward_prefetch: list[FSDPState] | None  # explicit targets; None: the next unit of the last step
    backward_prefetch: list[FSDPState] | None  # explicit targets; None: the previous unit in forward order
    root: RootContext | None  # set at the first forward of the root
    pre_forward_hook: Callable  # pre_forward and post_forward as registered: eager under torch.compile
    post_forward_hook: Callable

    def __init__(self, modules: tuple[nn.Module, ...], unit: Unit | None,
                 reshard_after_forward: bool | int | None,
                 mp_policy: MixedPrecisionPolicy) -> None:
        self.modules = modules
        self.unit = unit
        self.reshard_after_forward = reshard_after_forward
        self.unshard_in_backward = True
        self.mp_policy = mp_policy
        self.renorms: list[EmbeddingRenorm] = []  # the unit's nn.Embedding(max_norm=...) modules
        self.forward_prefetch = None
        self.backward_prefetch = None
        self.root = None
        self._modules_left = 0  # modules of the group whose forward has not finished this pass
        self._backward_started = False
        self._backward_done = False  # this backward is over for the unit (reduce issued or queued)
        self._inputs_pending = 0  # forwards whose inputs have not received their gradients yet
        if unit is not None:
            unit.post_backward_callback = self._maybe_post_backward
        # The hooks run eagerly under torch.compile, as FSDP2's do: dynamo would otherwise trace the
        # collectives, the storage resizes and the bookkeeping into every graph.
        self.pre_forward_hook = _eager(self.pre_forward)
        self.post_forward_hook = _eager(self.post_forward)
        self._pre_backward_hook = _eager(self._pre_backward)
        for m in modules:
            m.register_forward_pre_hook(self.pre_forward_hook, prepend=True, with_kwargs=True)
            m.register_forward_hook(self.post_forward_hook)
            m._fsdp_state = self

    @property
    def is_root(self) -> bool:
        return self.root is not None and self.root.state is self

    # ----- forward ---------------------------------------------------------------------------------
    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self.root is None:
            RootContext(self)
        if self.is_root and self._modules_left == 0:
            self.root.begin_forward()
        policy = self.mp_policy
        if policy.cast_forward_inputs and policy.param_dtype is not None:
            args, kwargs = _cast_floating((args, kwargs), policy.param_dtype)
        if torch.is_grad_enabled() and not self.root.in_backward:
            args, kwargs = self._watch_inputs(args, kwargs)
        if self._modules_left > 0:  # a later module of the same group: already unsharded
            return args, kwargs
        self._modules_left = len(self.modules)
        if not self.root.in_backward:
            self.root.ran_forward(self, torch.is_grad_enabled())
        if self.unit is not None:
            self.unit.unshard(after=self.root.take_post_optim_event())
        targets = self.forward_prefetch
        if targets is None:
            targets = self.root.next_in(self.root.last_forward_order, self, +1)
        for t in targets:
            if t.unit is not None:
                t.unit.unshard(async_op=True)
        return args, kwargs

    def _watch_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Route the inputs that need a gradient through ``_InputsDone`` (FSDP2's post-backward hook).

        Its backward runs once autograd has computed every gradient of these inputs, i.e. once the
        backward of everything this forward computed from them is done: only then may the unit be
        resharded, since frozen parameters are still read by that backward (LoRA, frozen norms) after
        the last trainable gradient landed.
        """
        flat, spec = pytree.tree_flatten((args, kwargs))
        index = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not index or self.unit is None:
            return args, kwargs
        self._inputs_pending += 1
        outs = _InputsDone.apply(self, *(flat[i] for i in index))
        for i, t in zip(index, outs):
            flat[i] = t
        return pytree.tree_unflatten(flat, spec)

    def _inputs_done(self) -> None:
        self._inputs_pending -= 1
        if self._inputs_pending == 0:  # every forward's backward is over: no gradient is still to come
            self.post_backward()

    def _maybe_post_backward(self) -> None:
        unit = self.unit
        if unit is not None and unit.all_grads_landed and self._inputs_pending == 0:
            self.post_backward()

    def post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        leaves = pytree.tree_leaves(output)
        tensors = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(tensors, self._pre_backward_hook, mode="any")
        self._modules_left -= 1
        reshard = self.reshard_after_forward
        if reshard is None:
            reshard = not self.is_root  # the root's backward starts at once: keep it unsharded
        if self._modules_left == 0:
            for renorm in self.renorms:  # every rank: the unit's forward ran on every rank
                renorm.sync(self.unit)
        if self._modules_left == 0 and self.unit is not None and reshard:
            self.unit.reshard(to_group=not isinstance(reshard, bool))  # an int: FSDP2's group size
        if self.mp_policy.output_dtype is not None:
            output = _cast_floating(output, self.mp_policy.output_dtype)
        return output

    # ----- backward --------------------------------------------------------------------------------
    def _pre_backward(self, _: Any) -> None:
        if self._backward_started:
            return
        self._backward_started = True
        if torch.is_grad_enabled():  # create_graph=True: a gradient penalty's inner autograd.grad
            self.root.begin_graph_backward()
        else:
            self.root.begin_backward()
        if self.unit is not None:
            ready = self.root.agree(BACKWARD, self)
            if not self.root.defer_reduces:
                self.root.reduce_first(ready, self.unit)
            if self.unshard_in_backward:
                self.unit.unshard()
        targets = self.backward_prefetch
        if targets is None:
            targets = self.root.next_in(self.root.forward_order, self, -1)
        for t in targets:
            if t.unit is not None and not t._backward_started and t.unshard_in_backward:
                t.unit.unshard(async_op=True)

    def post_backward(self) -> None:
        """This unit's backward is over on this rank: reshard, and reduce when its turn comes."""
        if self.unit is None or self._backward_done or self.root.defer_reduces:
            return  # deferred: the end of backward reduces every unit (gradients come from two graphs)
        self._backward_done = True
        if self.unit.reshard_after_backward:
            self.unit.reshard()
        if not CHECK_EVENTS:
            self.root.reduce_ready()


def _mesh_of(unit: Unit) -> tuple:
    """The process groups a unit communicates over (its checks and reduce-scatter)."""
    return unit.shard_group, unit.replicate_group


def _cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    """Every floating-point tensor in ``tree`` cast to ``dtype`` (FSDP2's input and output casts)."""
    return pytree.tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, tree)


def state_of(module: nn.Module) -> FSDPState | None:
    """The FSDP state of a module ``fully_shard`` was called on (None for any other module)."""
    return getattr(module, "_fsdp_state", None)


def states_under(modules: Sequence[nn.Module], recurse: bool = True) -> list[FSDPState]:
    """The distinct FSDP states of ``modules`` (and of every module below them when ``recurse``)."""
    seen: dict[int, FSDPState] = {}
    for top in modules:
        for m in top.modules() if recurse else [top]:
            s = state_of(m)
            if s is not None:
                seen.setdefault(id(s), s)
    return list(seen.values())


class EmbeddingRenorm:
    """``nn.Embedding(max_norm=...)`` in a unit renorms, in place, the rows used in any rank's forward.

    The module renorms the rows its own rows of the batch use, in the unsharded weight; single-process
    training renorms every row the whole batch uses. A pre-hook records the rows used here; once the
    unit's forward is done, one MAX all-reduce of the used-row mask (num_embeddings ints) tells every
    rank which rows some rank used, and each renorms the ones it did not use itself, so every rank holds
    the single-process weight and keeps its slice of it when resharding (a write the version counter
    shows). Rows renormed here are not renormed twice (a second renorm would round differently).
    """

    def __init__(self, module: nn.Embedding, device: torch.device) -> None:
        self.module = module
        self.used = torch.zeros(module.num_embeddings, dtype=torch.int32, device=device)
        module.register_forward_pre_hook(_eager(self._record))

    def _record(self, module: nn.Embedding, args: tuple) -> None:
        self.used[args[0].reshape(-1).to(self.used.device)] = 1

    @torch.no_grad()
    def sync(self, unit: Unit) -> None:
        union = self.used.clone()
        for group in (unit.shard_group, unit.replicate_group):
            if group is not None:
                all_reduce(union, group, label=f"max_norm rows of {unit.name}", op=dist.ReduceOp.MAX).wait()
        rows = ((union > 0) & (self.used == 0)).nonzero().squeeze(1)
        m = self.module
        if rows.numel():
            torch.embedding_renorm_(m.weight, rows.to(m.weight.device), m.max_norm, m.norm_type)
        self.used.zero_()


class _InputsDone(torch.autograd.Function):
    """Identity on a forward's inputs; its backward tells the state the inputs' gradients are done."""

    @staticmethod
    def forward(ctx, state: FSDPState, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.state = state
        return inputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        ctx.state._inputs_done()
        return (None, *grads)


def _check_one_unit_per_parameter(tops: tuple[nn.Module, ...], states: list[FSDPState]) -> None:
    """FSDP2's rule: a tied parameter belongs to one unit, the lowest one containing all of its uses.

    Two units that took the same parameter (its uses sit in sibling units, or below and above a unit
    boundary) would each train their own copy and silently untie it.
    """
    fqns = {id(m): name for top in tops for name, m in top.named_modules(remove_duplicate=False)}
    owner: dict[int, str] = {}
    for s in states:
        if s.unit is None:
            continue
        for ref, orig in zip(s.unit.refs, s.unit.original_uids):
            fqn = f"{fqns.get(id(ref.module), '?')}.{ref.attr}".lstrip(".")
            if orig in owner:
                first = owner[orig]
                a, b = first.rsplit(".", 1)[0], fqn.rsplit(".", 1)[0]
                raise ValueError(
                    f"fully_shard: parameter {fqn!r} is the same tensor as {first!r}, which another unit "
                    f"already manages; tied parameters belong to one unit: shard the modules that use it "
                    f"together, e.g. fully_shard([model.{a}, model.{b}]), or leave them to a common parent")
            owner[orig] = fqn


class RootContext:
    """Bookkeeping shared by every unit under the root: forward order, reduce order, CUDA streams."""

    def __init__(self, state: FSDPState) -> None:
        self.state = state
        self.states = states_under(state.modules)
        _check_one_unit_per_parameter(state.modules, self.states)
        self.forward_order: list[FSDPState] = []
        self.last_forward_order: list[FSDPState] = []
        self.in_backward = False
        # A backward with create_graph=True ran this step (double backward): the step's backward then also
        # runs the graph it built, whose gradients may land after a unit's inputs are done, so every unit
        # stays unsharded and is reduced at the end of that backward, in the usual order.
        self.defer_reduces = False
        self.post_optim_event: torch.Event | None = None  # set_post_optim_event: the next gather waits on it
        self._trained: list[FSDPState] = []  # units that ran forward with grad enabled, first call first
        self._to_reduce: list[FSDPState] = []  # this backward's reduce order, not yet issued
        self._reducing: list[Unit] = []
        self._reduced: list[Unit] = []
        device = next((s.unit.device for s in self.states if s.unit is not None), None)
        cuda = device is not None and device.type == "cuda"
        streams = (torch.cuda.Stream(device), torch.cuda.Stream(device)) if cuda else (None, None)
        for s in self.states:
            s.root = self
            if s.unit is not None:
                s.unit.ag_stream, s.unit.rs_stream = streams

    @staticmethod
    def next_in(order: list[FSDPState], state: FSDPState, step: int) -> list[FSDPState]:
        """The unit ``step`` places after ``state`` in ``order`` (empty at either end or if absent)."""
        if state not in order:
            return []
        i = order.index(state) + step
        return [order[i]] if 0 <= i < len(order) else []

    def take_post_optim_event(self) -> torch.Event | None:
        """The event ``set_post_optim_event`` gave, once (the step's first all-gather waits on it)."""
        event, self.post_optim_event = self.post_optim_event, None
        return event

    def begin_forward(self) -> None:
        if self.in_backward:  # a forward (e.g. recomputation) inside backward keeps the order
            return
        self.end_step()
        for s in self.states:
            if s.unit is not None:
                s.unit.release_unused_gradients()  # zero_grad(set_to_none=True) ran since the last step
        if self.forward_order:
            self.last_forward_order = self.forward_order
        self.forward_order = []
        self._trained = []
        self.defer_reduces = False
        for s in self.states:
            s._inputs_pending = 0  # a forward whose backward never ran (e.g. evaluation with grads on)

    def ran_forward(self, state: FSDPState, grad_enabled: bool) -> None:
        """``state``'s forward starts (outside backward): check every rank runs it, record the order."""
        if state.unit is not None:
            self.agree(FORWARD, state)
        self.forward_order.append(state)
        if grad_enabled and state.unit is not None and state not in self._trained:
            self._trained.append(state)

    def agree(self, event: int, state: FSDPState) -> int:
        """Raise on every rank unless every rank is about to run the same ``event`` of ``state``'s unit
        (``END``: the end of backward, on that unit's mesh); for ``BACKWARD``, return how many units of that
        mesh, at the head of the reduce order, have finished their backward on every rank (else, and without
        checks, 0).

        Called before each unit's forward and backward and, per mesh, at the end of backward (the
        reduce-scatters are issued at these checks), so ranks whose data took them down different paths
        stop together, before the first collective that would pair one unit's buffer with another's (a
        silent mix, an abort or a hang).
        """
        if not CHECK_EVENTS:
            return 0
        unit = state.unit
        code = event * len(self.states) + (0 if event == END else self.states.index(state))
        queue = self._queue(unit) if event == BACKWARD else []  # only backward checks issue reduces
        ready = next((i for i, s in enumerate(queue) if not s._backward_done), len(queue))
        seen = torch.tensor([code, -code, -ready], dtype=torch.int64, device=unit.device)
        label = _EVENTS[event] if event == END else f"{_EVENTS[event]} of {unit.name}"
        for group in (unit.shard_group, unit.replicate_group):
            if group is not None:
                all_reduce(seen, group, label=f"{label} (check)", op=dist.ReduceOp.MAX).wait()
        high, low, ready = (v * sign for v, sign in zip(seen.tolist(), (1, -1, -1)))
        if high != low:
            other = low if low != code else high
            raise RuntimeError(
                f"fully_shard: the ranks disagree on what runs next: this rank runs {self._event(code)}, "
                f"another rank runs {self._event(other)}. Their data took them down different paths: a "
                "unit runs forward, or gets a gradient in backward, on some ranks and not on others. "
                "Inside a unit, modules and parameters may be used on some ranks only (their gradient is "
                "zero there), but every rank must run the same units and backpropagate into each of them: "
                "shard such modules together with their parent (fully_shard the MoE layer, not each "
                "expert), and add a loss term on every rank (times zero where it does not apply)")
        return ready

    def _event(self, code: int) -> str:
        event, index = divmod(code, len(self.states))
        if event == END:
            return "the end of backward"
        return f"the {_EVENTS[event]} of unit {self.states[index].unit.name!r}"

    def begin_graph_backward(self) -> None:
        """A backward that builds a graph (``autograd.grad(..., create_graph=True)``) starts.

        It only unshards (its graph keeps the unsharded parameters): no reduce, no reshard, no gradient
        given out; the units stay unsharded until the end of the step's backward.
        """
        if not self.in_backward:
            self.in_backward = True
            self.defer_reduces = True
            queue_backward_callback(self._end_graph_backward)

    def _end_graph_backward(self) -> None:
        self.in_backward = False
        for s in self.states:  # the step's backward runs every unit's pre-backward again
            s._backward_started = False

    def begin_backward(self) -> None:
        if not self.in_backward:
            self.in_backward = True
            # Reverse forward order, first calls last: a unit called twice finishes its backward with
            # its first call. Every rank issues the reduce-scatters in this order.
            self._to_reduce = [s for s in reversed(self._trained) if s.unit.trains]
            self._reduced = []
            queue_backward_callback(self.end_backward)

    def reduce_ready(self) -> None:
        """Issue the reduce-scatters of the units at the head of the order whose backward is over.

        The reduce issued before ran while this unit's backward computed; finishing it first frees its
        unsharded gradients before the next reduce needs memory, so one is in flight.
        """
        while self._to_reduce and self._to_reduce[0]._backward_done:
            self._reduce(self._to_reduce.pop(0))

    def _queue(self, unit: Unit) -> list[FSDPState]:
        """The units left to reduce on ``unit``'s mesh, in reduce order."""
        return [s for s in self._to_reduce if _mesh_of(s.unit) == _mesh_of(unit)]

    def reduce_first(self, count: int, unit: Unit) -> None:
        """Issue the reduce-scatters of the first ``count`` units left on ``unit``'s mesh (every rank of
        it: ``count`` came from a backward check over that mesh).

        Each mesh keeps the reduce order among its own units, so its ranks issue its collectives in one
        order; a unit of another mesh never waits here for the ranks of this one.
        """
        for s in self._queue(unit)[:count]:
            self._to_reduce.remove(s)
            self._reduce(s)

    def _reduce(self, state: FSDPState) -> None:
        self.finish_reduces()
        if state.unit.reduce_gradients():
            self._reducing.append(state.unit)
            self._reduced.append(state.unit)

    def finish_reduces(self) -> None:
        """Finish every issued reduce-scatter."""
        for unit in self._reducing:
            unit.finish_reduce()
        self._reducing = []

    def end_backward(self) -> None:
        """The end-of-backward callback: reduce the units left in order, finish, give out the gradients."""
        if CHECK_EVENTS:
            meshes = {_mesh_of(s.unit): s for s in reversed(self._to_reduce)}  # each mesh's first unit
            for first in sorted(meshes.values(), key=self.states.index):
                self.agree(END, first)
        for s in self._to_reduce:  # their backward never ended here (no gradient reached them, ...)
            s._backward_done = True
            self._reduce(s)
        self._to_reduce = []
        self.finish_reduces()
        self._give_gradients()
        self.end_step()
        self.in_backward = self.defer_reduces = False
        for s in self.states:
            s._backward_started = False
            s._backward_done = False
            s._inputs_pending = 0

    def _give_gradients(self) -> None:
        """One MAX all-reduce of the reduced units' landed masks (per mesh), then the ``.grad`` views."""
        by_groups: dict[tuple, list[Unit]] = {}
        for unit in self._reduced:
            by_groups.setdefault((unit.shard_group, unit.replicate_group), []).append(unit)
        for (shard_group, replicate_group), units in by_groups.items():
            used = torch.zeros(sum(len(u.refs) for u in units), dtype=torch.int32, device=units[0].device)
            parts = used.split([len(u.refs) for u in units])  # each unit writes its view: no concatenation
            for u, part in zip(units, parts):
                u.landed_mask(part)
            for group in (shard_group, replicate_group):
                if group is not None:
                    all_reduce(used, group, label="landed gradients", op=dist.ReduceOp.MAX).wait()
            for u, part in zip(units, parts):
                u.end_backward(part)
        for s in self.states:
            if s.unit is not None and s.unit not in self._reduced:
                s.unit.end_backward(None)
        self._reduced = []

    def end_step(self) -> None:
        """Reshard every unit (after backward, or after a forward that had no backward), except those
        told to stay unsharded after backward (``set_reshard_after_backward(False)``)."""
        self.finish_reduces()
        for s in self.states:
            if s.unit is not None and s.unit.reshard_after_backward:
                s.unit.reshard()

    def reset(self) -> None:
        """``reset_iter_state``: after a forward or backward raised, forget the step and reshard.

        Waits for issued collectives (their errors are dropped: the step is discarded anyway), drops
        every gradient of the failed step, including unsynced accumulation and HSDP partial sums.
        """
        for s in self.states:
            if s.unit is not None:
                s.unit.discard_step()
            s._modules_left = s._inputs_pending = 0
            s._backward_started = s._backward_done = False
        self._to_reduce, self._reducing, self._reduced, self._trained = [], [], [], []
        self.in_backward = self.defer_reduces = False
