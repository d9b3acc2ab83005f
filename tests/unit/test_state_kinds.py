"""Checkpoint records are typed: one enum of state kinds, one key function, one table.

[Note: state kinds] in shardwrap/ckpt/piece_records.py. Adding a state kind is one
``StateKind`` member plus its save function and its load class in ``ckpt/kinds.py``'s
table; these tests keep it so: the kinds' names on disk are written in one module, the
piece key is built in one function, every kind is in the table, and the run state goes
through the table like the rest (replaced there, no run file is written). Each scanner
is shown once, here, to find what it looks for (its negative control).
"""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path

import pytest
import torch

from shardwrap import ShardedModule, load_checkpoint, save_checkpoint
from shardwrap.ckpt import kinds
from shardwrap.ckpt.entries import CheckpointError, FileEntry
from shardwrap.ckpt.piece_records import (
    KindLoad,
    PieceRecord,
    RankReport,
    Saved,
    SentFragment,
    StateKind,
    piece_key,
)
from tests import models

PACKAGE = Path(__file__).resolve().parents[2] / "shardwrap"
KIND_NAMES = {kind.value for kind in StateKind}
ENUM_MODULE = PACKAGE / "ckpt" / "piece_records.py"


def kind_literals(source: str) -> list[str]:
    """String constants (f-string parts included) that are, or start a key with, a kind's
    name on disk: ``"param"``, ``"optim/"``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            head = node.value.split("/", 1)[0]
            if head in KIND_NAMES and (node.value == head or node.value.startswith(head + "/")):
                found.append(node.value)
    return found


def key_builders(source: str) -> list[int]:
    """Lines of f-strings that put a kind before a ``/`` (``f"{kind.value}/{name}"``)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.JoinedStr):
            parts = node.values
            for first, second in zip(parts, parts[1:], strict=False):
                names = {n.attr for n in ast.walk(first) if isinstance(n, ast.Attribute)}
                names |= {n.id for n in ast.walk(first) if isinstance(n, ast.Name)}
                slash = isinstance(second, ast.Constant) and str(second.value).startswith("/")
                if isinstance(first, ast.FormattedValue) and slash and names & {"kind", "value"}:
                    lines.append(node.lineno)
    return lines


def _sources():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path, path.read_text(encoding="utf-8")


def test_the_scanners_find_what_they_look_for():
    assert kind_literals('add("param", x)\nkey = f"optim/{n}"') == ["param", "optim/"]
    assert kind_literals('x = "parameters"; y = "params"') == []
    assert key_builders('k = f"{kind}/{name}"\nj = f"{x.value}/{n}"\nm = f"{n}/{s}"') == [1, 2]


def test_kind_names_are_written_only_in_the_enum_module():
    found = {
        str(path.relative_to(PACKAGE)): literals
        for path, source in _sources()
        if path != ENUM_MODULE and (literals := kind_literals(source))
    }
    assert found == {}


def test_the_piece_key_is_built_in_one_function():
    found = {
        str(p.relative_to(PACKAGE)): lines for p, s in _sources() if (lines := key_builders(s))
    }
    assert set(found) == {"ckpt/piece_records.py"}, found
    tree = ast.parse(ENUM_MODULE.read_text(encoding="utf-8"))
    function = next(
        n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "piece_key"
    )
    assert all(
        function.lineno <= line <= function.end_lineno for line in found["ckpt/piece_records.py"]
    )
    assert piece_key(StateKind.OPTIM, "w", "exp_avg", "@4") == "optim/w/exp_avg@4"
    assert PieceRecord(StateKind.BUFFER, "b", None, 0, 1, "float32").key == "buffer/b"


def test_every_state_kind_has_a_save_and_a_load():
    assert set(kinds.KINDS) == set(StateKind)
    for kind, io in kinds.KINDS.items():
        assert callable(io.save) and issubclass(io.load, KindLoad), kind


def test_records_and_reports_round_trip_through_json():
    record = PieceRecord(StateKind.OPTIM, "w", "exp_avg", 4, 9, "bfloat16", 5, -1, "@3")
    entry = FileEntry(10, "ab" * 32, 8, ["cd" * 32])
    report = RankReport(None, "f.safetensors", entry, (record,), SentFragment("d", None))
    raw = json.loads(json.dumps(report.to_json()))  # what crosses the gather
    assert RankReport.from_json(3, raw) == report
    assert RankReport.from_json(3, {"error": "OSError: full"}) == RankReport("OSError: full")


@pytest.mark.parametrize(
    "damage",
    [
        lambda raw: raw["records"][0].__setitem__(0, "weights"),  # no such kind
        lambda raw: raw["records"][0].__setitem__(3, "4"),  # a bound that is text
        lambda raw: raw["records"][0].pop(),  # a field short
        lambda raw: raw.pop("fragment"),
    ],
)
def test_a_malformed_report_is_refused_naming_its_rank(damage):
    record = PieceRecord(StateKind.PARAM, "w", None, 0, 4, "float32")
    raw = RankReport(None, None, None, (record,), SentFragment("d", None)).to_json()
    damage(raw)
    with pytest.raises(CheckpointError, match="rank 5: its save report is malformed"):
        RankReport.from_json(5, raw)


def test_the_run_state_goes_through_the_kinds_table(one_rank, tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = ShardedModule(models.MLP())
    save_checkpoint(tmp_path / "with", model)
    monkeypatch.setitem(kinds.KINDS, StateKind.RUN, kinds.KindIO(lambda ctx: Saved(), KindLoad))
    save_checkpoint(tmp_path / "without", model)
    runs = {
        n: [f for f in os.listdir(tmp_path / n) if f.endswith(".run.json")]
        for n in ("with", "without")
    }
    assert len(runs["with"]) == 1 and runs["without"] == []
    index = json.loads((tmp_path / "without" / "index.json").read_text())
    assert "run_state" not in index
    load_checkpoint(tmp_path / "with", model)  # the table's own load reads the run file
