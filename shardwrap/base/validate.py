"""Argument checks shared by the options and the entry points; errors name the argument."""

from __future__ import annotations


def check_int(argument: str, value: object, *, minimum: int, meaning: str = "") -> int:
    """``value`` if it is an int (not a bool) of at least ``minimum``.

    ``meaning`` (e.g. ``"0 turns bucketing off"``) is shown with the bound.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{argument}: expected an int, got {value!r}")
    if value < minimum:
        bound = f">= {minimum} ({meaning})" if meaning else f">= {minimum}"
        raise ValueError(f"{argument}: must be {bound}, got {value}")
    return value


def check_bool(argument: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{argument}: expected a bool, got {value!r}")
    return value


def check_bools(record: object, *names: str) -> None:
    """Each of ``record``'s fields ``names`` is a bool (an options record's validation)."""
    for name in names:
        value = getattr(record, name)
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {value!r}")


def unique_keys(where: str, error: type[Exception] = ValueError):
    """A ``json.load(object_pairs_hook=...)`` that refuses a key given twice in one object.

    Python's ``json`` silently keeps the last copy; the error names ``where`` (the file)
    and the key.
    """

    def build(pairs: list[tuple[str, object]]) -> dict:
        data: dict = {}
        for key, value in pairs:
            if key in data:
                raise error(
                    f"{where}: key {key!r} is given twice in one object (JSON keeps "
                    "only the last copy)"
                )
            data[key] = value
        return data

    return build
