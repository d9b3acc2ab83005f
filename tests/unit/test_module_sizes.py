"""Modules and functions stay small enough to read, and the exceptions are written down.

A module past ``SOFT_MODULE_LINES`` lines, or a function whose body (its docstring aside)
is past ``SOFT_FUNCTION_LINES``, needs an allowance in ``size_allowances.toml``: the
file (and function, by qualified name), its current size, and why it stays. The caps
ratchet: an allowance records the exact size, so growing past it fails (split along a
named concept, or raise it with a reason) and shrinking fails too (tighten it, or drop it
under the cap). Past ``HARD_MODULE_LINES`` / ``HARD_FUNCTION_LINES`` no allowance is
accepted (STYLE.md: the code is telling you to split it).

The checker's negative controls are the ``test_checker_*`` tests below: a temporary
package past each cap without an allowance, with a stale one, with one outgrown.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "shardwrap"
ALLOWANCES = Path(__file__).with_name("size_allowances.toml")
SOFT_MODULE_LINES = 350
SOFT_FUNCTION_LINES = 40
HARD_MODULE_LINES = 600
HARD_FUNCTION_LINES = 60
MIN_REASON_CHARS = 30  # a sentence, not "big" or "TODO"


@dataclass(frozen=True)
class Allowance:
    """One recorded exception: ``name`` is None for the module itself."""

    path: str
    name: str | None
    lines: int
    reason: str

    @property
    def key(self) -> tuple[str, str | None]:
        return (self.path, self.name)

    def describe(self) -> str:
        return self.path if self.name is None else f"{self.path}: {self.name}()"


def load_allowances(path: Path) -> dict[tuple[str, str | None], Allowance]:
    """The allowances in ``path``; ``ValueError`` for a malformed or repeated entry."""
    raw = tomllib.loads(path.read_text())
    unknown = set(raw) - {"module", "function"}
    if unknown:
        raise ValueError(f"{path.name}: unknown tables {sorted(unknown)}")
    found: dict[tuple[str, str | None], Allowance] = {}
    for table, keys in (("module", {"path", "lines", "reason"}), ("function", None)):
        for entry in raw.get(table, []):
            wanted = keys or {"path", "name", "lines", "reason"}
            if set(entry) != wanted:
                raise ValueError(f"{path.name}: [[{table}]] {entry}: expected keys {wanted}")
            allowance = Allowance(entry["path"], entry.get("name"), entry["lines"], entry["reason"])
            if not isinstance(allowance.lines, int) or allowance.lines < 1:
                raise ValueError(f"{path.name}: {allowance.describe()}: lines must be an int")
            if len(" ".join(allowance.reason.split())) < MIN_REASON_CHARS:
                raise ValueError(f"{path.name}: {allowance.describe()}: give the reason")
            if allowance.key in found:
                raise ValueError(f"{path.name}: {allowance.describe()} is listed twice")
            found[allowance.key] = allowance
    return found


def _body_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    if not body:
        return 0
    return body[-1].end_lineno - body[0].lineno + 1


def function_sizes(source: str) -> dict[str, int]:
    """Body lines of every function, by qualified name (``Class.method``, ``outer.inner``);
    of two with one name (a property's getter and setter) the longer."""
    sizes: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    sizes[name] = max(sizes.get(name, 0), _body_lines(child))
                visit(child, f"{name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return sizes


def measured_sizes(package: Path, root: Path) -> dict[tuple[str, str | None], int]:
    """Lines of every module (name None) and body lines of every function under ``package``,
    keyed by path relative to ``root``."""
    sizes: dict[tuple[str, str | None], int] = {}
    for path in sorted(package.rglob("*.py")):
        source = path.read_text()
        name = path.relative_to(root).as_posix()
        sizes[(name, None)] = len(source.splitlines())
        for function, lines in function_sizes(source).items():
            sizes[(name, function)] = lines
    return sizes


def size_problems(
    sizes: dict[tuple[str, str | None], int], allowances: dict[tuple[str, str | None], Allowance]
) -> list[str]:
    """Every module or function past its cap without a matching allowance, and every
    allowance that no longer matches (outgrown, stale, or for nothing)."""
    problems = []
    for key, lines in sorted(sizes.items(), key=lambda kv: (kv[0][0], kv[0][1] or "")):
        soft, hard = (
            (SOFT_MODULE_LINES, HARD_MODULE_LINES)
            if key[1] is None
            else (SOFT_FUNCTION_LINES, HARD_FUNCTION_LINES)
        )
        what = key[0] if key[1] is None else f"{key[0]}: {key[1]}()"
        allowance = allowances.get(key)
        if lines > hard:
            problems.append(f"{what}: {lines} lines, past {hard}: split it (no allowance helps)")
        elif lines > soft and allowance is None:
            problems.append(
                f"{what}: {lines} lines, past {soft}: split it along a named concept, or "
                "record an allowance with its reason"
            )
        elif allowance is not None and lines > allowance.lines:
            problems.append(
                f"{what}: {lines} lines, past its allowance of {allowance.lines}: split it, "
                "or raise the allowance with a reason"
            )
    for key, allowance in sorted(allowances.items(), key=lambda kv: kv[1].describe()):
        lines = sizes.get(key)
        if lines is None:
            problems.append(f"{allowance.describe()}: allowed, but there is no such code")
        elif lines < allowance.lines:
            cap = SOFT_MODULE_LINES if key[1] is None else SOFT_FUNCTION_LINES
            action = "remove the allowance" if lines <= cap else f"tighten it to {lines}"
            problems.append(
                f"{allowance.describe()}: stale allowance of {allowance.lines}, now {lines} "
                f"lines: {action}"
            )
    return problems


# ------------------------------------------------------------------ the package
def test_no_module_or_function_is_past_its_cap_or_allowance() -> None:
    problems = size_problems(measured_sizes(PACKAGE, ROOT), load_allowances(ALLOWANCES))
    assert not problems, "\n".join(problems)


# ----------------------------------------------------- the checker can fail
def _package(tmp_path: Path, module_lines: int, body_lines: int) -> Path:
    package = tmp_path / "pkg"
    package.mkdir(parents=True)
    body = "\n".join(f"    x{i} = {i}" for i in range(body_lines))
    function = f'def f():\n    """doc"""\n{body}\n'
    filler = "\n" * (module_lines - len(function.splitlines()))
    (package / "m.py").write_text(function + filler)
    return package


def _allowances(tmp_path: Path, text: str) -> dict[tuple[str, str | None], Allowance]:
    path = tmp_path / "allowances.toml"
    path.write_text(text)
    return load_allowances(path)


REASON = 'reason = "a reason long enough to say why it stays as it is"'


def test_checker_finds_code_past_the_caps_without_an_allowance(tmp_path: Path) -> None:
    package = _package(tmp_path, SOFT_MODULE_LINES + 1, SOFT_FUNCTION_LINES + 1)
    problems = size_problems(measured_sizes(package, tmp_path), {})
    assert len(problems) == 2
    assert problems[0].startswith(f"pkg/m.py: {SOFT_MODULE_LINES + 1} lines, past")
    assert problems[1].startswith(f"pkg/m.py: f(): {SOFT_FUNCTION_LINES + 1} lines, past")
    at_the_caps = _package(tmp_path / "ok", SOFT_MODULE_LINES, SOFT_FUNCTION_LINES)
    assert size_problems(measured_sizes(at_the_caps, tmp_path / "ok"), {}) == []


def test_checker_accepts_an_exact_allowance_and_refuses_an_outgrown_one(tmp_path: Path) -> None:
    package = _package(tmp_path, SOFT_MODULE_LINES + 5, SOFT_FUNCTION_LINES + 2)
    sizes = measured_sizes(package, tmp_path)
    exact = _allowances(
        tmp_path,
        f'[[module]]\npath = "pkg/m.py"\nlines = {SOFT_MODULE_LINES + 5}\n{REASON}\n'
        f'[[function]]\npath = "pkg/m.py"\nname = "f"\nlines = {SOFT_FUNCTION_LINES + 2}\n'
        f"{REASON}\n",
    )
    assert size_problems(sizes, exact) == []
    outgrown = _allowances(
        tmp_path, f'[[module]]\npath = "pkg/m.py"\nlines = {SOFT_MODULE_LINES + 4}\n{REASON}\n'
    )
    problems = size_problems(sizes, outgrown)
    assert any("past its allowance of" in p for p in problems), problems


def test_checker_refuses_a_stale_allowance(tmp_path: Path) -> None:
    package = _package(tmp_path, SOFT_MODULE_LINES + 5, 3)
    sizes = measured_sizes(package, tmp_path)
    shrunk = _allowances(
        tmp_path,
        f'[[module]]\npath = "pkg/m.py"\nlines = {SOFT_MODULE_LINES + 9}\n{REASON}\n'
        f'[[function]]\npath = "pkg/m.py"\nname = "f"\nlines = 45\n{REASON}\n'
        f'[[function]]\npath = "pkg/gone.py"\nname = "g"\nlines = 45\n{REASON}\n',
    )
    problems = size_problems(sizes, shrunk)
    assert problems == [
        "pkg/gone.py: g(): allowed, but there is no such code",
        f"pkg/m.py: stale allowance of {SOFT_MODULE_LINES + 9}, now {SOFT_MODULE_LINES + 5} "
        f"lines: tighten it to {SOFT_MODULE_LINES + 5}",
        "pkg/m.py: f(): stale allowance of 45, now 3 lines: remove the allowance",
    ]


def test_checker_refuses_code_past_the_hard_caps_even_with_an_allowance(tmp_path: Path) -> None:
    package = _package(tmp_path, HARD_MODULE_LINES + 1, 3)
    allowed = _allowances(
        tmp_path, f'[[module]]\npath = "pkg/m.py"\nlines = {HARD_MODULE_LINES + 1}\n{REASON}\n'
    )
    problems = size_problems(measured_sizes(package, tmp_path), allowed)
    assert problems == [
        f"pkg/m.py: {HARD_MODULE_LINES + 1} lines, past 600: split it (no allowance helps)"
    ]


@pytest.mark.parametrize(
    "text",
    [
        '[[module]]\npath = "pkg/m.py"\nlines = 400\nreason = "big"\n',
        '[[module]]\npath = "pkg/m.py"\nlines = 400\n',
        f'[[function]]\npath = "pkg/m.py"\nlines = 45\n{REASON}\n',
        f'[[module]]\npath = "a.py"\nlines = 400\n{REASON}\n[[module]]\npath = "a.py"\n'
        f"lines = 401\n{REASON}\n",
    ],
)
def test_an_allowance_needs_its_size_and_reason(tmp_path: Path, text: str) -> None:
    with pytest.raises(ValueError):
        _allowances(tmp_path, text)


def test_function_sizes_are_keyed_by_qualified_name() -> None:
    source = (
        "class C:\n    def m(self):\n        def inner():\n            return 1\n        return 2\n"
    )
    assert function_sizes(source) == {"C.m": 3, "C.m.inner": 1}
