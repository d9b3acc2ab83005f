"""Forward/backward hooks: gather a unit before it computes, free it after, reduce its grads.

[Note: when a unit's backward is over]
A unit's post-backward runs from an autograd node placed on the unit's forward inputs:
its backward fires once gradients for those inputs exist, which is after the unit's own
ops ran backward (and autograd runs a leaf's gradient accumulation before other ready
work). A unit whose inputs need no gradient (the embedding at the bottom of a model)
never triggers that node; the end-of-backward callback reduces it instead. Both paths
depend only on the graph's structure, so every rank issues its reductions in the same
order.

[Note: frozen units]
A unit whose parameters all have ``requires_grad=False`` (the flags are fixed at wrap
time) gets no gradient on any rank, so it issues no reduction, holds no gradient buffer
and has no place in a reduce bucket's plan. Backward still runs through it when its
inputs need gradients (frozen blocks above trainable ones) and gathers it for that; one
whose outputs need none (a frozen embedding at the bottom) is never reached by backward,
so it is not prefetched for it either. A unit that mixes frozen and trainable parameters
leaves the frozen ones out of its reduction ([Note: packed gradients] in grad_slots.py).
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from .flat_param import FlatParamHandle
from .options import ShardingStrategy

if TYPE_CHECKING:
    from .runtime import StepRuntime


class TrainingState(enum.Enum):
    IDLE = "IDLE"  # no step in flight; shards only
    FORWARD = "FORWARD"  # ran forward this step; its gradients may still come
    BACKWARD = "BACKWARD"  # gathered again for backward; local gradients accumulating
    BACKWARD_DONE = "BACKWARD_DONE"  # gradients reduced (or kept, under no_sync); resharded


class Unit:
    """One wrapped module and its flat parameter handle (``None`` when it owns none)."""

    def __init__(
        self,
        *,
        name: str,
        module: nn.Module,
        handle: FlatParamHandle | None,
        strategy: ShardingStrategy,
    ) -> None:
        self.name = name
        self.module = module
        self.handle = handle
        self.strategy = strategy
        self.state = TrainingState.IDLE
        self.runtime: StepRuntime | None = None  # set by the root that owns this unit
        # Forwards of this unit in progress: a registered method (``generate``) that calls
        # ``forward`` nests them; only the outermost one reshards.
        self.forward_depth = 0
        # None: the strategy decides; True/False: set_reshard_after_forward overrides it.
        self.reshard_after_forward_override: bool | None = None
        # Whether backward may reach (and gather) the unit this step: False only after a
        # forward with grad enabled none of whose outputs needs a gradient. Only such
        # units are prefetched for backward.
        self.expects_backward = False
        self._hook_handles: list[Any] = []

    def __repr__(self) -> str:
        return f"Unit({self.name!r}, {self.state.name})"

    # -------------------------------------------------------------- hooks
    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        runtime = self._runtime()
        runtime.record_forward(self)
        self.forward_depth += 1
        if self.handle is not None:
            runtime.schedule.before_forward_unshard(self)
            self.handle.unshard()
        runtime.schedule.after_pre_forward(self)
        if self.state is TrainingState.IDLE:
            self.state = TrainingState.FORWARD
            self.expects_backward = False
        if torch.is_grad_enabled() and self.handle is not None:
            _check_requires_grad(self.handle)
            # A frozen unit's inputs may still need gradients (a frozen block above
            # trainable ones): its post-backward then frees it as soon as it is done.
            args, kwargs = _attach_post_backward(self, args, kwargs)
        return args, kwargs

    def post_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        training = torch.is_grad_enabled()
        self.forward_depth = max(self.forward_depth - 1, 0)
        nested = self.forward_depth > 0
        if self.handle is not None and self.state is not TrainingState.BACKWARD and not nested:
            keep = self._runtime().schedule.keeps_gathered_after_forward(self)
            if not training or (self.reshard_after_forward and not keep):
                self.handle.reshard(free=self.strategy.free_after_backward)
            elif self.strategy.reduces_at_step:
                self.handle.reshard(free=False)
        if not training:
            # A reentrant activation checkpoint runs forward without grad and again in
            # backward, so backward may still need the unit.
            self.expects_backward = True
        elif _register_pre_backward(self, output):
            self.expects_backward = True
        return output

    def pre_backward(self, grad: torch.Tensor) -> None:
        runtime = self._runtime()
        runtime.queue_finalize()
        if self.state is TrainingState.IDLE:
            # A further backward through a retained graph (``retain_graph=True``): this
            # unit's step was finalised already, so enter it as a new one.
            runtime.record_forward(self)
            self.state = TrainingState.FORWARD
        if self.state in (TrainingState.FORWARD, TrainingState.BACKWARD_DONE):
            if self.handle is not None:
                runtime.schedule.before_backward_unshard(self, runtime.execution_order)
                self.handle.unshard()
            self.state = TrainingState.BACKWARD
            runtime.schedule.after_pre_backward(self, runtime.execution_order)

    def post_backward(self) -> None:
        """Reduce this unit's gradients (unless under ``no_sync``) and reshard."""
        if self.state is TrainingState.BACKWARD_DONE or self.state is TrainingState.IDLE:
            return
        runtime = self._runtime()
        handle = self.handle
        if handle is not None:
            # ZeRO-1 too: see [Note: ZeRO-1 reduces in backward]. A frozen unit has nothing
            # to reduce on any rank (see [Note: frozen units]).
            if runtime.sync_grads and handle.has_trainable_params:
                runtime.schedule.reduce_after_backward(self, runtime.execution_order)
            handle.reshard(free=self.strategy.free_after_backward)
        self.state = TrainingState.BACKWARD_DONE
        runtime.schedule.after_post_backward(self, runtime.execution_order)

    @property
    def reshard_after_forward(self) -> bool:
        """Free the gathered parameters after forward (re-gather them for backward)."""
        if self.reshard_after_forward_override is not None:
            return self.reshard_after_forward_override and self.strategy.free_after_backward
        return self.strategy.reshard_after_forward

    # ------------------------------------------------------------ helpers
    def _runtime(self) -> StepRuntime:
        if self.runtime is None:
            raise RuntimeError(f"unit {self.name!r} is not attached to a ShardedModule root")
        return self.runtime

    def register(self) -> None:
        """Install this unit's forward hooks on its module."""
        self._hook_handles.append(
            self.module.register_forward_pre_hook(self.pre_forward, with_kwargs=True)
        )
        self._hook_handles.append(
            self.module.register_forward_hook(self.post_forward, with_kwargs=True)
        )

    def remove(self) -> None:
        for h in self._hook_handles:
            h.remove()
        self._hook_handles.clear()


