"""The forward and backward hooks that drive one ``fully_shard`` call's unit (FSDP2's ``FSDPState``).

- forward pre-hook: the first forward of the root begins the step (fsdp/_root.py); the unit's
  parameters are gathered (the schedule issues the all-gathers, and prefetches the next unit), the
  inputs cast, and those that need a gradient watched for the end of the unit's backward.
- forward hook: the outputs are hooked so that the first gradient reaching them starts the unit's
  backward; the unit reshards when the next unit's forward starts (or the root's ends).
- pre-backward (the outputs' first gradient): the first one begins the step's backward; the unit's
  parameters are gathered again, and the previous unit prefetched.
- post-backward: all the unit's gradients landed and its inputs' gradients are computed (FSDP2's
  trigger); it reshards, and the schedule issues its reduce-scatter when its turn comes.

Which collective comes next never depends on the data: the root's ``Schedule`` (fsdp/_schedule.py)
decides it, and these hooks only say when a unit needs its parameters and when its backward is over.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from torch_backend._torch_internals import pytree
from torch_backend.fsdp._api import MixedPrecisionPolicy
from torch_backend.fsdp._root import RootContext
from torch_backend.fsdp._unit import Unit


def eager(fn: Callable) -> Callable:
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
        self.modules_left = 0  # modules of the group whose forward has not finished this pass
        self.clear_backward()
        if unit is not None:
            unit.post_backward_callback = self._maybe_post_backward
        # The hooks run eagerly under torch.compile, as FSDP2's do: dynamo would otherwise trace the
        # collectives, the storage resizes and the bookkeeping into every graph.
        self.pre_forward_hook = eager(self.pre_forward)
        self.post_forward_hook = eager(self.post_forward)
        self._pre_backward_hook = eager(self._pre_backward)
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
            RootContext(self, states_under(self.modules))
        if self.is_root and self.modules_left == 0:
            self.root.begin_forward()
        policy = self.mp_policy
        if policy.cast_forward_inputs and policy.param_dtype is not None:
            args, kwargs = _cast_floating((args, kwargs), policy.param_dtype)
        if torch.is_grad_enabled() and not self.root.in_backward:
            args, kwargs = self._watch_inputs(args, kwargs)
        if self.modules_left > 0:  # a later module of the same group: already unsharded
            return args, kwargs
        self.modules_left = len(self.modules)
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
        self.modules_left -= 1
        if self.modules_left == 0 and not self.root.in_backward:
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
        if self.backward_started:
            return
        self.backward_started = True
        if torch.is_grad_enabled():  # create_graph=True: a gradient penalty's inner autograd.grad
            self.root.begin_graph_backward()
        else:
            self.root.begin_backward()
        if self.unit is not None:
            self.root.schedule.backward_gather(self, self.backward_prefetch)

    def post_backward(self) -> None:
        """This unit's backward is over on this rank: reshard, and reduce when its turn comes."""
        if self.unit is None or self.backward_done or self.root.defer_reduces:
            return  # deferred: the end of backward reduces every unit (gradients come from two graphs)
        self.backward_done = True
        if self.unit.reshard_after_backward:
            self.unit.reshard()
        self.root.schedule.reduce_ready()

    def clear_backward(self) -> None:
        """Forget this step's backward (its end, or a step that raised)."""
        self.backward_started = False
        self.backward_done = False  # this backward is over for the unit (reduce issued or queued)
        self.needs_backward = False  # a forward of this step had outputs that require a gradient
        self._inputs_pending = 0  # forwards whose inputs have not received their gradients yet


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


