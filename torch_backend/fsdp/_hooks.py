"""Forward and backward hooks that drive the units, and the root's per-step bookkeeping.

Mechanism (FSDP2's): a forward pre-hook unshards the unit (one all-gather) and prefetches the next one;
a forward hook reshards it (when ``reshard_after_forward``) and hooks the outputs so that the first
gradient reaching them unshards the unit again before its backward and prefetches the previous unit.
Gradients land in the unit's unsharded gradient buffer (set up by a hook on the unit's first
gradient); when the last one lands (a post-accumulate-grad hook) the unit finishes the reduce-scatter
issued before it (which overlapped with this unit's backward), reshards and issues its own. The root
(the outermost unit, found at the first forward) queues a callback at the end of backward that
finishes every reduce and reshards whatever is still unsharded.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from torch_backend._torch_internals import pytree, queue_backward_callback
from torch_backend.fsdp._unit import Unit


class FSDPState:
    """The hooks of one ``fully_shard`` call: its modules, its unit (None without parameters), prefetch."""

    modules: tuple[nn.Module, ...]
    unit: Unit | None
    reshard_after_forward: bool
    forward_prefetch: list[FSDPState] | None  # explicit targets; None: the next unit of the last step
    backward_prefetch: list[FSDPState] | None  # explicit targets; None: the previous unit in forward order
    root: RootContext | None  # set at the first forward of the root

    def __init__(self, modules: tuple[nn.Module, ...], unit: Unit | None,
                 reshard_after_forward: bool) -> None:
        self.modules = modules
        self.unit = unit
        self.reshard_after_forward = reshard_after_forward
        self.forward_prefetch = None
        self.backward_prefetch = None
        self.root = None
        self._modules_left = 0  # modules of the group whose forward has not finished this pass
        self._backward_started = False
        self._inputs_pending = 0  # forwards whose inputs have not received their gradients yet
        if unit is not None:
            unit.post_backward_callback = self._maybe_post_backward
        for m in modules:
            m.register_forward_pre_hook(self.pre_forward, prepend=True, with_kwargs=True)
            m.register_forward_hook(self.post_forward)
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
        if torch.is_grad_enabled() and not self.root.in_backward:
            args, kwargs = self._watch_inputs(args, kwargs)
        if self._modules_left > 0:  # a later module of the same group: already unsharded
            return args, kwargs
        self._modules_left = len(self.modules)
        if self.unit is not None:
            self.unit.unshard()
        if not self.root.in_backward:
            self.root.forward_order.append(self)
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
        self._maybe_post_backward()

    def _maybe_post_backward(self) -> None:
        unit = self.unit
        if unit is not None and unit.all_grads_landed and self._inputs_pending == 0:
            self.post_backward()

    def post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        leaves = pytree.tree_leaves(output)
        tensors = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(tensors, self._pre_backward, mode="any")
        self._modules_left -= 1
        if self._modules_left == 0 and self.unit is not None and self.reshard_after_forward \
                and not self.is_root:  # the root's backward starts at once: keep it unsharded
            self.unit.reshard()
        return output

    # ----- backward --------------------------------------------------------------------------------
    def _pre_backward(self, _: Any) -> None:
        if self._backward_started:
            return
        self._backward_started = True
        self.root.begin_backward()
        if self.unit is not None:
            self.unit.unshard()
        targets = self.backward_prefetch
        if targets is None:
            targets = self.root.next_in(self.root.forward_order, self, -1)
        for t in targets:
            if t.unit is not None and not t._backward_started:
                t.unit.unshard(async_op=True)

    def post_backward(self) -> None:
        """All of this unit's gradients landed: finish the reduce issued before, reshard, reduce.

        The previous unit's reduce-scatter ran while this unit's backward computed; finishing it first
        frees its unsharded gradients before this unit's reduce needs memory, so one is in flight.
        """
        if self.unit is None:
            return
        self.root.finish_reduces()
        if self.unit.post_backward():
            self.root.reducing(self.unit)


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
        for ref, orig in zip(s.unit.refs, s.unit.orig_ids):
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
    """Bookkeeping shared by every unit under the root: forward order, pending reduces, CUDA streams."""

    def __init__(self, state: FSDPState) -> None:
        self.state = state
        self.states = states_under(state.modules)
        _check_one_unit_per_parameter(state.modules, self.states)
        self.forward_order: list[FSDPState] = []
        self.last_forward_order: list[FSDPState] = []
        self.in_backward = False
        self._reducing: list[Unit] = []
        device = next((s.unit.master.shard.device for s in self.states if s.unit is not None), None)
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
        for s in self.states:
            s._inputs_pending = 0  # a forward whose backward never ran (e.g. evaluation with grads on)

    def begin_backward(self) -> None:
        if not self.in_backward:
            self.in_backward = True
            queue_backward_callback(self.end_backward)

    def reducing(self, unit: Unit) -> None:
        """``unit`` issued its reduce-scatter; it is finished by the next unit's or the final callback."""
        self._reducing.append(unit)

    def finish_reduces(self) -> None:
        """Finish every issued reduce-scatter."""
        for unit in self._reducing:
            unit.finish_reduce()
        self._reducing = []

    def end_backward(self) -> None:
        """The end-of-backward callback: reduce units whose hooks did not all fire, finish, reshard."""
        for s in self.states:
            if s.unit is not None and s.unit.grads_ready:
                s.post_backward()  # some parameter got no gradient (unused in this forward)
        self.finish_reduces()
        self.end_step()
        self.in_backward = False
        for s in self.states:
            s._backward_started = False
            s._inputs_pending = 0

    def end_step(self) -> None:
        """Reshard every unit (after backward, or after a forward that had no backward)."""
        self.finish_reduces()
        for s in self.states:
            if s.unit is not None:
                s.unit.reshard()