class _PostBackward(torch.autograd.Function):
    """Identity on the unit's inputs whose backward marks the end of the unit's backward."""

    @staticmethod
    def forward(ctx, unit: Unit, *tensors: torch.Tensor):  # type: ignore[override]
        ctx.unit = unit
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        ctx.unit.post_backward()
        return (None, *grads)


def _attach_post_backward(unit: Unit, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    # Positional tensors alone (a block called as ``block(x)``) need no pytree round trip,
    # which costs more than the rest of the hook on a small unit.
    plain = not kwargs and all(isinstance(x, torch.Tensor) for x in args)
    leaves, spec = (list(args), None) if plain else tree_flatten((args, kwargs))
    positions = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.requires_grad]
    if not positions:
        return args, kwargs
    outputs = _PostBackward.apply(unit, *(leaves[i] for i in positions))
    for i, out in zip(positions, outputs, strict=True):
        leaves[i] = out
    return (tuple(leaves), kwargs) if spec is None else tree_unflatten(leaves, spec)


def _register_pre_backward(unit: Unit, output: Any) -> bool:
    """Hook the outputs that need a gradient; whether there was any."""
    leaves = [output] if isinstance(output, torch.Tensor) else tree_flatten(output)[0]
    hooked = False
    for x in leaves:
        if isinstance(x, torch.Tensor) and x.requires_grad:
            x.register_hook(_PreBackwardHook(unit))
            hooked = True
    return hooked


def _check_requires_grad(handle: FlatParamHandle) -> None:
    # The flags are part of the layout (which slots reduce, what the optimizer holds), so
    # a change after wrapping would be silently ignored: a frozen parameter kept training.
    if [p.requires_grad for p in handle.shard_params] == handle.wrapped_requires_grad:
        return
    for info, param in zip(handle.layout.params, handle.shard_params, strict=True):
        if param.requires_grad != info.requires_grad:
            raise RuntimeError(
                f"{info.fqn}: requires_grad changed to {param.requires_grad} after "
                "ShardedModule wrapped the model; set requires_grad before wrapping"
            )


class _PreBackwardHook:
    """Tensor hook on a unit's outputs; returns nothing so the gradient is unchanged."""

    __slots__ = ("unit",)

    def __init__(self, unit: Unit) -> None:
        self.unit = unit

    def __call__(self, grad: torch.Tensor) -> None:
        self.unit.pre_backward(grad)
