"""Every key the DeepSpeed config parser accepts is acted on, refused, or warned about.

The keys come from the parser itself: every ``Section`` it builds while reading a config
that opens every block is recorded with its accepted (``known``) keys, and every typed
read (``boolean``, ``integer``, ``number``, ``choice``, ``get``) with its default. Each key
is then set, alone, to a value that is neither DeepSpeed's default nor the base config's,
and the parse must show it: the typed config changes, a ``UserWarning`` names the key, an
error names it, or the value is the one ``unused.UNUSED`` declares to be what shardwrap
always does. A second check keeps "the typed config changes" meaningful: every field of
the typed records is read somewhere in ``shardwrap/deepspeed/`` outside the parser's own
construction of it. Negative controls: a key added to an accepted set without handling,
and the warnings switched off, must both be caught.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from torch import nn

import shardwrap
from shardwrap.assemble.root import root_of
from shardwrap.base.warn_once import forget_warned
from shardwrap.deepspeed import config as ds_config
from shardwrap.deepspeed import keys as ds_keys
from shardwrap.deepspeed import optimizer as ds_optimizer
from shardwrap.deepspeed import unused, zero
from shardwrap.deepspeed.sections import Section

PACKAGE = Path(__file__).resolve().parents[2] / "shardwrap" / "deepspeed"

# Base configs that open every block (each optimizer and scheduler type, both precisions,
# stages 0, 2 and 3), so every Section the parser has is built at least once.
_OFFLOAD = {"offload_param": {}, "offload_optimizer": {}}
BASES = [
    {
        "train_batch_size": 8,
        "zero_optimization": {"stage": 3, **_OFFLOAD},
        "fp16": {"enabled": True},
        "optimizer": {"type": "Adam", "params": {}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 10}},
        "pipeline": {},
    },
    {
        "train_batch_size": 8,
        "zero_optimization": {"stage": 2, **_OFFLOAD},
        "bf16": {"enabled": True},
        "fp16": {},
        "optimizer": {"type": "SGD", "params": {}},
        "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 10}},
        "pipeline": {},
    },
    {
        "train_batch_size": 8,
        "zero_optimization": {"stage": 0, **_OFFLOAD},
        "fp16": {},
        "optimizer": {"type": "AdamW", "params": {}},
        "scheduler": {"type": "WarmupLR", "params": {}},
    },
]
# Values tried, in order, for a key read without a type (``Section.get``).
UNTYPED_CANDIDATES: list[Any] = [0.5, [0.5, 0.6], "linear", "/tmp/shardwrap-nvme", 7, True]


@dataclasses.dataclass
class Read:
    """One typed read of a key: the method, its default, its bounds."""

    method: str
    default: Any = None
    minimum: Any = None
    maximum: Any = None
    allowed: tuple = ()


def _record_reads(monkeypatch, base: dict) -> tuple[dict[str, set[str]], dict[str, Read]]:
    """Parse ``base`` and return the accepted keys by section path, and each key's read."""
    accepted: dict[str, set[str]] = {}
    reads: dict[str, Read] = {}
    original_init = Section.__init__

    def init(self, path, raw, *, known, unsupported=None):
        original_init(self, path, raw, known=known, unsupported=unsupported)
        accepted.setdefault(path, set()).update(known)

    def reader(method):
        original = getattr(Section, method)

        def read(self, key, default=None, *args, **kwargs):
            if method == "choice":
                kwargs["allowed"] = args[0] if args else kwargs.get("allowed", ())
            name = self.child_path(key)
            if method != "get" or name not in reads:  # a typed read wins over a peek
                reads[name] = Read(
                    method,
                    default,
                    kwargs.get("minimum"),
                    kwargs.get("maximum"),
                    tuple(kwargs.get("allowed", ())),
                )
            if method == "choice":
                return original(self, key, default, kwargs["allowed"])
            if method == "get":
                return original(self, key, default)
            return original(self, key, default, *args, **{k: v for k, v in kwargs.items()})

        return read

    with monkeypatch.context() as patch:
        patch.setattr(Section, "__init__", init)
        for method in ("boolean", "integer", "number", "choice", "get"):
            patch.setattr(Section, method, reader(method))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ds_config.DeepSpeedConfig.load(copy.deepcopy(base))
    return accepted, reads


