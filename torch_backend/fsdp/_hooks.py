"""Forward and backward hooks that drive the units, and the root's per-step bookkeeping.

Mechanism (FSDP2's): a forward pre-hook unshards the unit (one all-gather) and prefetches the next one;
a forward hook reshards it (when ``reshard_after_forward``) and hooks the outputs so that the first
gradient reaching them unshards the unit again before its backward and prefetches the previous unit.
Gradients land in the unit's unsharded gradient buffer (set up by a hook on the unit's first
gradient). A unit's backward is over when all its gradients landed or when its inputs' gradients are
computed (FSDP2's post-backward trigger); it then reshards, and its reduce-scatter is issued once every
unit before it in the reduce order has issued its own. The root (the outermost unit, found at the first
forward) queues a callback at the end of backward that reduces the units left, finishes every reduce,
gives out the gradients and reshards whatever is still unsharded.

Which collective comes next never depends on the data: the root's ``Schedule`` (fsdp/_schedule.py)
decides it, and the hooks only say when a unit needs its parameters. A unit skipped on some ranks
still takes part (its gather issued, its reduce-scatter of zeros), every rank reduce-scatters every
training unit that ran forward, and one all-reduce at the end of backward tells every rank which
parameters got a gradient on some rank (those get their ``.grad`` everywhere; one no rank used keeps
None, as in single-process training) and checks every rank issued the same collectives. A step is
every forward since the last backward ended, and that backward: several forwards may precede it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torch_backend._collectives import all_reduce
from torch_backend._debug import record_host_sync
from torch_backend._torch_internals import pytree, queue_backward_callback
from torch_backend.fsdp._api import MixedPrecisionPolicy
from torch_backend.fsdp._schedule import MISMATCH, Schedule
from torch_backend.fsdp._unit import Unit


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
        self.forward_prefetch = None
        self.backward_prefetch = None
        self.root = None
        self._modules_left = 0  # modules of the group whose forward has not finished this pass
        self._backward_started = False
        self._backward_done = False  # this backward is over for the unit (reduce issued or queued)
        self.needs_backward = False  # a forward of this step had outputs that require a gradient
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
        if self.unit is None:
            return args, kwargs
        schedule = self.root.schedule
        if self.root.in_backward:  # a recomputation (activation checkpointing) inside backward
            schedule.backward_gather(self, self.backward_prefetch)
        else:
            schedule.forward(self, self.forward_prefetch)
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
            self.needs_backward = True
        self._modules_left -= 1
        if self._modules_left == 0 and not self.root.in_backward:
            if self.unit is not None:
                self.root.schedule.forward_done(self)
            if self.is_root:  # the model's forward is over: every unit is as its forward leaves it
                self.root.schedule.reshard_done()
        if self.mp_policy.output_dtype is not None:
            output = _cast_floating(output, self.mp_policy.output_dtype)
        return output

    def stand_in(self) -> None:
        """What the end of this unit's forward does to it (also for a forward this rank skipped, which
        the schedule gathered for the ranks that ran it): reshard per ``reshard_after_forward``."""
        reshard = self.reshard_after_forward
        if reshard is None:
            reshard = not self.is_root  # the root's backward starts at once: keep it unsharded
        if self.unit is not None and reshard:
            self.unit.reshard(to_group=not isinstance(reshard, bool))  # an int: FSDP2's group size

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
            self.root.schedule.backward_gather(self, self.backward_prefetch)

    def post_backward(self) -> None:
        """This unit's backward is over on this rank: reshard, and reduce when its turn comes."""
        if self.unit is None or self._backward_done or self.root.defer_reduces:
            return  # deferred: the end of backward reduces every unit (gradients come from two graphs)
        self._backward_done = True
        if self.unit.reshard_after_backward:
            self.unit.reshard()
        self.root.reduce_ready()


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
    training renorms every row the whole batch uses. A pre-hook, before the module's forward and so
    before anything reads the weight (a tied head), MAX all-reduces the used-row mask (num_embeddings
    ints) over the unit's ranks and renorms the rows other ranks use and this one does not; the module
    then renorms its own. Every rank holds the single-process weight and keeps its slice of it when
    resharding (a write the version counter shows); no row is renormed twice (that would round
    differently). One small collective and one host read per call: the unit must run on every rank.
    """

    def __init__(self, module: nn.Embedding, unit: Unit) -> None:
        self.module = module
        self.unit = unit
        module.register_forward_pre_hook(_eager(self._sync))

    @torch.no_grad()
    def _sync(self, module: nn.Embedding, args: tuple) -> None:
        unit = self.unit
        used = torch.zeros(module.num_embeddings, dtype=torch.int32, device=unit.device)
        used[args[0].reshape(-1).to(unit.device)] = 1
        union = used.clone()
        for group in (unit.shard_group, unit.replicate_group):
            if group is not None:
                all_reduce(union, group, label=f"max_norm rows of {unit.name}", op=dist.ReduceOp.MAX).wait()
        record_host_sync(f"max_norm rows of {unit.name}")
        rows = ((union > 0) & (used == 0)).nonzero().squeeze(1)
        if rows.numel():
            weight = module.weight
            torch.embedding_renorm_(weight, rows.to(weight.device), module.max_norm, module.norm_type)


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


# Per default process group: {shard ranks: the reduce-scatters' group}, made once for every model.
_REDUCE_GROUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def reduce_scatter_groups(shard_groups: list[dist.ProcessGroup]) -> dict[tuple[int, ...], dist.ProcessGroup]:
    """A process group of their own for the reduce-scatters of each set of shard ranks.

    A rank issues each reduce-scatter when its unit's backward is over, which may come before or after
    another rank's next all-gather; on separate groups the two orders never meet. Every rank calls
    ``new_group`` for every set any rank needs, in one order (one ``all_gather_object`` tells them
    the sets; under expert parallelism each rank knows only its own), so the groups get the global
    counter's names, never a name an earlier group of the same ranks had (``use_local_synchronization``
    hashes the ranks: a second model's group would meet the first one's rendezvous keys).
    """
    made = _REDUCE_GROUPS.setdefault(dist.group.WORLD, {})
    mine = sorted({tuple(dist.get_process_group_ranks(g)) for g in shard_groups})
    if all(ranks in made for ranks in mine):  # every rank runs the same models: all agree on this
        return made
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    for ranks in sorted(set().union(*map(tuple, everyone)) - set(made)):
        made[ranks] = dist.new_group(list(ranks))
    return made


def advance_in_order(reducing: list[Unit]) -> list[Unit]:
    """Finish the issued reduces that have completed, in reduce order; returns those left.

    Past the first unit whose reduce-scatter is still running nothing advances: advancing issues HSDP's
    all-reduce over the replicas, and those must be issued in one order on every rank. A later unit's
    reduce-scatter may complete first on one rank and not on another; advancing it past an earlier one
    would pair the two units' all-reduces across the replicas (silently, where their sizes match).
    """
    left, blocked = [], False
    for unit in reducing:
        if blocked or not unit.try_finish_reduce():
            left.append(unit)
            blocked = blocked or unit.reduce_scatter_running
    return left


class RootContext:
    """Bookkeeping shared by every unit under the root: the schedule, the step, CUDA streams."""

    def __init__(self, state: FSDPState) -> None:
        self.state = state
        self.states = states_under(state.modules)
        _check_one_unit_per_parameter(state.modules, self.states)
        self.schedule = Schedule(self.states)
        self.step_open = False  # a forward ran since the last backward ended
        self.in_backward = False
        # A backward with create_graph=True ran this step (double backward): the step's backward then also
        # runs the graph it built, whose gradients may land after a unit's inputs are done, so every unit
        # stays unsharded and is reduced at the end of that backward, in the usual order.
        self.defer_reduces = False
        self._to_reduce: list[FSDPState] = []  # this backward's reduce order, not yet issued
        self._reducing: list[Unit] = []
        self._reduced: list[Unit] = []
        units = [s.unit for s in self.states if s.unit is not None]
        device = units[0].device if units else None
        cuda = device is not None and device.type == "cuda"
        streams = (torch.cuda.Stream(device), torch.cuda.Stream(device)) if cuda else (None, None)
        groups = reduce_scatter_groups([u.shard_group for u in units])
        for unit in units:
            if unit.reduce_group is unit.shard_group:
                unit.reduce_group = groups[tuple(dist.get_process_group_ranks(unit.shard_group))]
        for s in self.states:
            s.root = self
            if s.unit is not None:
                s.unit.ag_stream, s.unit.rs_stream = streams

    def begin_forward(self) -> None:
        """The root's forward starts: the first of a step begins the step; a later one joins it and
        starts the schedule's next pass (on every rank alike, whichever units the last one called)."""
        if self.in_backward:
            return
        if self.step_open:
            self.schedule.end_forward()
            return
        self.step_open = True
        for s in self.states:
            if s.unit is not None:
                s.unit.release_unused_gradients()  # zero_grad(set_to_none=True) ran since the last step

    def begin_graph_backward(self) -> None:
        """A backward that builds a graph (``autograd.grad(..., create_graph=True)``) starts.

        It only unshards (its graph keeps the unsharded parameters): no reduce, no reshard, no gradient
        given out; the units stay unsharded until the end of the step's backward.
        """
        if not self.in_backward:
            self.in_backward = True
            self.defer_reduces = True
            self.schedule.begin_backward()
            queue_backward_callback(self._end_graph_backward)

    def _end_graph_backward(self) -> None:
        self.in_backward = False
        self.schedule.end_backward()
        for s in self.states:  # the step's backward runs every unit's pre-backward again
            s._backward_started = False

    def begin_backward(self) -> None:
        if not self.in_backward:
            self.in_backward = True
            self.schedule.begin_backward()
            self._to_reduce = self.schedule.reduce_order()
            self._reduced = []
            queue_backward_callback(self.end_backward)

    def reduce_ready(self) -> None:
        """Issue the reduce-scatters of the units at the head of the order whose backward is over."""
        while self._to_reduce and self._to_reduce[0]._backward_done:
            self._reduce(self._to_reduce.pop(0))

    def _reduce(self, state: FSDPState) -> None:
        # Reduces issued before are finished here if they have completed (their unsharded gradients
        # freed before the next reduce needs memory; HSDP's all-reduce issued once the reduce-scatter
        # is done, hidden behind backward). None is waited for before the end of backward: a peer may
        # issue it only then (a unit that got no gradient there) and need this rank's all-gathers first.
        self._reducing = advance_in_order(self._reducing)
        if state.unit.will_reduce:
            self.schedule.reduced(state)
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
        self.schedule.end_backward()
        for s in self._to_reduce:  # their backward never ended here (no gradient reached them, ...)
            s._backward_done = True
            self._reduce(s)
        self._to_reduce = []
        self.finish_reduces()
        offloaded = next((u.device for u in self._reduced if u.offload and u.device.type != "cpu"), None)
        if offloaded is not None:  # the asynchronous copies of the gradients to pinned host memory
            torch.get_device_module(offloaded).current_stream(offloaded).synchronize()
            record_host_sync("offloaded gradients")
        try:
            self._give_gradients()
        except RuntimeError:
            self.reset()
            raise
        self.end_step()
        self.in_backward = self.defer_reduces = self.step_open = False
        for s in self.states:
            s._backward_started = s._backward_done = s.needs_backward = False
            s._inputs_pending = 0

    def _give_gradients(self) -> None:
        """One MAX all-reduce per mesh of the reduced units' landed masks and of the schedule's codes,
        then the ``.grad`` views (or, where the ranks' collectives differed, the same error on all)."""
        by_groups: dict[tuple, list[Unit]] = {}
        for unit in self._reduced:
            by_groups.setdefault((unit.shard_group, unit.replicate_group), []).append(unit)
        collectives, calls = self.schedule.codes()
        same_calls = True
        masks = []
        for (shard_group, replicate_group), units in by_groups.items():
            sizes = [len(u.refs) for u in units]
            seen = torch.zeros(sum(sizes) + 4, dtype=torch.int64, device=units[0].device)
            for u, part in zip(units, seen.split(sizes + [4])):  # each unit writes its view: no concatenation
                u.landed_mask(part)
            for i, code in enumerate((collectives, -collectives, calls, -calls), start=len(seen) - 4):
                seen[i].fill_(code)  # a fill: ``seen[i] = code`` would copy from a host scalar tensor
            for group in (shard_group, replicate_group):
                if group is not None:
                    all_reduce(seen, group, label="landed gradients", op=dist.ReduceOp.MAX).wait()
            record_host_sync("landed gradients")
            values = seen.tolist()  # the step's one read of the device per mesh
            high, low, calls_high, calls_low = values[-4:]
            if high != -low:
                raise RuntimeError("fully_shard: at the end of backward, the ranks' collectives of this step "
                                   f"differ; no gradient was given out. {MISMATCH}")
            same_calls = same_calls and calls_high == -calls_low
            masks.append((units, values[:-4], sizes))
        if masks and same_calls:
            self.schedule.learn()
        for units, used, sizes in masks:
            start = 0
            for u, n in zip(units, sizes):
                u.end_backward(used[start:start + n])
                start += n
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
        self.schedule.new_step()

    def reset(self) -> None:
        """``reset_iter_state``: after a forward or backward raised, forget the step and reshard.

        Waits for issued collectives (their errors are dropped: the step is discarded anyway), drops
        every gradient of the failed step, including unsynced accumulation and HSDP partial sums.
        """
        for s in self.states:
            if s.unit is not None:
                s.unit.discard_step()
            s._modules_left = s._inputs_pending = 0
            s._backward_started = s._backward_done = s.needs_backward = False
        self._to_reduce, self._reducing, self._reduced = [], [], []
        self.in_backward = self.defer_reduces = self.step_open = False
        self.schedule.new_step()
