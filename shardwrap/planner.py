"""Per-rank memory of a training run, by category, with the formula behind every number.

[Note: what the planner counts]
The tensors shardwrap itself holds on each rank, with ``b`` bytes per element of
``param_dtype``, ``N`` ranks in the shard group, ``P`` parameter elements (padded to a
multiple of ``N`` per unit), ``T`` trainable elements and ``k`` optimizer-state tensors
per trainable element (AdamW/Adam: 2, SGD with momentum: 1)::

    stage  strategy        parameters  gathered parameters (peak)   gradients  optimizer
    0      NO_SHARD        P b         0                            T b        k T b
    1      SHARD_OPTIM     P b / N     P b (kept between steps)     T b        k T b / N
    2      SHARD_GRAD_OP   P b / N     P b (all units, fwd to bwd)  T b / N    k T b / N
    3      FULL_SHARD      P b / N     largest chain of nested units T b / N   k T b / N

plus the model's buffers (never sharded). With one shard nothing is gathered: the full
buffer *is* the shard. ZeRO-1 keeps full local gradients from backward until the optimizer
step reduces them. "largest chain of nested units": a unit stays gathered while the units
inside it run (the root unit all through forward and backward), so the ZeRO-3 peak is the
largest sum of gathered sizes along one path of nested units.

Not counted: activations, the transient full gradient of the unit being reduced (about
two copies of that unit) and allocator slack. Mixed precision is not modelled yet (the
core has none): ``param_dtype`` is the dtype parameters, gradients and optimizer state
are stored in, as torch's optimizers keep their state in the parameter's dtype.

Offload moves categories off the device: ``"cpu"`` puts parameter shards, optimizer
state and (ZeRO-2/3) gradient shards in host memory; ``"disk"`` puts parameter shards
and optimizer state in files (memory-mapped).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .layout import FlatLayout, padded_numel
from .options import ShardingStrategy
from .policies import as_policy, select_units
from .units import assign_params, collect_params

STAGE_STRATEGIES = {
    0: ShardingStrategy.NO_SHARD,
    1: ShardingStrategy.SHARD_OPTIM,
    2: ShardingStrategy.SHARD_GRAD_OP,
    3: ShardingStrategy.FULL_SHARD,
}
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 1, "sgd_no_momentum": 0}
CATEGORIES = ("parameters", "gathered_parameters", "gradients", "optimizer_state", "buffers")


class Location(enum.Enum):
    DEVICE = "device"  # the accelerator (host RAM on a CPU-only run)
    HOST = "host"
    DISK = "disk"


@dataclass(frozen=True, slots=True)
class MemoryItem:
    category: str
    num_bytes: int
    location: Location
    formula: str  # symbols and the numbers put into them


@dataclass(frozen=True, slots=True)
class MemoryEstimate:
    """One rank's bytes for one strategy, by category."""

    strategy: ShardingStrategy
    world_size: int
    items: tuple[MemoryItem, ...]

    @property
    def stage(self) -> int:
        return next(s for s, member in STAGE_STRATEGIES.items() if member is self.strategy)

    def bytes(self, category: str) -> int:
        return next(i.num_bytes for i in self.items if i.category == category)

    def bytes_at(self, location: Location) -> int:
        return sum(i.num_bytes for i in self.items if i.location is location)

    @property
    def device_bytes(self) -> int:
        return self.bytes_at(Location.DEVICE)


@dataclass(frozen=True, slots=True)
class _UnitSizes:
    layout: FlatLayout
    nested: tuple[int, ...]  # indices of the units directly inside this one


@dataclass(frozen=True, slots=True)
class _ModelSizes:
    units: tuple[_UnitSizes, ...]  # units[0] is the root
    buffer_bytes: int
    chain_numel: int | None = None  # the ZeRO-3 peak, when known without nesting


