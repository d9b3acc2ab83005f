"""The package's layers: a module imports only from its own folder or a lower layer.

Every module under ``shardwrap/`` is parsed with ``ast``; every import counts (module level,
inside functions, under ``TYPE_CHECKING``; relative and absolute). A module's group is its
folder, or its own name at the top level; a few top-level modules are the design card's
paths of a folder's concept and belong to that folder's group. Imports between different
groups must go strictly down, and no set of modules may import each other in a cycle. The
planner's import closure must not reach ``torch.distributed``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "shardwrap"

# Folder (or top-level module) -> layer; a module may import from its own group or a lower
# layer. See README.md, "Layout of the code".
LAYERS = {
    "base": 0,
    "options": 1,
    "data": 1,
    "layout": 2,
    "comm": 3,
    "planner": 3,
    "core": 4,
    "runtime": 5,
    "offload": 5,
    "assemble": 6,
    "ckpt": 7,
    "features": 7,
    "wrap": 8,
    "fsdp2": 8,
    "profile": 9,
    "deepspeed": 9,
    "install": 9,
    "__init__": 10,
    "__main__": 10,
}
# Top-level modules that hold a folder's code at the design card's path.
TOP_LEVEL_GROUPS = {
    "policies": "layout",
    "flat_param": "core",
    "hooks": "runtime",
    "checkpoint": "ckpt",
    "fsdp1_options": "options",
}


def module_name(path: Path, package: Path) -> str:
    parts = list(path.relative_to(package).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join([package.name, *parts])


def imported_modules(path: Path, package: Path, known: set[str]) -> set[str]:
    """The package's modules that ``path`` imports, anywhere in its body."""
    name = module_name(path, package)
    is_package = path.name == "__init__.py"
    here = name.split(".") if is_package else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level + 1]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            # ``from a import b``: the module a.b when there is one, else a itself.
            candidates = [
                f"{target}.{alias.name}" if f"{target}.{alias.name}" in known else target
                for alias in node.names
            ]
        else:
            continue
        for candidate in candidates:
            # "a.b.c" imports module a.b.c if it exists, else the closest enclosing module.
            parts = candidate.split(".")
            while parts and ".".join(parts) not in known:
                parts.pop()
            if parts and ".".join(parts) != name:
                found.add(".".join(parts))
    return found


def import_graph(package: Path) -> dict[str, set[str]]:
    paths = sorted(package.rglob("*.py"))
    known = {module_name(p, package) for p in paths}
    return {module_name(p, package): imported_modules(p, package, known) for p in paths}


def group_of(module: str) -> str:
    parts = module.split(".")[1:]
    if not parts:
        return "__init__"
    top = parts[0]
    return TOP_LEVEL_GROUPS.get(top, top)


def layer_violations(graph: dict[str, set[str]], layers: dict[str, int]) -> list[str]:
    problems = []
    for module, targets in sorted(graph.items()):
        group = group_of(module)
        if group not in layers:
            problems.append(f"{module}: its group {group!r} has no layer")
            continue
        for target in sorted(targets):
            other = group_of(target)
            if other == group:
                continue
            if other not in layers or layers[other] >= layers[group]:
                problems.append(
                    f"{module} (layer {layers[group]}) imports {target} (layer {layers.get(other)})"
                )
    return problems


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles: strongly connected components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def closure(graph: dict[str, set[str]], roots: list[str]) -> set[str]:
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(graph.get(module, ()))
    return seen


def imports_torch_distributed(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        if any(n == "torch.distributed" or n.startswith("torch.distributed.") for n in names):
            return True
    return False


def path_of(module: str, package: Path) -> Path:
    parts = module.split(".")[1:]
    candidate = package.joinpath(*parts).with_suffix(".py")
    return candidate if candidate.exists() else package.joinpath(*parts, "__init__.py")


# ------------------------------------------------------------------ the package
def test_no_import_goes_up_a_layer() -> None:
    assert layer_violations(import_graph(PACKAGE), LAYERS) == []


def test_no_import_cycles() -> None:
    assert cycles(import_graph(PACKAGE)) == []


def test_every_folder_has_a_layer() -> None:
    groups = {group_of(m) for m in import_graph(PACKAGE)}
    assert groups <= set(LAYERS), groups - set(LAYERS)


def test_planner_closure_does_not_touch_torch_distributed() -> None:
    graph = import_graph(PACKAGE)
    roots = [m for m in graph if group_of(m) == "planner"]
    assert roots
    reached = closure(graph, roots)
    assert {group_of(m) for m in reached} <= {"planner", "layout", "base", "options"}
    touching = [m for m in reached if imports_torch_distributed(path_of(m, PACKAGE))]
    assert touching == []


# ----------------------------------------------------- the checker can fail
def _write(root: Path, files: dict[str, str]) -> Path:
    package = root / "pkg"
    for name, text in files.items():
        path = package / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for folder in {p.parent for p in package.rglob("*.py")}:
        (folder / "__init__.py").touch()
    return package


def test_checker_finds_an_upward_import_in_a_function(tmp_path: Path) -> None:
    package = _write(
        tmp_path,
        {
            "base/low.py": "def f():\n    from ..core import high\n",
            "core/high.py": "from ..base import low\n",
        },
    )
    graph = import_graph(package)
    assert graph["pkg.base.low"] == {"pkg.core.high"}
    problems = layer_violations(graph, {"base": 0, "core": 3})
    assert len(problems) == 1 and problems[0].startswith("pkg.base.low (layer 0)")
    assert cycles(graph) == [["pkg.base.low", "pkg.core.high"]]


def test_checker_finds_a_type_checking_cycle_inside_a_folder(tmp_path: Path) -> None:
    package = _write(
        tmp_path,
        {
            "core/a.py": "import typing\nif typing.TYPE_CHECKING:\n    from .b import B\n",
            "core/b.py": "import pkg.core.a\n",
        },
    )
    graph = import_graph(package)
    assert layer_violations(graph, {"core": 3}) == []  # one folder: no layer problem
    assert cycles(graph) == [["pkg.core.a", "pkg.core.b"]]


def test_checker_sees_same_layer_imports_between_folders(tmp_path: Path) -> None:
    package = _write(tmp_path, {"comm/x.py": "from ..planner import y\n", "planner/y.py": ""})
    problems = layer_violations(import_graph(package), {"comm": 2, "planner": 2})
    assert problems == ["pkg.comm.x (layer 2) imports pkg.planner.y (layer 2)"]


@pytest.mark.parametrize(
    "text", ["import torch.distributed as dist\n", "from torch.distributed import ReduceOp\n"]
)
def test_checker_sees_torch_distributed(tmp_path: Path, text: str) -> None:
    path = tmp_path / "m.py"
    path.write_text(text)
    assert imports_torch_distributed(path)
