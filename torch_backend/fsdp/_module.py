"""``FSDPModule``: the class ``fully_shard`` mixes into a sharded module, with FSDP2's methods.

It subclasses torch's own ``torch.distributed.fsdp.FSDPModule`` so that ``isinstance(m, FSDPModule)``
checks in user code and libraries (pipelining schedules, memory trackers, training loops) see our
modules, and it overrides every method torch's class has (2.11 to 2.13), so none of FSDP2's internals
ever runs on them: each either does what FSDP2's does, over our units, or raises ``NotImplementedError``
naming the method and why the ragged design cannot honor it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import UnshardHandle as TorchUnshardHandle

from torch_backend.fsdp._hooks import FSDPState, state_of, states_under
from torch_backend.fsdp._unit import Unit


def _not_here(method: str, why: str) -> NoReturn:
    raise NotImplementedError(f"FSDPModule.{method} (torch_backend): {why}")


class FSDPModule(TorchFSDPModule):
    """The mixin ``fully_shard`` adds to a module's class: FSDP2's methods on the sharded module.

    ``model.parameters()`` yields the sharded parameters (RaggedShard DTensors viewing the unit's local
    shard) outside forward and backward; the optimizer steps them in place.
    """

    _orig_cls_mro_index = 3  # [FSDP<Orig>, ours, torch's FSDPModule, Orig, ...] (torch reads it)

    def __new__(cls, *args: Any, **kwargs: Any) -> nn.Module:
        """Constructing the sharded class (``nn.Sequential`` slicing does) builds the original class."""
        mro = cls.__mro__
        orig = mro[mro.index(TorchFSDPModule) + 1]
        self = orig.__new__(orig, *args, **kwargs)
        self.__init__(*args, **kwargs)
        return self

    def __deepcopy__(self, memo: dict) -> NoReturn:
        raise AssertionError("FSDP does not support deepcopy (torch_backend, as FSDP2). Please use state "
                             "dict for serialization, or deepcopy the module before fully_shard.")

    # ----- unshard / reshard ------------------------------------------------------------------------
    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's unit and register its unsharded parameters (not recursive).

        Args:
            async_op: return a handle whose ``wait()`` finishes the all-gather instead of waiting.
        """
        unit = state_of(self).unit
        if unit is not None:
            unit.unshard(async_op=async_op)
        return UnshardHandle(unit) if async_op else None

    def reshard(self) -> None:
        """Free this unit's unsharded buffer and register the sharded parameters again (not recursive)."""
        unit = state_of(self).unit
        if unit is not None:
            unit.reshard()

    def reset_iter_state(self) -> None:
        """After a forward or backward raised: wait for issued collectives, drop the failed step's gradients
        (unsynced accumulation and HSDP partial sums included) and reshard every unit. Call it on the root.

        Raises:
            RuntimeError: called on a module that is not the root of an initialised model.
        """
        state = state_of(self)
        if not state.is_root:
            raise RuntimeError("reset_iter_state must be called on the root FSDP module (the module the "
                               "top-level fully_shard was applied to, after its first forward)")
        state.root.reset()

    # ----- reduction ----------------------------------------------------------------------------------
    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """With False, backward keeps accumulating unsharded gradients and does not reduce them (neither
        the reduce-scatter nor HSDP's all-reduce: FSDP2's ``no_sync``).

        The next backward with True reduces everything accumulated since the last reduce (gradient
        accumulation over micro-batches with one reduce-scatter per unit).
        """
        for unit in self._units(recurse):
            unit.requires_grad_sync = unit.requires_all_reduce = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: with False, backward reduce-scatters but skips the all-reduce over the replicas; the
        partial sums add up until a backward with True all-reduces them (then ``.grad`` is set)."""
        for unit in self._units(recurse):
            unit.requires_all_reduce = requires_all_reduce

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted for FSDP2 compatibility: marks whether the next backward is the last of a step.

        FSDP2 uses it to skip waiting for its reduce-scatters at the end of a non-last backward. Ours
        always finishes them at the end of backward, because the all-reduce of which parameters got a
        gradient (docs: data-dependent control flow) needs them; gradients are the same either way.
        """
        if not isinstance(is_last_backward, bool):
            raise TypeError(f"set_is_last_backward: expected a bool, got {is_last_backward!r}")

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide the reduced gradient sum by ``factor`` instead of the number of data-parallel ranks."""
        if not factor > 0:
            raise ValueError(f"set_gradient_divide_factor: factor must be positive, got {factor!r}")
        for unit in self._units(recurse=False):
            unit.gradient_divide_factor = float(factor)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """FSDP2's deprecated name of ``set_gradient_divide_factor``."""
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Accepted: our collectives always reduce with ``SUM`` and divide afterwards, which is what
        FSDP2 does with ``enable=True``; ``False`` only lets FSDP2 pick AVG/PreMulSum, same values."""
        if not isinstance(enable, bool):
            raise TypeError(f"set_force_sum_reduction_for_comms: expected a bool, got {enable!r}")

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *,
                            stream: torch.cuda.Stream | None = None) -> None:
        """Call ``hook(reduced_shard)`` after the reduce-scatter (HSDP: after the all-reduce), in place.

        The tensor is the unit's whole local gradient shard, already divided, in ``reduce_dtype``. With
        ``stream`` (CUDA) the hook runs there, after the reduce, and the current stream waits for it.

        Raises:
            ValueError: ``stream`` with HSDP (FSDP2's rule: the hook runs on the all-reduce's stream).
        """
        for unit in self._units(recurse=False):
            if stream is not None and unit.replicate_group is not None:
                raise ValueError("stream cannot be set when using native HSDP")
            unit.all_reduce_hook, unit.all_reduce_hook_stream = hook, stream

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *,
                                         recurse: bool = True) -> None:
        """Accepted: every training unit that ran forward is reduce-scattered on every rank with zeros for
        the parameters unused on that rank, always (the collectives never depend on the data), which is
        FSDP2's ``True``; ``False`` would let ranks issue different collectives, so it changes nothing."""
        if not isinstance(reduce_scatter_unused_params, bool):
            raise TypeError(f"set_reduce_scatter_unused_params: expected a bool, got "
                            f"{reduce_scatter_unused_params!r}")

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """Accepted and validated: FSDP2 bounds its copy-in staging buffers; ours reduce-scatters straight
        from the unit's gradient buffer (no staging copy), so there is nothing to bound."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}")
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be a positive int, got {max_input_buffers}")

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        """Accepted: the reduce-scatters always run on their own process group per set of shard ranks
        (the root makes them at its first forward), which the schedule needs (fsdp/_schedule.py: a rank
        issues each when its unit's backward is over, which another rank's all-gathers must not meet);
        ``False`` cannot put them back on the all-gathers' group."""
        if not isinstance(enable, bool):
            raise TypeError(f"set_separate_reduce_scatter_group: expected a bool, got {enable!r}")

    # ----- resharding -------------------------------------------------------------------------------
    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Free (True) or keep (False) the unsharded parameters after forward, the root included."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"reshard_after_forward should be a bool, got {type(reshard_after_forward)}")
        for state in states_under([self], recurse):
            state.reshard_after_forward = reshard_after_forward

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """With False, units stay unsharded after backward, so the next forward gathers nothing (gradient
        accumulation). As in FSDP2, call ``reshard()`` (or set True again) before an optimizer step,
        or the next forward reads the parameters gathered before it."""
        for unit in self._units(recurse):
            unit.reshard_after_backward = reshard_after_backward

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """With False, backward does not all-gather this unit (for units whose weights backward never
        reads, e.g. an embedding: its gradient lands in its own buffer, not the parameters')."""
        state_of(self).unshard_in_backward = unshard_in_backward

    # ----- prefetch -----------------------------------------------------------------------------------
    def set_modules_to_forward_prefetch(self, modules: Sequence[FSDPModule]) -> None:
        """All-gather ``modules``' units (asynchronously) when this module's forward starts."""
        state_of(self).forward_prefetch = [_checked_state(m, "set_modules_to_forward_prefetch")
                                           for m in modules]

    def set_modules_to_backward_prefetch(self, modules: Sequence[FSDPModule]) -> None:
        """All-gather ``modules``' units (asynchronously) when this module's backward starts."""
        state_of(self).backward_prefetch = [_checked_state(m, "set_modules_to_backward_prefetch")
                                            for m in modules]

    def set_post_optim_event(self, event: torch.Event) -> None:
        """CUDA: the next forward's first all-gather waits on ``event`` (recorded after the optimizer
        step) instead of on everything issued so far on the current stream. Used once, as in FSDP2; on
        CPU, where collectives do not run on streams, it has nothing to order."""
        state = state_of(self)
        if not state.is_root:
            raise RuntimeError("set_post_optim_event: call it on the root FSDP module after its first "
                               "forward (the root orders the step's first all-gather)")
        state.root.schedule.post_optim_event = event

    # ----- communication buffers: refused, with the reason ------------------------------------------
    def set_custom_all_gather(self, comm: Any) -> None:
        _not_here("set_custom_all_gather", "the all-gather writes straight into the unit's planned buffer "
                  "(its storage is resized in place so that the unsharded parameters' views stay valid); a "
                  "custom Comm allocates its own output, which the views cannot follow")

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        _not_here("set_custom_reduce_scatter", "the reduce-scatter reads the unit's gradient buffer (the "
                  "unsharded .grad views) and writes its sharded gradient shard in place; a custom Comm "
                  "allocates its own buffers, which those views cannot follow")

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        if enable:
            _not_here("set_allocate_memory_from_process_group_for_comm", "the collectives run on the unit's "
                      "own buffers, allocated once with views into them, not on staging buffers a process "
                      "group could allocate")

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        _not_here("set_symm_mem_for_comm", "the all-gather output is the unit's own buffer with permanent "
                  "parameter views into it, not a staging buffer that could live in symmetric memory")

    def _set_unshard_async_op(self, async_op: bool) -> None:
        _not_here("_set_unshard_async_op", "our pre-forward all-gathers already run on the all-gather "
                  "stream with their buffers allocated there; FSDP2's private switch has no counterpart")

    def _get_fsdp_state(self) -> NoReturn:
        _not_here("_get_fsdp_state", "this module was sharded by torch_backend.fully_shard and has no FSDP2 "
                  "state; use its public methods (torch_backend.fsdp.units(module) lists its units)")

    # ----- moves --------------------------------------------------------------------------------------
    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        """``to_empty``, ``to``, ``float()``...: keep every sharded parameter a view into its unit's shard.

        ``nn.Module._apply`` gives each DTensor parameter new local tensors; as in FSDP2, the unit then
        takes their values back into its flat shard (on the new device or dtype, if they changed).
        """
        self.reshard()
        ret = super(TorchFSDPModule, self)._apply(*args, **kwargs)  # skip FSDP2's own _apply
        unit = state_of(self).unit
        if unit is not None:
            unit.adopt_sharded()
        return ret

    def _units(self, recurse: bool) -> list[Unit]:
        return [s.unit for s in states_under([self], recurse) if s.unit is not None]


