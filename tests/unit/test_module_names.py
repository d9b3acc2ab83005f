"""One meaning per basename: no two modules of the package share a file name.

Two ``setup.py`` (or a ``door.py`` beside a ``front_door.py``) make every mention of the
name ambiguous: in a traceback, a review, a note that says "see setup.py". Package
markers (``__init__.py``, ``__main__.py``) are the exception. The checker's negative
control is ``test_checker_finds_a_basename_used_twice``.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "shardwrap"
MARKERS = {"__init__.py", "__main__.py"}


def shared_basenames(package: Path) -> dict[str, list[str]]:
    """Basenames used by more than one module under ``package``, with their paths."""
    paths: dict[str, list[str]] = defaultdict(list)
    for path in sorted(package.rglob("*.py")):
        if path.name not in MARKERS:
            paths[path.name].append(path.relative_to(package).as_posix())
    return {name: found for name, found in paths.items() if len(found) > 1}


def test_no_two_modules_share_a_basename() -> None:
    assert shared_basenames(PACKAGE) == {}


def test_checker_finds_a_basename_used_twice(tmp_path: Path) -> None:
    for name in ("a/setup.py", "b/setup.py", "a/__init__.py", "b/__init__.py", "c.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    assert shared_basenames(tmp_path) == {"setup.py": ["a/setup.py", "b/setup.py"]}
