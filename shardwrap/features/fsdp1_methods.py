"""FSDP1's instance methods that ``ShardedModule`` takes over: ``apply``, ``register_comm_hook``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from .summon import summon_full_params

# torch.distributed.algorithms._comm_hooks.default_hooks: what shardwrap already does.
_DEFAULT_HOOKS = {"allreduce_hook", "reduce_scatter_hook"}
_COMPRESS_HOOKS = {"fp16_compress_hook": "float16", "bf16_compress_hook": "bfloat16"}
_HOOK_MODULE = "torch.distributed.algorithms._comm_hooks.default_hooks"


def apply(self: nn.Module, fn: Callable[[nn.Module], None]) -> nn.Module:
    """Call ``fn`` on every submodule (children first, then ``self``), as ``nn.Module.apply``,
    with full parameters shown and written back (initialising weights after wrapping works)."""
    with summon_full_params(self, recurse=True, writeback=True):
        return nn.Module.apply(self, fn)


def register_comm_hook(self: nn.Module, state: object, hook: Callable[..., Any]) -> None:
    """Accept torch's default FSDP hooks (shardwrap's own reduction); refuse the others.

    ``allreduce_hook``/``reduce_scatter_hook`` are what every unit already does. Gradient
    compression hooks are refused with their counterpart, ``MixedPrecision(reduce_dtype=...)``;
    custom hooks are refused: gradients are reduced by shardwrap's runtime (bucketed,
    padded, over the unit's groups), which no FSDP hook signature describes.
    """
    module = getattr(hook, "__module__", "")
    name = getattr(hook, "__name__", repr(hook))
    if module == _HOOK_MODULE and name in _DEFAULT_HOOKS:
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
