"""One docstring for a feature function and the door method that calls it with the root."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

_M = TypeVar("_M", bound=Callable[..., Any])


def doc_from(function: Callable[..., Any]) -> Callable[[_M], _M]:
    """Decorate a method with ``function``'s docstring (the method passes its arguments on)."""

    def document(method: _M) -> _M:
        method.__doc__ = function.__doc__
        return method

    return document
