"""Modules and functions stay small enough to read (issue #18's bounds).

A module has at most ``MAX_MODULE_LINES`` lines; a function's body, its docstring aside,
at most ``MAX_FUNCTION_LINES``. Past them the code wants splitting.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "shardwrap"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 50


def _body_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    if not body:
        return 0
    return body[-1].end_lineno - body[0].lineno + 1


def long_functions(source: str) -> list[tuple[str, int]]:
    tree = ast.parse(source)
    return [
        (node.name, _body_lines(node))
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and _body_lines(node) > MAX_FUNCTION_LINES
    ]


def test_the_checker_finds_a_long_function() -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES + 1))
    assert long_functions(f'def f():\n    """doc"""\n{body}\n') == [("f", MAX_FUNCTION_LINES + 1)]
    short = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    assert long_functions(f'def f():\n    """doc"""\n{short}\n') == []


def test_no_module_or_function_is_too_long() -> None:
    too_long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text()
        name = path.relative_to(PACKAGE.parent)
        if len(source.splitlines()) > MAX_MODULE_LINES:
            too_long.append(f"{name}: {len(source.splitlines())} lines")
        too_long += [f"{name}: {f}() body {n} lines" for f, n in long_functions(source)]
    assert not too_long, "\n".join(too_long)
