"""FSDP1's instance methods that ``ShardedModule`` takes over: ``apply``, ``register_comm_hook``.

``apply`` takes the ``ShardedModule`` (it walks the module tree); ``register_comm_hook``
the root whose units' reductions the hook would replace.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..assemble.root import ShardRoot
from ..base.torch_compat import fsdp1_training_states
from ..base.warn_once import warn_once
from ..comm import collectives
from .summon import summon_full_params

# torch.distributed.algorithms._comm_hooks.default_hooks: what shardwrap already does.
_DEFAULT_HOOKS = {"allreduce_hook", "reduce_scatter_hook"}
_COMPRESS_HOOKS = {"fp16_compress_hook": "float16", "bf16_compress_hook": "bfloat16"}
_HOOK_MODULE = "torch.distributed.algorithms._comm_hooks.default_hooks"


def apply(self: nn.Module, fn: Callable[[nn.Module], None]) -> nn.Module:
    """Call ``fn`` on every submodule (children first, then ``self``), as ``nn.Module.apply``,
    with full parameters shown and written back (initialising weights after wrapping works).
    As FSDP1's, refused (``ValueError``) unless the module is idle: not inside its forward,
    backward or a ``summon_full_params``."""
    self._assert_state(fsdp1_training_states().IDLE)
    with summon_full_params(self, recurse=True, writeback=True):
        return nn.Module.apply(self, fn)


def register_comm_hook(root: ShardRoot, state: object, hook: Callable[..., Any]) -> None:
    """Accept torch's default FSDP hooks (shardwrap's own reduction); refuse the others.

    ``allreduce_hook``/``reduce_scatter_hook`` are what every unit already does: sum over
    the data-parallel ranks, then divide by their number. Their ``state`` (``None``, or
    torch's ``DefaultState``) must ask for that: a process group of the model's
    data-parallel size holding this rank, and division factors whose product is that size
    (anything else is refused, since it would change the gradients). The split between
    pre- and post-division only guards float16's range: shardwrap divides after the sum,
    and warns once where it reduces in float16 and the state asks to divide before. Gradient
    compression hooks are refused with their counterpart, ``MixedPrecision(reduce_dtype=...)``;
    custom hooks are refused: gradients are reduced by shardwrap's runtime (bucketed,
    padded, over the unit's groups), which no FSDP hook signature describes.
    """
    module = getattr(hook, "__module__", "")
    name = getattr(hook, "__name__", repr(hook))
    if module == _HOOK_MODULE and name in _DEFAULT_HOOKS:
        _check_default_state(root, name, state)
        return
    if module == _HOOK_MODULE and name in _COMPRESS_HOOKS:
        dtype = _COMPRESS_HOOKS[name]
        raise NotImplementedError(
            f"register_comm_hook({name}): use mixed_precision=MixedPrecision("
            f"reduce_dtype=torch.{dtype}) when wrapping; it reduces gradients in {dtype}"
        )
    raise NotImplementedError(
        f"register_comm_hook({name}): custom communication hooks are not supported; shardwrap "
        "reduces gradients itself (set_reduce_bucket_size tunes bucketing, "
        "MixedPrecision(reduce_dtype=...) the reduction dtype)"
    )


def _check_default_state(root: ShardRoot, name: str, state: object) -> None:
    """``state`` asks for the average over the model's data-parallel ranks (or is None)."""
    if state is None:
        return
    pre = getattr(state, "gradient_predivide_factor", None)
    post = getattr(state, "gradient_postdivide_factor", None)
    group = getattr(state, "process_group", None)
    if pre is None or post is None or group is None:
        raise TypeError(
            f"register_comm_hook({name}): state: expected None or torch's DefaultState, "
            f"got {type(state).__name__}"
        )
    handles = [u.handle for u in root.units if u.handle is not None]
    if not handles:
        return
    size = handles[0].grads.data_parallel_size
    _check_state_group(name, group, size)
    if not math.isclose(pre * post, size):
        raise ValueError(
            f"register_comm_hook({name}): state's gradient_predivide_factor x "
            f"gradient_postdivide_factor = {pre} x {post} = {pre * post}; shardwrap averages "
            f"gradients over the {size} data-parallel ranks (a product of {size}) and does "
            "not scale them otherwise: scale the loss instead"
        )
    if pre > 1 and any(h.reduce_dtype is torch.float16 for h in handles):
        warn_once(
            f"register_comm_hook({name}, state.gradient_predivide_factor={pre})",
            "not acted on: shardwrap sums the float16 gradients and divides by "
            f"{size} afterwards (in the master dtype); it does not divide before the sum",
        )


def _check_state_group(name: str, group: object, size: int) -> None:
    """The hook state's group is the model's data-parallel group (an offline group: of
    its size, all it can tell)."""
    if collectives.is_offline_group(group):
        if group.size() != size:  # type: ignore[attr-defined]
            raise ValueError(
                f"register_comm_hook({name}): state.process_group has {group.size()} ranks, "  # type: ignore[attr-defined]
                f"but this model averages gradients over its {size} data-parallel ranks"
            )
        return
    ranks = collectives.group_ranks(group)
    if len(ranks) != size or collectives.world_rank() not in ranks:
        raise ValueError(
            f"register_comm_hook({name}): state.process_group has ranks {ranks}, but this "
            f"model averages gradients over its {size} data-parallel ranks (this rank is "
            f"{collectives.world_rank()}); give DefaultState that group, or wrap with the "
            "group you want"
        )
