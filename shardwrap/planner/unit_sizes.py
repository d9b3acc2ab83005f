"""The units a memory estimate counts: their flat layouts, as ``ShardedModule`` builds them.

From a module (the same auto-wrap policy, ownership and layouts) or from a bare parameter
count (the largest unit and the root holding the rest; by default the largest unit is one
decoder layer, [Note: the assumed model shape]). Used by :mod:`.estimate`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..layout.flat import FlatLayout
from ..layout.partition import assign_params, collect_params
from ..layout.persistence import is_persistent
from ..options import ShardingStrategy
from ..policies import as_policy, select_units
from .shapes import assumed_shape


@dataclass(frozen=True, slots=True)
class UnitSizes:
    """One unit's layout and the units directly inside it."""

    layout: FlatLayout
    nested: tuple[int, ...]  # indices of the units directly inside this one


@dataclass(frozen=True, slots=True)
class ModelSizes:
    """Every unit of a model, root first, and its buffers."""

    units: tuple[UnitSizes, ...]  # units[0] is the root
    buffer_bytes: int
    chain_numel: int | None = None  # the ZeRO-3 peak, when known without nesting


def num_shards_of(strategy: ShardingStrategy, world_size: int) -> int:
    return 1 if strategy is ShardingStrategy.NO_SHARD else world_size


def unit_layout(named: list[tuple[str, tuple[int, ...], bool]], num_shards: int, threshold: int):
    """A unit's layout as ``ShardedModule`` builds it: one shard if it is persistent."""
    numel = sum(torch.Size(shape).numel() for _, shape, _ in named)
    return FlatLayout.build(named, 1 if is_persistent(numel, threshold) else num_shards)


def model_sizes(
    source: nn.Module | int | float,
    strategy: ShardingStrategy,
    world_size: int,
    auto_wrap_policy: Any,
    largest_unit_params: int | None,
    threshold: int = 0,
    model_parallel: tuple[int, int] = (1, 1),
) -> ModelSizes:
    """``model_parallel``: ``(tensor_parallel, pipeline_parallel)`` degrees; a count is
    then split over them ([Note: counts under tensor and pipeline parallelism])."""
    num_shards = num_shards_of(strategy, world_size)
    tp, pp = model_parallel
    if isinstance(source, nn.Module):
        if largest_unit_params is not None:
            raise ValueError("largest_unit_params: only for a parameter count, not a module")
        if tp * pp != 1:
            raise ValueError(
                "tensor_parallel/pipeline_parallel: only for a parameter count; a module "
                "is counted as one rank holds it (a pipeline stage, parallelize_module'd)"
            )
        return module_sizes(source, num_shards, auto_wrap_policy, threshold)
    if isinstance(source, bool) or not isinstance(source, (int, float)) or source < 1:
        raise TypeError(
            f"model_or_num_params: expected an nn.Module or a positive count, got {source!r}"
        )
    if auto_wrap_policy is not None:
        raise ValueError("auto_wrap_policy: only for a module, not a parameter count")
    if tp * pp == 1:
        return count_sizes(int(source), num_shards, largest_unit_params, threshold)
    num_params = int(source)
    largest = largest_unit_params or assumed_shape(num_params).layer_params
    if not 1 <= largest <= num_params:
        raise ValueError(f"largest_unit_params: expected 1..{num_params}, got {largest}")
    per_rank = -(-num_params // (tp * pp))
    return count_sizes(per_rank, num_shards, min(per_rank, -(-largest // tp)), threshold)


# [Note: counts under tensor and pipeline parallelism]
# A parameter count P under TP x PP is taken as split evenly: each rank of one data-parallel
# group holds ceil(P / (TP PP)) of it (its stage's layers, its TP block of each), which
# ZeRO then shards over the DP ranks: 16 P / (TP PP DP) of fp32 Adam model state at stage
# 3. A layer (the largest unit) is split by TP only: ceil(L / TP). Embeddings and norms
# that TP replicates make the real share somewhat larger; a module instead is counted as
# given, its DTensor parameters by their local blocks.


def count_sizes(
    num_params: int, num_shards: int, largest_unit_params: int | None, threshold: int = 0
) -> ModelSizes:
    """A parameter count as two units: the largest one and the root holding the rest.

    For ZeRO-3 the peak counts only the largest unit (a model whose root holds little).
    Without ``largest_unit_params`` the largest unit is one layer of :func:`assumed_shape`.
    """
    if largest_unit_params is None:
        largest = assumed_shape(num_params).layer_params
    else:
        largest = int(largest_unit_params)
    if not 1 <= largest <= num_params:
        raise ValueError(f"largest_unit_params: expected 1..{num_params}, got {largest}")
    largest_layout = unit_layout([("largest_unit", (largest,), True)], num_shards, threshold)
    units = [UnitSizes(largest_layout, ())]
    if largest < num_params:
        rest = unit_layout([("rest", (num_params - largest,), True)], num_shards, threshold)
        units = [UnitSizes(rest, ()), units[0]]
    return ModelSizes(tuple(units), 0, chain_numel=largest_layout.padded_numel)


def _local_shape(param: torch.Tensor) -> tuple[int, ...]:
    """What one rank flattens of ``param``: its local block if it is a DTensor (recognised
    by its ``to_local``: the planner stays clear of torch.distributed)."""
    to_local = getattr(param, "to_local", None)
    return tuple(to_local().shape if callable(to_local) else param.shape)


def module_sizes(
    model: nn.Module, num_shards: int, auto_wrap_policy: Any, threshold: int = 0
) -> ModelSizes:
    """Units exactly as ``ShardedModule`` builds them (same policy, same layouts)."""
    unit_modules = [model, *select_units(model, as_policy(auto_wrap_policy), set())]
    owned = assign_params(model, unit_modules[1:], collect_params(model, set(), set()))
    layouts = [
        unit_layout(
            [(r.fqn, _local_shape(r.param), r.param.requires_grad) for r in owned[id(m)]],
            num_shards,
            threshold,
        )
        for m in unit_modules
    ]
    subtrees = [{id(s) for s in m.modules()} for m in unit_modules]
    # Each unit's parent is the innermost other unit whose subtree holds its module.
    parents = [None] + [
        min(
            (j for j in range(len(unit_modules)) if j != i and id(m) in subtrees[j]),
            key=lambda j: len(subtrees[j]),
        )
        for i, m in enumerate(unit_modules)
        if i > 0
    ]
    units = tuple(
        UnitSizes(layout, tuple(j for j, p in enumerate(parents) if p == i))
        for i, layout in enumerate(layouts)
    )
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return ModelSizes(units, buffers)
