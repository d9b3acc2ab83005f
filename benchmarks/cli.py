"""Command-line helpers the benchmark scripts share."""

from __future__ import annotations

import argparse
from collections.abc import Collection


def comma_list(
    parser: argparse.ArgumentParser, flag: str, text: str, allowed: Collection[str], what: str
) -> list[str]:
    """The names in ``text`` (comma-separated, empty items dropped); an unknown one ends
    the script through ``parser.error``, naming the flag and the allowed names."""
    names = [name for name in text.split(",") if name]
    for name in names:
        if name not in allowed:
            parser.error(f"{flag}: unknown {what} {name!r}; choose from {list(allowed)}")
    return names
