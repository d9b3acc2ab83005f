"""Per-rank memory of a training run, by category, with the formula behind every number.

[Note: what the planner counts]
The tensors shardwrap itself holds on each rank, with ``b`` bytes per element of the
stored (master) parameters, ``c`` bytes per element of the compute dtype (``c = b``
without mixed precision), ``N`` ranks in the shard group, ``P`` parameter elements
(padded to a multiple of ``N`` per unit), ``T`` trainable elements and ``k``
optimizer-state tensors per trainable element (AdamW/Adam: 2, SGD with momentum: 1)::

    stage  strategy        parameters  gathered parameters (peak)   gradients  optimizer
    0      NO_SHARD        P b         0 (P c kept if c != b)       T b        k T b
    1      SHARD_OPTIM     P b / N     P c (kept between steps)     T b / N    k T b / N
    2      SHARD_GRAD_OP   P b / N     P c (all units, fwd to bwd)  T b / N    k T b / N
    3      FULL_SHARD      P b / N     (chain + next unit) c        T b / N    k T b / N

plus the model's buffers (never sharded). With one shard and no cast nothing is
gathered: the full buffer *is* the shard. ZeRO-1 reduces each unit's gradients in
backward as ZeRO-2 does, so it too holds gradient shards (full local gradients only under
``no_sync``, as every stage does; not counted). "chain": a unit
stays gathered while the units inside it run (the root unit all through forward and
backward), so the ZeRO-3 peak is the largest sum of gathered sizes along one path of
nested units, plus the unit that backward prefetch (``BACKWARD_PRE``, the default)
gathers ahead: the largest unit off that path (for a parameter count, one more largest
unit: the units in flight are the one computing and the prefetched one). A parameter count
is a decoder whose layers are its units ([Note: the assumed model shape]) unless
``largest_unit_params`` names the largest unit.

Against the ZeRO paper (mixed-precision Adam, ``Psi`` parameters, ``N`` ranks): stage 3's
model state is ``16 Psi / N`` here too (fp32 master 4, fp32 gradient shard 4, Adam 8; fp32
without mixed precision the same), plus the gathered units. Stages 1 and 2 hold
``2 Psi + 16 Psi / N`` (paper: ``4 Psi + 12 Psi / N`` and ``2 Psi + 14 Psi / N``): the bf16
working copy is whole, gradients are reduced to shards in backward at stage 1 too, and
the gradient shard handed to the optimizer is in the master dtype (4 bytes, not 2).

Not counted: activations, the transient full gradient of the unit being reduced (about
two copies of that unit) and allocator slack. Gradients handed to the optimizer and the
optimizer state are in the master dtype, as torch's optimizers keep their state in the
parameter's dtype.

With ``param_persistence_threshold`` (see [Note: parameter persistence]) a unit under
the threshold counts as one shard: whole parameters, gradients and optimizer state on
every rank, and nothing gathered unless it is cast. ``N`` then applies to the other units.

Offload moves categories off the device: ``"cpu"`` puts parameter shards, optimizer
state and the gradients handed to the optimizer in host memory, and with one shard the
gathered buffer becomes a device copy of the host shard (``CPUOffload``); ``"disk"`` puts
parameter shards, the gradients handed to the optimizer and optimizer state in files
(memory-mapped; the resident peak of such a run: planner/resident.py).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from ..layout.flat import FlatLayout, padded_numel
from ..layout.persistence import check_threshold
from ..options import ShardingStrategy
from .secondary import CATEGORY, check_hpz, hpz_numel
from .shards import worst_trainable_shard
from .unit_sizes import ModelSizes, model_sizes

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
        """Bytes of ``category``; 0 for one this estimate does not hold (``hpz_secondary``)."""
        return next((i.num_bytes for i in self.items if i.category == category), 0)

    def bytes_at(self, location: Location) -> int:
        return sum(i.num_bytes for i in self.items if i.location is location)

    @property
    def device_bytes(self) -> int:
        return self.bytes_at(Location.DEVICE)

    @property
    def model_state_bytes(self) -> int:
        """Parameter shards, gradients and optimizer state, wherever they are (16P/N at stage 3)."""
        return sum(self.bytes(c) for c in ("parameters", "gradients", "optimizer_state"))


def estimate_memory(
    model_or_num_params: nn.Module | int | float,
    *,
    world_size: int,
    strategy: Any = None,
    stage: int | None = None,
    param_dtype: torch.dtype = torch.float32,
    compute_dtype: torch.dtype | None = None,
    optimizer: str = "adamw",
    offload: str | None = None,
    auto_wrap_policy: Any = None,
    largest_unit_params: int | None = None,
    rank: int | None = None,
    backward_prefetch: bool = True,
    param_persistence_threshold: int = 0,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    hpz_partition_size: int | None = None,
) -> MemoryEstimate | tuple[MemoryEstimate, ...]:
    """Bytes each rank holds, by category; see the module's note for every formula.

    ``param_dtype`` is the dtype parameters are stored (and the optimizer steps) in;
    ``compute_dtype`` is ``MixedPrecision.param_dtype`` (gathered parameters and local
    gradients), ``None`` for no mixed precision.
    ``model_or_num_params``: a module (its parameters are laid out exactly as
    ``ShardedModule`` would with ``auto_wrap_policy``; meta-device modules work) or a
    parameter count (units of one decoder layer, :func:`~.shapes.assumed_shape`, unless
    ``largest_unit_params`` names the largest one).
    Give ``strategy`` or ``stage`` for one estimate; give neither for stages 0-3 in order.
    ``backward_prefetch``: ``ShardedModule``'s default (``BACKWARD_PRE``) gathers the next
    unit while one computes (ZeRO-3 holds one unit more); False for ``None``/``BACKWARD_POST``.
    ``rank``: whose shard to count (default: the most loaded rank, category by category).
    ``param_persistence_threshold``: as ``ShardedModule``'s (units under it stay whole).
    ``world_size`` is the data-parallel degree; ``tensor_parallel``/``pipeline_parallel``
    split a parameter count first ([Note: counts under tensor and pipeline parallelism]).
    ``hpz_partition_size``: ZeRO++'s secondary partition at stage 3 (``secondary.py``).
    """
    for name, value in (
        ("world_size", world_size),
        ("tensor_parallel", tensor_parallel),
        ("pipeline_parallel", pipeline_parallel),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(
            f"optimizer: expected one of {sorted(OPTIMIZER_STATES)}, got {optimizer!r}"
        )
    if offload not in (None, "cpu", "disk"):
        raise ValueError(f"offload: expected None, 'cpu' or 'disk', got {offload!r}")
    for name, dtype in (("param_dtype", param_dtype), ("compute_dtype", compute_dtype)):
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise TypeError(f"{name}: expected a torch.dtype, got {dtype!r}")
    elem = _Bytes(
        master=_element_size(param_dtype), compute=_element_size(compute_dtype or param_dtype)
    )
    if rank is not None and not 0 <= rank < world_size:
        raise ValueError(f"rank: expected 0 <= rank < {world_size}, got {rank}")
    strategies = _strategies(strategy, stage)
    hpz = check_hpz(hpz_partition_size, world_size)
    threshold = check_threshold(param_persistence_threshold)
    estimates = tuple(
        _estimate_one(
            model_sizes(
                model_or_num_params,
                member,
                world_size,
                auto_wrap_policy,
                largest_unit_params,
                threshold,
                (tensor_parallel, pipeline_parallel),
            ),
            member,
            world_size,
            elem,
            OPTIMIZER_STATES[optimizer],
            offload,
            rank,
            (backward_prefetch, hpz),
        )
        for member in strategies
    )
    return estimates if strategy is None and stage is None else estimates[0]


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


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


def _gathered_numel(layout: FlatLayout, e: _Bytes) -> int:
    """Elements a unit gathers: none when its one shard is the full tensor, uncast, in place."""
    separate = layout.num_shards > 1 or e.compute != e.master or e.device_copy
    return layout.padded_numel if separate else 0


def _chain(sizes: ModelSizes, index: int, e: _Bytes) -> tuple[int, frozenset[int]]:
    """Gathered elements of the largest path of nested units from ``index`` down, its units."""
    unit = sizes.units[index]
    best: tuple[int, frozenset[int]] = (0, frozenset())
    for nested in unit.nested:
        candidate = _chain(sizes, nested, e)
        if candidate[0] > best[0]:
            best = candidate
    return _gathered_numel(unit.layout, e) + best[0], best[1] | {index}


def _zero3_peak(sizes: ModelSizes, prefetch: bool, e: _Bytes) -> tuple[int, int]:
    """(chain, the unit prefetched next to it) in elements."""
    if sizes.chain_numel is not None:  # a parameter count: the next unit is as large
        largest = _gathered_numel(sizes.units[-1].layout, e)
        return largest, largest if prefetch and len(sizes.units) > 1 else 0
    chain, members = _chain(sizes, 0, e)
    others = [_gathered_numel(u.layout, e) for i, u in enumerate(sizes.units) if i not in members]
    return chain, max(others, default=0) if prefetch else 0


def _shard_numels(sizes: ModelSizes, rank: int | None) -> tuple[int, int]:
    """(shard elements, trainable elements in the shard) of ``rank`` (or the largest).

    The largest without a loop over ranks: [Note: the worst rank in O(1) ranks].
    """
    shard = sum(u.layout.shard_numel for u in sizes.units)
    if rank is None:
        return shard, worst_trainable_shard([u.layout for u in sizes.units])
    trainable = sum(
        piece.numel
        for u in sizes.units
        for info, piece in zip(
            u.layout.params, u.layout.pieces(rank % u.layout.num_shards), strict=True
        )
        if info.requires_grad
    )
    return shard, trainable


@dataclass(frozen=True, slots=True)
class _Bytes:
    master: int  # b: bytes per element of the stored (master) parameters
    compute: int  # c: bytes per element of gathered parameters and local gradients
    device_copy: bool = False  # CPUOffload: even a one-shard unit gathers a device copy


def _gathered(
    sizes: ModelSizes, strategy: ShardingStrategy, e: _Bytes, prefetch: bool
) -> tuple[int, str]:
    if all(_gathered_numel(u.layout, e) == 0 for u in sizes.units):
        return 0, "0 (one shard, no cast: the full buffer is the shard)"
    if strategy is ShardingStrategy.FULL_SHARD:
        chain, ahead = _zero3_peak(sizes, prefetch, e)
        formula = f"(chain + next unit) c = ({chain:,} + {ahead:,}) x {e.compute}"
        return (chain + ahead) * e.compute, formula
    padded = sum(_gathered_numel(u.layout, e) for u in sizes.units)
    return padded * e.compute, f"P c = {padded:,} x {e.compute}"


def _gradients(strategy: ShardingStrategy, trainable: int, trainable_shard: int, e: _Bytes):
    if strategy is not ShardingStrategy.NO_SHARD:  # reduced to shards in backward (ZeRO-1 too)
        return trainable_shard * e.master, f"T b / N = {trainable_shard:,} x {e.master}"
    return trainable * e.master, f"T b = {trainable:,} x {e.master}"


def _estimate_one(
    sizes: ModelSizes,
    strategy: ShardingStrategy,
    world_size: int,
    elem: _Bytes,
    num_states: int,
    offload: str | None,
    rank: int | None,
    prefetch_and_hpz: tuple[bool, int | None],
) -> MemoryEstimate:
    prefetch, hpz = prefetch_and_hpz
    n = max(u.layout.num_shards for u in sizes.units)
    trainable = sum(i.numel for u in sizes.units for i in u.layout.params if i.requires_grad)
    shard, trainable_shard = _shard_numels(sizes, rank)
    host_shards = offload == "cpu"  # CPUOffload: even one shard has a device copy
    gathered, gathered_formula = _gathered(
        sizes, strategy, replace(elem, device_copy=host_shards), prefetch
    )
    grads, grads_formula = _gradients(strategy, trainable, trainable_shard, elem)
    per_tensor = trainable_shard  # all of them when n == 1; persistent units whole
    over_n = "" if n == 1 else " / N"
    b = elem.master
    shard_home = {None: Location.DEVICE, "cpu": Location.HOST, "disk": Location.DISK}[offload]
    # ZeRO-1's reduced in backward too; DiskOffload keeps them in files ([Note: gradients on disk])
    grad_home = {None: Location.DEVICE, "cpu": Location.HOST, "disk": Location.DISK}[offload]
    items = (
        MemoryItem("parameters", shard * b, shard_home, f"P b{over_n} = {shard:,} x {b}"),
        MemoryItem("gathered_parameters", gathered, Location.DEVICE, gathered_formula),
        MemoryItem("gradients", grads, grad_home, grads_formula),
        MemoryItem(
            "optimizer_state",
            num_states * per_tensor * b,
            shard_home,
            f"k T b{over_n} = {num_states} x {per_tensor:,} x {b}",
        ),
        MemoryItem(
            "buffers", sizes.buffer_bytes, Location.DEVICE, f"{sizes.buffer_bytes:,} B (replicated)"
        ),
    )
    if secondary := hpz_numel(sizes, strategy, hpz):
        formula = f"P c / G = {secondary:,} x {elem.compute} (G = {hpz})"
        items += (MemoryItem(CATEGORY, secondary * elem.compute, Location.DEVICE, formula),)
    return MemoryEstimate(strategy, world_size, items)


def cheapest_fitting(
    estimates: tuple[MemoryEstimate, ...], budget_bytes: int
) -> MemoryEstimate | None:
    """The lowest stage (least communication) whose device bytes fit ``budget_bytes``."""
    fitting = [e for e in estimates if e.device_bytes <= budget_bytes]
    return min(fitting, key=lambda e: e.stage) if fitting else None


TABLE_ROWS = ("parameters", "gradients", "optimizer_state", None, "gathered_parameters", "buffers")
MODEL_STATE_ROW = "= sharded model state"  # the row for None: the three above, summed


def format_table(estimates: tuple[MemoryEstimate, ...]) -> str:
    """A fixed-width table in GiB: one column per stage; the sharded model state (parameter
    shards, gradients, optimizer state) and the gathered units on separate rows."""
    header = f"{'per rank (GiB)':<22}" + "".join(
        f"{f'stage {e.stage} {e.strategy.name}':>24}" for e in estimates
    )
    lines = [header]
    extra = (CATEGORY,) if any(e.bytes(CATEGORY) for e in estimates) else ()
    for category in TABLE_ROWS + extra:
        if category is None:
            cells = [f"{_gib(e.model_state_bytes):>24}" for e in estimates]
            lines.append(f"{MODEL_STATE_ROW:<22}" + "".join(cells))
            continue
        cells = []
        for estimate in estimates:
            item = next((i for i in estimate.items if i.category == category), None)
            where = (
                ""
                if item is None or item.location is Location.DEVICE
                else f" ({item.location.value})"
            )
            cells.append(f"{_gib(estimate.bytes(category)) + where:>24}")
        lines.append(f"{category:<22}" + "".join(cells))
    lines.append(
        f"{'total on device':<22}" + "".join(f"{_gib(e.device_bytes):>24}" for e in estimates)
    )
    lines.append("")
    lines.append(
        "formulas (b master / c compute bytes per element, N shards, P padded params, "
        "T trainable, k optimizer states):"
    )
    for estimate in estimates:
        lines.append(f"  stage {estimate.stage}:")
        lines.extend(f"    {i.category:<20} {i.formula}" for i in estimate.items)
    return "\n".join(lines)


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:,.3f}"


__all__ = ["MemoryEstimate", "MemoryItem", "Location", "estimate_memory", "cheapest_fitting"]
__all__ += ["format_table", "padded_numel"]
