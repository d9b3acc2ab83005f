"""Byte sizes as users write them: ``"80GB"``, ``"500MiB"``, ``"1e9"``."""

from __future__ import annotations

import re

UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SIZE = re.compile(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*")


def read_size(text: str) -> int | None:
    """Bytes in ``text`` (units case-insensitive; decimal and binary; plain = bytes), or
    ``None`` when it is not a size. Callers raise their own error, naming their argument."""
    match = _SIZE.fullmatch(text)
    if match is None or match.group(2).upper() not in UNITS:
        return None
    try:
        number = float(match.group(1))
    except ValueError:
        return None
    return int(number * UNITS[match.group(2).upper()])
