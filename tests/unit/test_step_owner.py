"""One owner per unit step: only the step runtime gathers or frees a unit.

Every module under ``shardwrap/`` is parsed; a call ``x.unshard(...)`` or ``x.reshard(...)``
anywhere outside runtime/step.py is a second owner of a unit's step (docs/architecture.md).
Negative control (in the suite): the same scan over hooks.py with a ``reshard`` call put
back, as hooks.py had one before the step runtime owned post-forward, reports hooks.py.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "shardwrap"
OWNER = "shardwrap/runtime/step.py"
TRANSITIONS = {"unshard", "reshard"}


def transition_calls(source: str) -> list[tuple[str, int]]:
    """``(method, line)`` of every ``<expr>.unshard(...)``/``<expr>.reshard(...)`` call."""
    return [
        (node.func.attr, node.lineno)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in TRANSITIONS
    ]


def callers(sources: dict[str, str]) -> dict[str, list[tuple[str, int]]]:
    """The modules among ``sources`` (path -> text) that call a transition, with the calls."""
    found = {path: transition_calls(text) for path, text in sources.items()}
    return {path: calls for path, calls in found.items() if calls}


def package_sources() -> dict[str, str]:
    return {
        str(path.relative_to(PACKAGE.parent)): path.read_text()
        for path in sorted(PACKAGE.rglob("*.py"))
    }


def test_only_the_step_runtime_calls_unshard_or_reshard() -> None:
    found = callers(package_sources())
    assert set(found) == {OWNER}, {p: c for p, c in found.items() if p != OWNER}


def test_the_scan_reports_a_reshard_put_back_into_hooks() -> None:
    # The negative control: the post-forward reshard hooks.py used to make itself.
    sources = package_sources()
    sources["shardwrap/hooks.py"] += "\n\ndef _free(unit):\n    unit.handle.reshard(free=True)\n"
    found = callers(sources)
    assert "shardwrap/hooks.py" in found
    assert set(found) != {OWNER}
