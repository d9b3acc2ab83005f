"""``FSDPModule``: the methods FSDP2 adds to every module ``fully_shard`` was called on.

As FSDP2 does, ``fully_shard`` swaps the module's class for a ``FSDP<Name>`` subclass of
both :class:`FSDPModule` and the original class, so ``isinstance(m, FSDPModule)`` holds
and the module keeps its own methods. Each method does what FSDP2's does, on shardwrap's
runtime; the microbatch flags are the runtime's ([Note: microbatched steps] in
``runtime/step.py``), so they are set for the whole root at once, and a call that asks
for less than that is refused. A name this release cannot honour raises
``NotImplementedError`` saying why and what to use instead.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..base.torch_compat import fsdp2_reset_drops_gradients
from ..base.validate import check_bool
from ..core.unit import Unit
from .custom_comms import set_all_gather, set_reduce_scatter
from .finalization import GradientReductionHandle, finalize, keep_storage, set_manual
from .meta_init import apply_to_shards, hide_shards
from .replicas import set_all_reduce, set_force_sum, set_hook
from .state import runtime_for, state_of, unit_of

_CLASSES: dict[type, type] = {}
# FSDP<Name> -> <Name>, for FSDPModule.__new__.
_ORIGINAL: dict[type, type] = {}


class UnshardHandle:
    """What ``unshard(async_op=True)`` returns: ``wait()`` completes the all-gather."""

    def __init__(self, module: nn.Module) -> None:
        self._module = module

    def wait(self) -> None:
        """Wait for the all-gather and show the full parameters on the module."""
        runtime_for(self._module).unshard_unit(unit_of(self._module))


def _prefetch_targets(name: str, modules: object) -> tuple[Unit, ...]:
    """The units of ``modules`` (a list of modules ``fully_shard`` was called on)."""
    if not isinstance(modules, (list, tuple)):
        raise TypeError(f"{name}: expected a list of FSDPModules, got {type(modules).__name__}")
    for module in modules:
        if not isinstance(module, nn.Module) or state_of(module) is None:
            raise TypeError(
                f"{name}: expected FSDPModules (modules fully_shard was called on), got "
                f"{type(module).__name__}"
            )
    return tuple(unit_of(module) for module in modules)


def _refused(name: str, why: str):
    def method(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"FSDPModule.{name} is not yet supported by shardwrap: {why}")

    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"Not yet supported by shardwrap: {why}."
    return method


class FSDPModule:
    """A module ``shardwrap.fully_shard`` sharded (torch's ``FSDPModule`` methods)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        """Building an ``FSDP<Name>`` class directly builds a plain ``<Name>``.

        Containers build new modules of their own class: ``nn.Sequential`` slicing calls
        ``self.__class__(...)``. Only ``fully_shard`` makes a module an FSDPModule (it
        gives it a unit); a module built so has none, so it is the original class, as
        under FSDP2."""
        original = _ORIGINAL.get(cls)
        if original is None:
            return super().__new__(cls)
        module = original.__new__(original)
        module.__init__(*args, **kwargs)
        return module

    def __deepcopy__(self, memo: dict) -> Any:
        raise NotImplementedError(
            f"copy.deepcopy of a sharded {type(self).__name__} is not supported by "
            "shardwrap (its parameters are this rank's shards and its unit holds the "
            "process group): deepcopy the model before fully_shard, or copy its state dict"
        )

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's unit and show the full parameters; with ``async_op``,
        only issue the all-gather and return a handle whose ``wait()`` completes it."""
        module: Any = self
        wait = not check_bool("async_op", async_op)
        runtime_for(module).unshard_unit(unit_of(module), wait=wait)
        return None if wait else UnshardHandle(module)

    def reshard(self) -> None:
        """Free this module's gathered parameters and show the shards (DTensors) again."""
        module: Any = self
        runtime_for(module).reshard_unit(unit_of(module))

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        """Whether backward reduce-scatters gradients (False: accumulate them locally); sets
        :meth:`set_requires_all_reduce` to the same, as FSDP2 does."""
        value = check_bool("requires_gradient_sync", requires_gradient_sync)
        runtime = _whole_root(self, "set_requires_gradient_sync", recurse)
        if not value:
            _check_local_accumulation(runtime)
        for unit in runtime.units:  # without a sync nothing is reduced, so no check here
            if unit.handle is not None:
                unit.handle.grads.replicas.require_all_reduce(value)
        runtime.sync_grads = value

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True):
        """Under HSDP (a 2-D mesh), whether backward all-reduces this module's unit's (and,
        with ``recurse``, every unit's below) reduce-scattered gradients across replicas;
        False keeps them for the next backward that does ([Note: the replica all-reduce
        skipped] in ``core/replica_grads.py``). No effect on a 1-D mesh, as under FSDP2."""
        value = check_bool("requires_all_reduce", requires_all_reduce)
        modules = self.modules() if check_bool("recurse", recurse) else [self]  # type: ignore[attr-defined]
        set_all_reduce(modules, value)

    def set_all_reduce_hook(self, hook, *, stream=None) -> None:
        """Call ``hook(reduced)`` in place on this module's unit's reduced gradient chunk:
        after the replica all-reduce under HSDP, after the reduce-scatter on a 1-D mesh
        ([Note: the all-reduce hook] in ``core/replica_grads.py``)."""
        state = state_of(self)  # type: ignore[arg-type]
        hsdp = state is not None and state.mesh.ndim == 2
        set_hook(self, hook, stream, hsdp=hsdp)  # type: ignore[arg-type]

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True):
        """Whether units free their gathered parameters after backward (default True)."""
        value = check_bool("reshard_after_backward", reshard_after_backward)
        _whole_root(self, "set_reshard_after_backward", recurse).reshard_after_backward = value

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Whether the next backward ends the optimizer step (default True)."""
        runtime_for(self).is_last_backward = check_bool(  # type: ignore[arg-type]
            "is_last_backward", is_last_backward
        )

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True):
        """Whether this module's unit (and, with ``recurse``, every unit below) frees its
        gathered parameters after forward."""
        value = check_bool("reshard_after_forward", reshard_after_forward)
        modules = self.modules() if check_bool("recurse", recurse) else [self]  # type: ignore[attr-defined]
        for module in modules:
            state = state_of(module)
            if state is not None:
                state.reshard_after_forward = value
                state.unit.set_reshard_after_forward(value)

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        """``nn.Module._apply`` (``to_empty``, ``to``) with this unit's shard views kept the
        engine's storage ([Note: meta-device modules on the FSDP2 door] in ``meta_init.py``)."""
        module: Any = self
        unit = unit_of(module)
        handle = unit.handle
        if handle is None:
            return super()._apply(fn, recurse)  # type: ignore[misc]
        runtime_for(module).reshard_unit(unit)  # the module shows the shard views
        apply_to_shards(handle, fn)  # first: a refused conversion leaves the module as it was
        hide_shards(handle)
        try:
            return super()._apply(fn, recurse)  # type: ignore[misc]
        finally:
            handle.show_params(handle.shard_params)

    def set_modules_to_forward_prefetch(self, modules: list[Any]) -> None:
        """Issue the all-gathers of ``modules`` (FSDPModules, in order) once this module
        is gathered for forward, instead of the schedule's choice ([Note: explicit
        prefetch] in runtime/schedule.py)."""
        targets = _prefetch_targets("set_modules_to_forward_prefetch", modules)
        unit_of(self).set_prefetch_targets(forward=True, targets=targets)  # type: ignore[arg-type]

    def set_modules_to_backward_prefetch(self, modules: list[Any]) -> None:
        """Issue the all-gathers of ``modules`` (FSDPModules, in order) once this module
        is gathered for backward, instead of the next unit in backward order ([Note:
        explicit prefetch] in runtime/schedule.py)."""
        targets = _prefetch_targets("set_modules_to_backward_prefetch", modules)
        unit_of(self).set_prefetch_targets(forward=False, targets=targets)  # type: ignore[arg-type]

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide this module's unit's summed gradients by ``factor`` instead of the mesh
        size (1.0: the sum, as torchtitan asks of FSDP2 when it scales the loss itself)."""
        handle = unit_of(self).handle  # type: ignore[arg-type]
        if handle is not None:  # a unit without parameters reduces nothing
            handle.grads.set_divide_factor(factor)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """torch's older name of :meth:`set_gradient_divide_factor`."""
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Accepted, and true either way: shardwrap's collectives always reduce with SUM
        and divide afterwards, which is what ``enable=True`` asks of FSDP2. An all-reduce
        hook then sees the sum, as under FSDP2 ([Note: the all-reduce hook])."""
        set_force_sum(self, check_bool("enable", enable))  # type: ignore[arg-type]

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """Whether backward gathers this module's unit (default True). False, for a unit
        whose backward needs its parameters' shapes only (an embedding): no all-gather in
        backward, its gradients reduced as usual ([Note: units not gathered for backward]
        in runtime/step.py)."""
        unit_of(self).set_unshard_in_backward(  # type: ignore[arg-type]
            check_bool("unshard_in_backward", unshard_in_backward)
        )

    def set_post_optim_event(self, event: torch.Event) -> None:
        """Make the next forward's all-gathers wait for ``event`` (recorded after the
        optimizer step), then drop it: set a new one each step ([Note: the post-optimizer
        event] in runtime/step.py)."""
        if not isinstance(event, (torch.Event, torch.cuda.Event)):
            raise TypeError(
                f"event: expected a torch.Event or torch.cuda.Event, got {type(event).__name__}"
            )
        runtime_for(self).post_optim_event = event  # type: ignore[arg-type]

    def reset_iter_state(self) -> None:
        """After an exception aborted a forward or backward, on the root on every rank:
        wait for the collectives in flight, drop the step's reductions and gathered
        parameters, and start the next step afresh ([Note: a step abandoned by an
        exception] in runtime/step.py). Call ``optimizer.zero_grad()`` after it."""
        state = state_of(self)  # type: ignore[arg-type]
        if state is not None and state.root is None:  # FSDP2's own error
            raise RuntimeError("reset_iter_state must be called on the root FSDP module")
        drop = fsdp2_reset_drops_gradients()  # as this torch's FSDP2 does
        runtime_for(self).reset_iter_state(drop_grads=drop)  # type: ignore[arg-type]

    def set_manual_backward_finalization(self, enabled: bool) -> None:
        """On the root: whether the caller ends each step with :meth:`finalize_backward`
        after its last backward, instead of every backward's end ending it ([Note: manual
        backward finalization] in runtime/manual_finalization.py). Set it before the step's
        first backward; it cannot change until the step ends."""
        set_manual(self, enabled)  # type: ignore[arg-type]

    def finalize_backward(self, *, async_op: bool = False) -> GradientReductionHandle | None:
        """On the root, under manual finalization, after the step's last backward: reduce
        the gradients still local, wait, assign ``.grad`` and end the step; with
        ``async_op``, only issue the reductions and return a handle whose ``wait()`` does
        the rest (before any forward or further finalization)."""
        return finalize(self, async_op)  # type: ignore[arg-type]

    def set_keep_unsharded_storage(self, keep: bool, *, recurse: bool = True) -> None:
        """Whether this module's unit (and, with ``recurse``, every unit below) keeps its
        gathered parameters' storage when it reshards: the full parameters keep their data
        pointers from one gather to the next, at the cost of their memory; every unshard
        still gathers, as FSDP2's."""
        keep_storage(self, keep, recurse)  # type: ignore[arg-type]

    def set_custom_all_gather(self, comm: Any) -> None:
        """Gather this module's unit's parameters with ``comm`` (FSDP2's ``AllGather``
        protocol: ``allocate(size, *, dtype, device)`` gives the output buffer, then
        ``comm(output_tensor=, input_tensor=, group=, async_op=True)``). The input is this
        rank's flat shard and the output every rank's, in rank order, in the compute dtype;
        the shard's element order is the door's, not FSDP2's ([Note: user communicators]
        in comm/user_comms.py). Not called with a single shard (nothing to gather)."""
        set_all_gather(self, comm)  # type: ignore[arg-type]

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        """Reduce-scatter this module's unit's gradients with ``comm`` (FSDP2's
        ``ReduceScatter`` protocol: ``allocate`` gives the input and output buffers, then
        ``comm(output_tensor=, input_tensor=, group=, op=ReduceOp.SUM, async_op=True)``),
        in the reduce dtype; the division by the mesh size (or the divide factor) is the
        engine's, around the sum ([Note: user communicators] in comm/user_comms.py)."""
        set_reduce_scatter(self, comm)  # type: ignore[arg-type]

    _comms = (
        "shardwrap's communicators own the collectives and their buffers (a user's own "
        "object: set_custom_all_gather, set_custom_reduce_scatter)"
    )
    set_allocate_memory_from_process_group_for_comm = _refused(
        "set_allocate_memory_from_process_group_for_comm", _comms
    )
    set_symm_mem_for_comm = _refused("set_symm_mem_for_comm", _comms)
    set_separate_reduce_scatter_group = _refused("set_separate_reduce_scatter_group", _comms)
    set_reduce_scatter_max_input_buffers = _refused("set_reduce_scatter_max_input_buffers", _comms)
    set_reduce_scatter_unused_params = _refused(
        "set_reduce_scatter_unused_params",
        "a parameter without a gradient on every rank gets none (shardwrap's presence vote)",
    )


