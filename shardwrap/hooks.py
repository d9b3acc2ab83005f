"""Forward/backward hooks of a unit: glue from torch's hooks to the step runtime's moments.

Each hook finds the unit's root ``StepRuntime`` (in the registry) and calls its method for
the moment (``pre_forward``, ``post_forward``, ``pre_backward``, ``post_backward``); what
happens then is in runtime/step.py. This module only places the hooks: on the module, on
the unit's outputs (pre-backward) and as an autograd node on its inputs (post-backward).

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
leaves the frozen ones out of its reduction ([Note: packed gradients] in layout/grad_slots.py).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from .base.compiler import run_eagerly
from .base.torch_compat import tree_flatten, tree_unflatten
from .core.unit import Unit
from .flat_param import FlatParamHandle
from .runtime import registry
from .runtime.step import StepRuntime


def register(unit: Unit) -> None:
    """Install ``unit``'s forward hooks on its module.

    The hooks find the unit's runtime in the registry when they run, not when they are
    installed: a root that adopts a nested root's units takes them over, hooks included.
    """
    pre_hook, post_hook = _eager_hooks()
    unit.add_hook_handle(
        unit.module.register_forward_pre_hook(functools.partial(pre_hook, unit), with_kwargs=True)
    )
    unit.add_hook_handle(
        unit.module.register_forward_hook(functools.partial(post_hook, unit), with_kwargs=True)
    )


@functools.cache
def _eager_hooks() -> tuple:
    """The forward hooks, run eagerly under ``torch.compile``.

    See [Note: hooks outside the compiled graph] in base/compiler.py.
    """
    return run_eagerly(_pre_forward_hook), run_eagerly(_post_forward_hook)


def _runtime_of(unit: Unit) -> StepRuntime:
    runtime = registry.runtime_of(unit)
    if runtime is None:
        raise RuntimeError(f"unit {unit.name!r} is not attached to a ShardedModule root")
    return runtime


def _pre_forward_hook(unit: Unit, module: nn.Module, args: tuple, kwargs: dict):
    return pre_forward(unit, _runtime_of(unit), module, args, kwargs)


def _post_forward_hook(unit: Unit, module: nn.Module, args: tuple, kwargs: dict, output: Any):
    return post_forward(unit, _runtime_of(unit), module, args, kwargs, output)


def pre_forward(
    unit: Unit, runtime: StepRuntime, module: nn.Module, args: tuple, kwargs: dict
) -> tuple[tuple, dict]:
    """The forward pre-hook: the runtime's pre-forward, then the post-backward node."""
    runtime.pre_forward(unit)
    if torch.is_grad_enabled() and unit.handle is not None:
        _check_requires_grad(unit.handle)
        # A frozen unit's inputs may still need gradients (a frozen block above
        # trainable ones): its post-backward then frees it as soon as it is done.
        args, kwargs = _attach_post_backward(unit, runtime, args, kwargs)
    return args, kwargs


def post_forward(
    unit: Unit, runtime: StepRuntime, module: nn.Module, args: tuple, kwargs: dict, output: Any
) -> Any:
    """The forward hook: pre-backward hooks on the outputs, then the runtime's post-forward."""
    training = torch.is_grad_enabled()
    # Without grad, a reentrant activation checkpoint runs forward again in backward, so
    # backward may still need the unit.
    hooked = training and _register_pre_backward(unit, runtime, output)
    runtime.post_forward(unit, training=training, backward_expected=not training or hooked)
    return output


class _PostBackward(torch.autograd.Function):
    """Identity on the unit's inputs whose backward marks the end of the unit's backward."""

    @staticmethod
    def forward(ctx, unit: Unit, runtime: StepRuntime, *tensors: torch.Tensor):  # type: ignore[override]
        ctx.unit = unit
        ctx.runtime = runtime
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        ctx.runtime.post_backward(ctx.unit)
        return (None, None, *grads)


def _attach_post_backward(
    unit: Unit, runtime: StepRuntime, args: tuple, kwargs: dict
) -> tuple[tuple, dict]:
    # Positional tensors alone (a block called as ``block(x)``) need no pytree round trip,
    # which costs more than the rest of the hook on a small unit.
    plain = not kwargs and all(isinstance(x, torch.Tensor) for x in args)
    leaves, spec = (list(args), None) if plain else tree_flatten((args, kwargs))
    positions = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.requires_grad]
    if not positions:
        return args, kwargs
    outputs = _PostBackward.apply(unit, runtime, *(leaves[i] for i in positions))
    for i, out in zip(positions, outputs, strict=True):
        leaves[i] = out
    return (tuple(leaves), kwargs) if spec is None else tree_unflatten(leaves, spec)


def _register_pre_backward(unit: Unit, runtime: StepRuntime, output: Any) -> bool:
    """Hook the outputs that need a gradient; whether there was any."""
    leaves = [output] if isinstance(output, torch.Tensor) else tree_flatten(output)[0]
    hooked = False
    for x in leaves:
        if isinstance(x, torch.Tensor) and x.requires_grad:
            x.register_hook(_PreBackwardHook(unit, runtime))
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

    __slots__ = ("unit", "runtime")

    def __init__(self, unit: Unit, runtime: StepRuntime) -> None:
        self.unit = unit
        self.runtime = runtime

    def __call__(self, grad: torch.Tensor) -> None:
        self.runtime.pre_backward(self.unit)
