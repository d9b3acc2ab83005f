"""What a rank is about to build, described for the wrap-time agreement check.

See [Note: rank agreement] in ``comm/checks.py``: before any collective of a new model,
every rank reduces a digest of these entries, and a difference raises
``RankDisagreementError`` on every rank naming the first rank and unit that differ.
"""

from __future__ import annotations

from torch import nn

from ..comm.checks import Entries, check_agreement
from ..options import MixedPrecision, ShardingStrategy
from .comms import RootComms


def plan_entries(
    root: nn.Module,
    unit_modules: list[nn.Module],
    owned: dict[int, list],
    strategy: ShardingStrategy,
    mixed_precision: MixedPrecision | None,
    full_precision: list[nn.Module],
) -> Entries:
    """One entry per unit (its module, strategy, precision), a closing entry, then one per
    parameter each unit will own: a different unit list shows as the first unit that
    differs, not as a parameter that moved."""
    names = {id(m): n for n, m in root.named_modules(remove_duplicate=False)}
    full_ids = {id(m) for m in full_precision}
    units, params = [], []
    modules = [root, *unit_modules]
    for number, module in enumerate(modules, start=1):
        name = f"unit {names[id(module)] or '(root)'!r}"
        precision = (
            "full precision"
            if id(module) in full_ids
            else f"{mixed_precision or 'no mixed precision'}"
        )
        units.append(
            (
                f"unit #{number}",
                f"{name}: {type(module).__name__}, {strategy.name}, {precision}",
            )
        )
        for record in owned[id(module)]:
            param = record.param
            kind = "trainable" if param.requires_grad else "frozen"
            params.append(
                (name, f"parameter {record.fqn!r} {list(param.shape)} {param.dtype} {kind}")
            )
    return [*units, (f"unit #{len(modules) + 1}", "no more units"), *params]


def check_plan(
    comms: RootComms, strategy: ShardingStrategy, entries: Entries, options: str
) -> None:
    """Raise on every rank unless all ranks plan the same units, parameters and options.

    Over the ranks the model spans: the world for hybrid strategies (their groups tile
    it), else its one group, so that other groups may wrap other models.
    """
    sizes = f"shard group of {comms.shard.size}, replicate group of " + (
        f"{comms.replicate.size}" if comms.replicate is not None else "none"
    )
    everything = [*entries, ("the options", f"{options}; {sizes}")]
    if strategy.is_hybrid:
        span = comms.world
    else:
        span = comms.shard if comms.replicate is None else comms.replicate
    if span.offline:  # no rank to ask ([Note: offline groups] in comm/groups.py)
        return
    check_agreement(span, everything, "what to wrap")
