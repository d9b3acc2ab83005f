"""Forward hooks for a unit made of several modules (``fully_shard([m1, m2])``).

[Note: a list as one unit]
FSDP2 makes one unit of a list's parameters: gathered when the first of its modules
starts forward, freed when the last has finished. The engine's unit hooks
(``hooks.pre_forward`` / ``hooks.post_forward``) run once per forward of one module, so
here they run once per forward of the group: the pre-forward on whichever module starts
the group (it attaches the post-backward node to that module's inputs), the post-forward
when every module of the group has run (it hooks pre-backward on that last module's
outputs). For modules that run one after another, backward then meets the last one's
outputs first and the first one's inputs last, as for a single module; gradients of a
group whose first inputs need none are reduced at the end of backward, as any such unit.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .. import hooks
from ..core.unit import Unit
from ..runtime import registry


def _runtime(unit: Unit):
    runtime = registry.runtime_of(unit)
    if runtime is None:
        raise RuntimeError(f"unit {unit.name!r} is not attached to a fully_shard root")
    return runtime


def register_group_hooks(unit: Unit, modules: list[nn.Module]) -> None:
    """Hook ``modules``'s forwards so ``unit`` is entered and left once per group pass."""
    waiting: set[int] = set()  # ids of the group's modules not yet run in this pass

    def pre(module: nn.Module, args: tuple, kwargs: dict) -> Any:
        if waiting:
            return None
        waiting.update(id(m) for m in modules)
        return hooks.pre_forward(unit, _runtime(unit), module, args, kwargs)

    def post(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        waiting.discard(id(module))
        if waiting:
            return None
        return hooks.post_forward(unit, _runtime(unit), module, args, kwargs, output)

    for module in modules:
        unit.add_hook_handle(module.register_forward_pre_hook(pre, with_kwargs=True))
        unit.add_hook_handle(module.register_forward_hook(post, with_kwargs=True))
