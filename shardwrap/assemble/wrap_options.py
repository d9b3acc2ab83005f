"""``WrapOptions``: what every door hands the composition root, validated once.

A door parses its users' vocabulary (FSDP1's constructor arguments, a DeepSpeed config)
into one ``WrapOptions``; ``build.compose.build_root`` builds the same root from it
whichever door it came from. Validation happens here, at construction, so a bad value
raises before any unit, group or collective exists.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..base.records import as_record
from ..base.validate import check_bool
from ..layout.persistence import check_threshold
from ..layout.shard_layout import ShardLayout
from ..options import (
    BackwardPrefetch,
    CommQuantization,
    CPUOffload,
    DiskOffload,
    MixedPrecision,
    ShardingStrategy,
)
from ..policies import PolicyCallable, as_policy


@dataclass(frozen=True, kw_only=True, eq=False)
class WrapOptions:
    """One model's wrap options, in shardwrap's types (see ``ShardedModule`` for each).

    Values in torch's or a door's spelling (torch's enum members and option records,
    strategy names) are converted at construction; anything else raises ``TypeError`` or
    ``ValueError`` naming the argument.
    """

    sharding_strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD
    backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE
    forward_prefetch: bool = False
    mixed_precision: MixedPrecision | None = None
    # CPUOffload: host shards; DiskOffload: shards and Adam state in mapped files.
    cpu_offload: CPUOffload | DiskOffload | None = None
    # Units under this many elements stay whole on every rank ([Note: parameter persistence]).
    param_persistence_threshold: int = 0
    comm_quantization: CommQuantization | None = None
    auto_wrap_policy: PolicyCallable | None = None
    ignored: frozenset[nn.Module] = frozenset()  # module trees left unsharded
    # Parameters left unsharded and unmanaged wherever they sit (FSDP2's ignored_params).
    ignored_params: frozenset[nn.Parameter] = frozenset()
    param_init_fn: Callable[[nn.Module], None] | None = None
    device_id: int | torch.device | None = None
    sync_module_states: bool = False
    # As torch takes them (a group, a (shard, replicate) pair, a mesh or a slice of one);
    # ``comm.groups.resolve_groups`` checks them against the strategy when the root is built.
    process_group: Any = None
    device_mesh: Any = None
    # How each unit's shards hold its parameters: FLAT slices (FSDP1, DeepSpeed) or FSDP2's
    # dim-0 chunks (the fully_shard door), see layout/shard_layout.py.
    layout: ShardLayout = ShardLayout.FLAT
    # Unit modules answer as FSDP1 instances ([Note: units as FSDP instances]); the FSDP2
    # door's are FSDPModules instead, and torch's FSDP1 code must not take them for its own.
    fsdp1_units: bool = True

    def __post_init__(self) -> None:
        offload = self.cpu_offload
        if offload is not None:
            offload = as_record("cpu_offload", offload, CPUOffload, DiskOffload)
        parsed = {
            "sharding_strategy": ShardingStrategy.parse(self.sharding_strategy),
            "backward_prefetch": BackwardPrefetch.parse(self.backward_prefetch),
            "forward_prefetch": check_bool("forward_prefetch", self.forward_prefetch),
            "mixed_precision": MixedPrecision.parse(self.mixed_precision),
            "cpu_offload": offload,
            "param_persistence_threshold": check_threshold(self.param_persistence_threshold),
            "comm_quantization": CommQuantization.parse(self.comm_quantization),
            "auto_wrap_policy": as_policy(self.auto_wrap_policy),
            "ignored": _check_ignored(self.ignored),
            "ignored_params": _check_ignored_params(self.ignored_params),
            "sync_module_states": check_bool("sync_module_states", self.sync_module_states),
            "fsdp1_units": check_bool("fsdp1_units", self.fsdp1_units),
        }
        if not isinstance(self.layout, ShardLayout):
            raise TypeError(f"layout: expected a ShardLayout, got {self.layout!r}")
        if self.param_init_fn is not None and not callable(self.param_init_fn):
            raise TypeError(f"param_init_fn: expected a callable, got {self.param_init_fn!r}")
        for name, value in parsed.items():
            object.__setattr__(self, name, value)

    def agreed(self) -> str:
        """The options every rank must share, besides its units ([Note: rank agreement]).

        Only options that change which collectives run: FSDP1's ``limit_all_gathers`` and
        ``use_orig_params`` change nothing ([Note: FSDP1 arguments not acted on]), so ranks
        may differ in them.
        """
        offload = type(self.cpu_offload).__name__ if self.cpu_offload else "no offload"
        return (
            f"{self.backward_prefetch}, forward_prefetch={self.forward_prefetch}, {offload}, "
            f"sync_module_states={self.sync_module_states}, "
            f"persistence threshold {self.param_persistence_threshold}, "
            f"layout {self.layout.value}"
        )


def _check_ignored(ignored: object) -> frozenset[nn.Module]:
    if not isinstance(ignored, (set, frozenset)) or not all(
        isinstance(m, nn.Module) for m in ignored
    ):
        raise TypeError(f"ignored: expected a set of nn.Module, got {ignored!r}")
    return frozenset(ignored)


def _check_ignored_params(ignored: object) -> frozenset[nn.Parameter]:
    if not isinstance(ignored, (set, frozenset)) or not all(
        isinstance(p, torch.Tensor) for p in ignored
    ):
        raise TypeError(f"ignored_params: expected a set of nn.Parameter, got {ignored!r}")
    return frozenset(ignored)