class UnshardHandle(TorchUnshardHandle):
    """Returned by ``unshard(async_op=True)``; ``wait()`` finishes the all-gather."""

    def __init__(self, unit: Unit | None) -> None:
        self._unit = unit

    def wait(self) -> None:
        if self._unit is not None:
            self._unit.wait_for_unshard()


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Run ``module.<method_name>`` (e.g. ``generate``) through the unit's forward hooks, as FSDP2 does.

    Only ``forward`` calls run the hooks that all-gather the parameters; any other method would see the
    sharded ones. Does nothing if ``module`` is not sharded (FSDP2's behaviour).
    """
    if not isinstance(module, FSDPModule):
        return
    if not hasattr(module, method_name):
        raise ValueError(f"register_fsdp_forward_method: {type(module).__name__} has no method "
                         f"{method_name!r}")
    method = getattr(module, method_name).__func__
    state = state_of(module)

    @functools.wraps(method)
    def through_hooks(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = state.pre_forward_hook(self, args, kwargs)
        return state.post_forward_hook(self, args, method(self, *args, **kwargs))

    setattr(module, method_name, through_hooks.__get__(module))


def _checked_state(module: nn.Module, where: str) -> FSDPState:
    if not isinstance(module, FSDPModule):
        raise TypeError(f"{where}: {type(module).__name__} is not sharded; call fully_shard on it first")
    return state_of(module)
