"""Reading one section of a JSON-like config: known keys, typed values, clear errors.

Every error names the full dotted path of the offending key (``zero_optimization.stage``)
so a user can find it in their file. Unknown keys get the nearest known key as a
suggestion; known keys we deliberately do not implement get the reason.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from typing import Any


class Section:
    """One mapping of a config, read key by key; :meth:`finish` rejects leftovers."""

    def __init__(
        self,
        path: str,
        raw: object,
        *,
        known: set[str],
        unsupported: Mapping[str, tuple[object, str]] | None = None,
    ) -> None:
        """``unsupported`` maps a key to (the value that leaves the feature off, why not).

        Such a key is accepted only with that value; any other value is an error, so a
        feature the user asked for is never silently skipped.
        """
        if not isinstance(raw, Mapping):
            raise TypeError(f"{path or 'config'}: expected a mapping, got {type(raw).__name__}")
        self.path = path
        self.raw = dict(raw)
        self.known = set(known)
        self.unsupported = dict(unsupported or {})
        self._check_keys()

    def _name(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def _check_keys(self) -> None:
        for key, value in self.raw.items():
            if not isinstance(key, str):
                raise TypeError(f"{self.path or 'config'}: keys must be strings, got {key!r}")
            if key in self.unsupported:
                off_value, reason = self.unsupported[key]
                if value != off_value:
                    raise ValueError(f"{self._name(key)}: not supported by shardwrap ({reason})")
                continue
            if key not in self.known:
                raise ValueError(
                    unknown_key_message(
                        self.path or "config", key, self.known | set(self.unsupported)
                    )
                )
            if value == "auto":
                raise ValueError(
                    f"{self._name(key)}: 'auto' must be replaced by a value before the config "
                    "reaches shardwrap (it is filled in by the HF Trainer integration)"
                )

    def has(self, key: str) -> bool:
        return key in self.raw

    def get(self, key: str, default: Any = None) -> Any:
        return self.raw.get(key, default)

    def boolean(self, key: str, default: bool) -> bool:
        value = self.raw.get(key, default)
        if not isinstance(value, bool):
            raise TypeError(f"{self._name(key)}: expected true or false, got {value!r}")
        return value

    def integer(
        self, key: str, default: int | None, *, minimum: int | None = 0, maximum: int | None = None
    ) -> int | None:
        """An integer; ``5e8`` written as a float is accepted when it is integral."""
        value = self.raw.get(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{self._name(key)}: expected an integer, got {value!r}")
        if isinstance(value, float):
            if not math.isfinite(value) or not value.is_integer():
                raise ValueError(f"{self._name(key)}: expected an integer, got {value!r}")
            value = int(value)
        if minimum is not None and value < minimum:
            raise ValueError(f"{self._name(key)}: must be >= {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise ValueError(
                f"{self._name(key)}: must be in {minimum or 0}..{maximum}, got {value}"
            )
        return value

    def number(self, key: str, default: float | None, *, minimum: float | None = None) -> float:
        value = self.raw.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{self._name(key)}: expected a number, got {value!r}")
        if not math.isfinite(value):
            raise ValueError(f"{self._name(key)}: must be finite, got {value!r}")
        if minimum is not None and value < minimum:
            raise ValueError(f"{self._name(key)}: must be >= {minimum}, got {value}")
        return float(value)

    def choice(self, key: str, default: str, allowed: tuple[str, ...]) -> str:
        value = self.raw.get(key, default)
        if not isinstance(value, str) or value.lower() not in allowed:
            raise ValueError(f"{self._name(key)}: expected one of {list(allowed)}, got {value!r}")
        return value.lower()

    def section(self, key: str) -> dict:
        """A nested mapping (empty when absent)."""
        value = self.raw.get(key, {})
        if not isinstance(value, Mapping):
            raise TypeError(f"{self._name(key)}: expected a mapping, got {type(value).__name__}")
        return dict(value)

    def child_path(self, key: str) -> str:
        return self._name(key)


def unknown_key_message(full_name: str, key: str, known: set[str]) -> str:
    """``"a.b: unknown key 'x'; did you mean 'y'?"`` (or the list of known keys)."""
    nearest = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    if nearest:
        return f"{full_name}: unknown key {key!r}; did you mean {nearest[0]!r}?"
    return f"{full_name}: unknown key {key!r}; known keys: {', '.join(sorted(known))}"