def estimate_memory(
    model_or_num_params: nn.Module | int | float,
    *,
    world_size: int,
    strategy: Any = None,
    stage: int | None = None,
    param_dtype: torch.dtype = torch.float32,
    optimizer: str = "adamw",
    offload: str | None = None,
    auto_wrap_policy: Any = None,
    largest_unit_params: int | None = None,
    rank: int | None = None,
) -> MemoryEstimate | tuple[MemoryEstimate, ...]:
    """Bytes each rank holds, by category; see the module's note for every formula.

    ``model_or_num_params``: a module (its parameters are laid out exactly as
    ``ShardedModule`` would with ``auto_wrap_policy``; meta-device modules work) or a
    parameter count (one unit unless ``largest_unit_params`` names the largest one).
    Give ``strategy`` or ``stage`` for one estimate; give neither for stages 0-3 in order.
    ``rank``: whose shard to count (default: the most loaded rank, category by category).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size: expected a positive int, got {world_size!r}")
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(
            f"optimizer: expected one of {sorted(OPTIMIZER_STATES)}, got {optimizer!r}"
        )
    if offload not in (None, "cpu", "disk"):
        raise ValueError(f"offload: expected None, 'cpu' or 'disk', got {offload!r}")
    if not isinstance(param_dtype, torch.dtype):
        raise TypeError(f"param_dtype: expected a torch.dtype, got {param_dtype!r}")
    if rank is not None and not 0 <= rank < world_size:
        raise ValueError(f"rank: expected 0 <= rank < {world_size}, got {rank}")
    strategies = _strategies(strategy, stage)
    estimates = tuple(
        _estimate_one(
            _sizes(model_or_num_params, member, world_size, auto_wrap_policy, largest_unit_params),
            member,
            world_size,
            torch.empty((), dtype=param_dtype).element_size(),
            OPTIMIZER_STATES[optimizer],
            offload,
            rank,
        )
        for member in strategies
    )
    return estimates if strategy is None and stage is None else estimates[0]


def _strategies(strategy: Any, stage: int | None) -> tuple[ShardingStrategy, ...]:
    if strategy is not None and stage is not None:
        raise ValueError("strategy and stage: give one of them, not both")
    if stage is not None:
        if stage not in STAGE_STRATEGIES:
            raise ValueError(f"stage: expected 0, 1, 2 or 3, got {stage!r}")
        return (STAGE_STRATEGIES[stage],)
    if strategy is None:
        return tuple(STAGE_STRATEGIES.values())
    member = ShardingStrategy.parse(strategy)
    if member.is_hybrid:
        raise ValueError(
            f"strategy: {member.name} is not modelled; estimate FULL_SHARD or SHARD_GRAD_OP "
            "with world_size set to the shard-group size"
        )
    return (member,)


def _num_shards(strategy: ShardingStrategy, world_size: int) -> int:
    return 1 if strategy is ShardingStrategy.NO_SHARD else world_size


def _sizes(
    source: nn.Module | int | float,
    strategy: ShardingStrategy,
    world_size: int,
    auto_wrap_policy: Any,
    largest_unit_params: int | None,
) -> _ModelSizes:
    num_shards = _num_shards(strategy, world_size)
    if isinstance(source, nn.Module):
        if largest_unit_params is not None:
            raise ValueError("largest_unit_params: only for a parameter count, not a module")
        return _module_sizes(source, num_shards, auto_wrap_policy)
    if isinstance(source, bool) or not isinstance(source, (int, float)) or source < 1:
        raise TypeError(
            f"model_or_num_params: expected an nn.Module or a positive count, got {source!r}"
        )
    if auto_wrap_policy is not None:
        raise ValueError("auto_wrap_policy: only for a module, not a parameter count")
    return _count_sizes(int(source), num_shards, largest_unit_params)


def _count_sizes(num_params: int, num_shards: int, largest_unit_params: int | None) -> _ModelSizes:
    """A parameter count as two units: the largest one and the root holding the rest.

    For ZeRO-3 the peak counts only the largest unit (a model whose root holds little).
    """
    largest = num_params if largest_unit_params is None else int(largest_unit_params)
    if not 1 <= largest <= num_params:
        raise ValueError(f"largest_unit_params: expected 1..{num_params}, got {largest}")
    largest_layout = FlatLayout.build([("largest_unit", (largest,), True)], num_shards)
    units = [_UnitSizes(largest_layout, ())]
    if largest < num_params:
        rest = FlatLayout.build([("rest", (num_params - largest,), True)], num_shards)
        units = [_UnitSizes(rest, ()), units[0]]
    return _ModelSizes(tuple(units), 0, chain_numel=largest_layout.padded_numel)


def _module_sizes(model: nn.Module, num_shards: int, auto_wrap_policy: Any) -> _ModelSizes:
    """Units exactly as ``ShardedModule`` builds them (same policy, same layouts)."""
    unit_modules = [model, *select_units(model, as_policy(auto_wrap_policy), set())]
    owned = assign_params(model, unit_modules[1:], collect_params(model, set(), set()))
    layouts = [
        FlatLayout.build(
            [(r.fqn, tuple(r.param.shape), r.param.requires_grad) for r in owned[id(m)]],
            num_shards,
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
        _UnitSizes(layout, tuple(j for j, p in enumerate(parents) if p == i))
        for i, layout in enumerate(layouts)
    )
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return _ModelSizes(units, buffers)


def _chain_numel(sizes: _ModelSizes, index: int) -> int:
    if sizes.chain_numel is not None:
        return sizes.chain_numel
    unit = sizes.units[index]
    inner = max((_chain_numel(sizes, j) for j in unit.nested), default=0)
    return unit.layout.padded_numel + inner


def _shard_numels(sizes: _ModelSizes, rank: int | None) -> tuple[int, int]:
    """(shard elements, trainable elements in the shard) of ``rank`` (or the largest)."""
    num_shards = sizes.units[0].layout.num_shards
    ranks = range(num_shards) if rank is None else [rank % num_shards]
    shard = max(sum(u.layout.shard_numel for u in sizes.units) for _ in ranks)
    trainable = max(
        sum(
            piece.numel
            for u in sizes.units
            for info, piece in zip(u.layout.params, u.layout.pieces(r), strict=True)
            if info.requires_grad
        )
        for r in ranks
    )
    return shard, trainable


def _estimate_one(
    sizes: _ModelSizes,
    strategy: ShardingStrategy,
    world_size: int,
    elem: int,
    num_states: int,
    offload: str | None,
    rank: int | None,
) -> MemoryEstimate:
    units = sizes.units
    n = units[0].layout.num_shards
    padded = sum(u.layout.padded_numel for u in units)
    trainable = sum(i.numel for u in units for i in u.layout.params if i.requires_grad)
    shard, trainable_shard = _shard_numels(sizes, rank)
    sharded_grads = strategy in (ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.FULL_SHARD)
    if n == 1:
        gathered, gathered_formula = 0, "0 (one shard: the full buffer is the shard)"
    elif strategy is ShardingStrategy.FULL_SHARD:
        chain = _chain_numel(sizes, 0)
        gathered, gathered_formula = chain * elem, f"chain b = {chain:,} x {elem}"
    else:
        gathered, gathered_formula = padded * elem, f"P b = {padded:,} x {elem}"
    grads = (trainable_shard if sharded_grads else trainable) * elem
    grads_formula = (
        f"T b / N = {trainable_shard:,} x {elem}"
        if sharded_grads
        else f"T b = {trainable:,} x {elem}"
    )
    state_per_tensor = trainable if n == 1 else trainable_shard
    per_rank = "P b" if n == 1 else "P b / N"
    device, host, disk = Location.DEVICE, Location.HOST, Location.DISK
    shard_home = {None: device, "cpu": host, "disk": disk}[offload]
    grad_home = host if offload == "cpu" and sharded_grads else device
    items = (
        MemoryItem("parameters", shard * elem, shard_home, f"{per_rank} = {shard:,} x {elem}"),
        MemoryItem("gathered_parameters", gathered, device, gathered_formula),
        MemoryItem("gradients", grads, grad_home, grads_formula),
        MemoryItem(
            "optimizer_state",
            num_states * state_per_tensor * elem,
            shard_home,
            f"k T b{'' if n == 1 else ' / N'} = {num_states} x {state_per_tensor:,} x {elem}",
        ),
        MemoryItem("buffers", sizes.buffer_bytes, device, f"{sizes.buffer_bytes:,} B (replicated)"),
    )
    return MemoryEstimate(strategy, world_size, items)


def cheapest_fitting(
    estimates: tuple[MemoryEstimate, ...], budget_bytes: int
) -> MemoryEstimate | None:
    """The lowest stage (least communication) whose device bytes fit ``budget_bytes``."""
    fitting = [e for e in estimates if e.device_bytes <= budget_bytes]
    return min(fitting, key=lambda e: e.stage) if fitting else None


def format_table(estimates: tuple[MemoryEstimate, ...]) -> str:
    """A fixed-width table: one row per category, one column per stage, in GiB."""
    header = f"{'per rank (GiB)':<22}" + "".join(
        f"{f'stage {e.stage} {e.strategy.name}':>24}" for e in estimates
    )
    lines = [header]
    for category in CATEGORIES:
        cells = []
        for estimate in estimates:
            item = next(i for i in estimate.items if i.category == category)
            where = "" if item.location is Location.DEVICE else f" ({item.location.value})"
            cells.append(f"{_gib(item.num_bytes) + where:>24}")
        lines.append(f"{category:<22}" + "".join(cells))
    lines.append(
        f"{'total on device':<22}" + "".join(f"{_gib(e.device_bytes):>24}" for e in estimates)
    )
    lines.append("")
    lines.append("formulas (b bytes/element, N shards, P padded params, T trainable, k states):")
    for estimate in estimates:
        lines.append(f"  stage {estimate.stage}:")
        lines.extend(f"    {i.category:<20} {i.formula}" for i in estimate.items)
    return "\n".join(lines)


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:,.3f}"


__all__ = [
    "MemoryEstimate",
    "MemoryItem",
    "Location",
    "estimate_memory",
    "cheapest_fitting",
    "format_table",
    "padded_numel",
]