def _whole_root(module: Any, method: str, recurse: object):
    """The runtime whose flag ``method`` sets: only when the call covers all its units."""
    runtime = runtime_for(module)
    covered = {id(m) for m in module.modules()} if check_bool("recurse", recurse) else {id(module)}
    members = [m for unit in runtime.units if (s := state_of(unit.module)) for m in s.members]
    if any(id(member) not in covered for member in members):
        raise NotImplementedError(
            f"FSDPModule.{method} is not yet supported by shardwrap for part of a model: "
            "the flag is the root's; call it on the root module with recurse=True"
        )
    return runtime


def _check_local_accumulation(runtime) -> None:
    """Refuse skipping the gradient sync where FSDP2 would accumulate in another dtype.

    Without a sync FSDP2 keeps a unit's unsharded gradients in its ``reduce_dtype``
    (``FSDPParam.to_accumulated_grad_if_needed``); the engine keeps them in the compute
    dtype (``param_dtype``), so the two differ whenever those two dtypes do.
    """
    for unit in runtime.units:
        handle = unit.handle
        if handle is not None and handle.compute_dtype != handle.reduce_dtype:
            raise NotImplementedError(
                "FSDPModule.set_requires_gradient_sync(False) is not yet supported by "
                f"shardwrap for unit {unit.name!r}: its mp_policy reduces in "
                f"{handle.reduce_dtype} but computes in {handle.compute_dtype}, and FSDP2 "
                "accumulates unsynced gradients in the reduce dtype; use one dtype for both"
            )


def as_fsdp_module(module: nn.Module) -> None:
    """Swap ``module``'s class for ``FSDP<Name>`` (an :class:`FSDPModule` subclass)."""
    cls = type(module)
    if issubclass(cls, FSDPModule):
        return
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
        _ORIGINAL[_CLASSES[cls]] = cls
    module.__class__ = _CLASSES[cls]
