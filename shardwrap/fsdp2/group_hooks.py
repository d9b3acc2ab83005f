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
Each root forward starts the group afresh: a pass left open (a module that did not run)
is finished first, on the last module's call, as FSDP2 finishes its groups with the root's
forward (``GroupPass.new_forward``); a second pass
in one root forward (a member called again, e.g. per chunk of the loss) is refused by
name: FSDP2 gathers and frees the group again for it, which the door does not yet.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .. import hooks
from ..base.torch_compat import in_backward
from ..core.unit import TrainingState, Unit
from ..runtime import registry
from .fully_shard_args import NOT_YET


def _runtime(unit: Unit):
    runtime = registry.runtime_of(unit)
    if runtime is None:
        raise RuntimeError(f"unit {unit.name!r} is not attached to a fully_shard root")
    return runtime


class GroupPass:
    """Where a list unit's pass through its modules stands in this root forward."""

    def __init__(self, unit: Unit, modules: list[nn.Module]) -> None:
        self.unit = unit
        self.modules = modules
        self.waiting: set[int] = set()  # ids of the group's modules not yet run this pass
        self.passes = 0  # passes begun since the root's forward began (outside backward)
        # The last module's call in an open pass, to finish it with: (module, args, kwargs,
        # output, grad mode), dropped when the pass ends.
        self.last_call: tuple | None = None

    def new_forward(self) -> None:
        """The root's forward begins: a pass left open (a module of the group that did not
        run) ends here, as FSDP2 finishes its groups with the root's forward: the unit's
        post-forward runs on the last module's call (its outputs hooked for backward, the
        unit released by its free rule), so the next forward does not free under it what
        the open pass's graph saved."""
        call, self.last_call = self.last_call, None
        if self.waiting and call is not None and self.unit.state is not TrainingState.IDLE:
            module, args, kwargs, output, grad_mode = call
            with torch.set_grad_enabled(grad_mode):
                hooks.post_forward(self.unit, _runtime(self.unit), module, args, kwargs, output)
        self.waiting.clear()
        self.passes = 0

    def begin(self) -> bool:
        """Whether this module's forward begins a pass (the first of the group to run)."""
        if self.waiting:
            return False
        if not in_backward():  # a recompute in backward (activation checkpointing) is not one
            self.passes += 1
            if self.passes > 1:
                self.passes = 0
                names = [type(m).__name__ for m in self.modules]
                raise NotImplementedError(
                    f"fully_shard({names}) as one unit: its modules ran a second time since "
                    f"the root's forward began (e.g. a head called per chunk of the loss), "
                    f"which {NOT_YET}; make separate units (fully_shard on each module)"
                )
        self.waiting.update(id(m) for m in self.modules)
        return True

    def end(self, module: nn.Module, call: tuple) -> bool:
        """Whether this module's forward ends the pass (every module of the group ran);
        ``call`` (its args, kwargs, output) is kept while the pass stays open."""
        self.waiting.discard(id(module))
        self.last_call = (module, *call, torch.is_grad_enabled()) if self.waiting else None
        return not self.waiting


def register_group_hooks(unit: Unit, modules: list[nn.Module]) -> GroupPass:
    """Hook ``modules``'s forwards so ``unit`` is entered and left once per group pass."""
    group = GroupPass(unit, modules)

    def pre(module: nn.Module, args: tuple, kwargs: dict) -> Any:
        if not group.begin():
            return None
        return hooks.pre_forward(unit, _runtime(unit), module, args, kwargs)

    def post(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        if not group.end(module, (args, kwargs, output)):
            return None
        return hooks.post_forward(unit, _runtime(unit), module, args, kwargs, output)

    for module in modules:
        unit.add_hook_handle(module.register_forward_pre_hook(pre, with_kwargs=True))
        unit.add_hook_handle(module.register_forward_hook(post, with_kwargs=True))
    return group
