"""One ``UserWarning`` per process and key, for accepted arguments shardwrap does not act on.

[Note: accepted but not acted on]
Every argument and DeepSpeed config key shardwrap accepts is either acted on or named in
a warning that says what shardwrap does instead. A script sets its options once, but may
build many models (a sweep, a test suite, a pipeline's stages): one warning per key and
process says it without drowning the log. A key a config does not give, or an argument
left out, asks for nothing, so it never warns; one that is given warns when its value
asks for something shardwrap does not do, even when that value is the default (a
DeepSpeed default written out is still asked for: [Note: DeepSpeed keys not acted on] in
``deepspeed/unused.py``).
"""

from __future__ import annotations

import os
import sys
import warnings

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_warned: set[str] = set()  # the keys warned about in this process


def warn_once(key: str, instead: str) -> bool:
    """Warn ``"<key>: <instead>"`` unless ``key`` was warned about already; True if it warned."""
    if key in _warned:
        return False
    _warned.add(key)
    warnings.warn(f"{key}: {instead}", UserWarning, stacklevel=first_caller_outside_shardwrap())
    return True


def forget_warned() -> None:
    """Let every key warn again (for tests that check a warning is given)."""
    _warned.clear()


def first_caller_outside_shardwrap() -> int:
    """The ``stacklevel`` that points a warning at the user's line, not shardwrap's."""
    frame, level = sys._getframe(1), 1  # the function that warns
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level
