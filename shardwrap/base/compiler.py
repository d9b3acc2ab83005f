"""Keeping shardwrap's bookkeeping out of what ``torch.compile`` traces.

[Note: hooks outside the compiled graph]
``module.compile()`` compiles the module's whole call, its forward hooks included, and
``torch.compile(model)`` traces everything a forward calls. A unit's hooks gather and
free parameters, issue collectives, time them for the ledger, check rank agreement and
move the unit through its states: Python side effects that Dynamo either cannot trace
(``time.perf_counter``) or would bake into a graph that then runs them once. So every
entry point shardwrap installs into a forward (the units' forward hooks, the root's start
of forward) runs eagerly: Dynamo calls it as an opaque function and resumes tracing after
it. A block compiled with ``fullgraph=True`` still has no graph break, since its hooks
run around the traced forward, not inside it; a whole compiled model breaks its graph at
each unit boundary, as torch's FSDP2 does without compiled autograd. The computation
between the hooks (the module's forward on the gathered parameters) is what the
compiler sees.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

_F = TypeVar("_F", bound=Callable)


def run_eagerly(fn: _F) -> _F:
    """``fn``, which a compiled caller runs as an opaque eager call, never traced.

    Call at wrap time, not at import: it imports ``torch._dynamo`` (seconds), which a
    training script imports anyway when it builds an optimizer.
    """
    return torch.compiler.disable(fn, recursive=True)  # type: ignore[return-value]
