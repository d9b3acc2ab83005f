"""Offline memory estimate: imports only layout/ and base/ (no process group).

The planner's public functions, as docs/planner.md imports them from ``shardwrap.planner``.
"""

from .estimate import (
    Location,
    MemoryEstimate,
    MemoryItem,
    cheapest_fitting,
    estimate_memory,
    format_table,
)

__all__ = [
    "Location",
    "MemoryEstimate",
    "MemoryItem",
    "cheapest_fitting",
    "estimate_memory",
    "format_table",
]