def _value_at(config: Mapping, dotted: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def _with(config: dict, dotted: str, value: Any) -> dict:
    out = copy.deepcopy(config)
    node = out
    *parents, last = dotted.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value
    return out


def _candidates(read: Read | None) -> list[Any]:
    """Values for a key, from how the parser reads it (an untyped read: the fixed list)."""
    if read is None or read.method == "get":
        return UNTYPED_CANDIDATES
    if read.method == "boolean":
        return [not read.default, read.default]
    if read.method == "choice":
        return [a for a in read.allowed if a != read.default]
    low = read.minimum if read.minimum is not None else 0
    start = read.default if read.default is not None else low
    values = [start + 1, start + 2, low + 1, low]
    if read.maximum is not None:
        values = [v for v in values if v <= read.maximum]
    return [float(v) + 0.5 for v in values] if read.method == "number" else values


def _parse(config: dict) -> tuple[Any, list[str], Exception | None]:
    forget_warned()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            parsed = ds_config.DeepSpeedConfig.load(config)
        except (TypeError, ValueError) as error:
            return None, [], error
    return parsed, [str(w.message) for w in caught if w.category is UserWarning], None


def _silent_keys(monkeypatch) -> list[str]:
    """The accepted keys that some base config lets a non-default value drop silently."""
    silent = []
    for base in BASES:
        accepted, reads = _record_reads(monkeypatch, base)
        reference, _, error = _parse(base)
        assert error is None, error
        for path, keys in sorted(accepted.items()):
            for key in sorted(keys):
                name = f"{path}.{key}" if path else key
                if isinstance(_value_at(base, name), Mapping) or key in _BLOCKS:
                    continue  # a block: its own keys are checked
                if not _shown(base, reference, name, reads.get(name)):
                    silent.append(f"{name} (base stage {base['zero_optimization']['stage']})")
    return silent


# Keys whose value is a block (read with Section.section or handed to a block's parser).
_BLOCKS = {"zero_optimization", "fp16", "bf16", "bfloat16", "optimizer", "scheduler", "params"}
_BLOCKS |= {"pipeline", "offload_param", "offload_optimizer"}


def _shown(base: dict, reference: Any, name: str, read: Read | None) -> bool:
    """Whether a non-default value of ``name`` is acted on, warned about or refused.

    The first value that parses decides; a key no value parses for must be refused by name.
    """
    current = _value_at(base, name)
    if current is None and read is not None:
        current = read.default  # the key is absent: the parser reads its default
    refused = False
    for value in _candidates(read):
        if value == current:
            continue
        parsed, messages, error = _parse(_with(base, name, value))
        if error is not None:
            refused = name.rsplit(".", 1)[-1] in str(error)
            continue  # malformed for this key, or refused: try the next value
        if name in unused.UNUSED and value == unused.UNUSED[name].matches:
            return True  # asks for what shardwrap always does
        return parsed != reference or any(name in m for m in messages)
    return refused


def test_every_accepted_key_is_acted_on_or_warned(monkeypatch):
    silent = _silent_keys(monkeypatch)
    assert silent == [], "\n".join(silent)


def test_the_parser_accepts_the_keys_this_test_reads():
    # a sanity bound: if the recording broke, the test above would check nothing
    accepted, reads = _record_reads(pytest.MonkeyPatch(), BASES[0])
    assert len(reads) > 40
    for name in ("zero_optimization.overlap_comm", "fp16.auto_cast", "pipeline.pipe_partitioned"):
        assert name in reads, name
    assert "stage3_max_live_parameters" in accepted["zero_optimization"]


def test_negative_control_a_key_accepted_without_handling_is_caught(monkeypatch):
    monkeypatch.setattr(zero, "_ZERO_READ", zero._ZERO_READ | {"fake_tuning_knob"})
    assert any("zero_optimization.fake_tuning_knob" in s for s in _silent_keys(monkeypatch))


def test_negative_control_a_key_whose_warning_is_lost_is_caught(monkeypatch):
    monkeypatch.setattr(zero, "note_unused", lambda *args, **kwargs: None)
    silent = _silent_keys(monkeypatch)
    assert any("zero_optimization.overlap_comm" in s for s in silent)
    assert any("zero_optimization.stage3_max_live_parameters" in s for s in silent)


def test_each_warning_names_the_key_and_comes_once_per_process():
    forget_warned()
    config = _with(BASES[0], "zero_optimization.stage3_max_reuse_distance", 10)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ds_config.DeepSpeedConfig.load(config)
        ds_config.DeepSpeedConfig.load(config)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1, messages
    assert "zero_optimization.stage3_max_reuse_distance" in messages[0]
    assert "not acted on" in messages[0] and "reshard" in messages[0]


def test_logging_keys_warn():
    # read before any Section: the parser's own list of them
    for key in ds_keys.LOGGING_KEYS:
        value = "debug" if key == "log_level" else {"enabled": True}
        if key in ("steps_per_print",):
            value = 10
        if key in ("wall_clock_breakdown", "memory_breakdown", "dump_state"):
            value = True
        _, messages, error = _parse({"train_batch_size": 8, key: value})
        assert error is None and any(key in m for m in messages), key


# ------------------------------------------------- typed fields are read somewhere
RECORDS = [
    ds_config.DeepSpeedConfig,
    ds_config.FP16Config,
    ds_config.BF16Config,
    ds_config.PipelineConfig,
    zero.ZeroConfig,
    zero.OffloadParamConfig,
    zero.OffloadOptimizerConfig,
    ds_optimizer.OptimizerConfig,
    ds_optimizer.SchedulerConfig,
]


def _attributes_read(package: Path) -> set[str]:
    names = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                names.add(node.attr)
    return names


def _unread_fields(records: list[type], read: set[str]) -> list[str]:
    return [
        f"{record.__name__}.{f.name}"
        for record in records
        for f in dataclasses.fields(record)
        if f.name not in read
    ]


def test_every_typed_field_is_read():
    assert _unread_fields(RECORDS, _attributes_read(PACKAGE)) == []


def test_negative_control_an_unread_field_is_caught():
    @dataclasses.dataclass
    class WithDeadField:
        stage: int = 0
        a_field_nothing_reads: int = 0

    unread = _unread_fields([WithDeadField], _attributes_read(PACKAGE))
    assert unread == ["WithDeadField.a_field_nothing_reads"]


@pytest.mark.parametrize(
    ("zero", "precision", "budgets"),
    [
        # elements x bytes: reductions in reduce_dtype, gathers in the compute dtype
        ({"stage": 2, "reduce_bucket_size": 1000, "allgather_bucket_size": 10}, {}, (4000, 40)),
        (
            {"stage": 3, "reduce_bucket_size": 1000, "stage3_prefetch_bucket_size": 10},
            {"bf16": {"enabled": True}},
            (2000, 20),
        ),
        ({"stage": 3}, {}, (None, 0)),  # absent: shardwrap's own defaults
    ],
)
def test_bucket_sizes_become_the_engines_budgets(one_rank, zero, precision, budgets):

    config = {"train_batch_size": 1, "optimizer": {"type": "SGD", "params": {}}}
    engine, *_ = shardwrap.initialize(
        model=nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1)),
        config={**config, "zero_optimization": zero, **precision},
    )
    schedule = root_of(engine.module).runtime.schedule
    assert (schedule.reduce_bucket_bytes, schedule.all_gather_bucket_bytes) == budgets
