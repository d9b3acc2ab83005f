"""Logs each Python interpreter start with the test that caused it (measurement only).

On ``PYTHONPATH`` (with ``SUITE_COST_LOG`` set) every interpreter the suite starts,
grandchildren included, appends one line: pid, parent pid, ``PYTEST_CURRENT_TEST`` (which
children inherit from pytest's environment), command line. Forked processes start no
interpreter and write nothing. A child given an environment without this folder on its
``PYTHONPATH`` (tests/unit/test_cli.py's subprocesses) is not counted.
"""

import os as _os

_log = _os.environ.get("SUITE_COST_LOG")
if _log:
    try:
        with open("/proc/self/cmdline", "rb") as _f:
            _cmd = _f.read().replace(b"\0", b" ").decode(errors="replace")[:200]
        _test = _os.environ.get("PYTEST_CURRENT_TEST", "-")
        _line = f"{_os.getpid()}\t{_os.getppid()}\t{_test}\t{_cmd.replace(chr(9), ' ')}\n"
        _fd = _os.open(_log, _os.O_WRONLY | _os.O_APPEND | _os.O_CREAT, 0o644)
        _os.write(_fd, _line.replace("\r", " ").encode())
        _os.close(_fd)
    except OSError:
        pass
