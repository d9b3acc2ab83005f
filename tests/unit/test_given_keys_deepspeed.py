"""A DeepSpeed key shardwrap does not act on warns when the config gives it, even at
DeepSpeed's default; absent, it says nothing ([Note: DeepSpeed keys not acted on]).

A default written out is still asked for: ``overlap_comm: false`` at stages 1 and 2
(DeepSpeed's default there) asks for no overlap, ``fp16.auto_cast: false`` for inputs left
uncast. Each ``unused.UNUSED`` key is given alone, at the default the parser reads for it,
in every base config of ``test_silent_keys_deepspeed`` that reads it, and must be warned
about or acted on unless that default is its ``matches``. Negative controls: the old rule
(silent at DeepSpeed's default) and a rule that ignores absence are both caught.
"""

from __future__ import annotations

import warnings
from typing import Any

from shardwrap.deepspeed import config as ds_config
from shardwrap.deepspeed import optimizer as ds_optimizer
from shardwrap.deepspeed import unused, zero
from shardwrap.deepspeed.sections import Section
from tests.unit.test_silent_keys_deepspeed import (
    BASES,
    Read,
    _parse,
    _record_reads,
    _value_at,
    _with,
)

NOTE_UNUSED_USERS = (zero, ds_config, ds_optimizer)  # the modules that call note_unused
# The keys whose DeepSpeed default is their ``matches`` at every stage (overlap_comm's is
# only at stage 3): given at that default, they are acted on and say nothing.
DEFAULT_IS_WHAT_SHARDWRAP_DOES = {
    f"zero_optimization.{key}"
    for key in (
        "contiguous_gradients",
        "reduce_scatter",
        "allgather_partitions",
        "ignore_unused_parameters",
        "round_robin_gradients",
        "stage3_gather_16bit_weights_on_model_save",
        "offload_param.nvme_path",
        "offload_optimizer.nvme_path",
    )
}


def _given_defaults_dropped(monkeypatch, rule=None) -> tuple[list[str], set[str]]:
    """Each ``unused.UNUSED`` key, given alone at DeepSpeed's default where that is not its
    ``matches``, in every base config that reads it: the ones neither warned about nor acted
    on (the typed config unchanged), and the names checked.

    ``rule(reads)``, when given, replaces ``note_unused`` for a base (a negative control).
    """
    dropped, checked = [], set()
    for base in BASES:
        _, reads = _record_reads(monkeypatch, base)
        with monkeypatch.context() as patch:
            for module in NOTE_UNUSED_USERS if rule is not None else ():
                patch.setattr(module, "note_unused", rule(reads))
            reference, _, error = _parse(base)
            assert error is None, error
            for name, spec in sorted(unused.UNUSED.items()):
                read = reads.get(name)
                if read is None or read.default == spec.matches:
                    continue  # not read under this base, or the default is what shardwrap does
                assert _value_at(base, name) is None, name
                parsed, messages, error = _parse(_with(base, name, read.default))
                assert error is None, (name, error)
                checked.add(name)
                if parsed == reference and not any(name in m for m in messages):
                    stage = base["zero_optimization"]["stage"]
                    dropped.append(f"{name} = {read.default!r} (base stage {stage})")
    return dropped, checked


def test_deepspeed_defaults_given_are_warned_about_unless_shardwrap_does_them(monkeypatch):
    dropped, checked = _given_defaults_dropped(monkeypatch)
    assert dropped == [], "\n".join(dropped)
    # every key was tried but those whose DeepSpeed default is what shardwrap does
    assert checked == set(unused.UNUSED) - DEFAULT_IS_WHAT_SHARDWRAP_DOES
    assert {"zero_optimization.overlap_comm", "fp16.auto_cast"} <= checked


def _old_rule(reads: dict[str, Read]):
    """``note_unused`` as it was: a value at DeepSpeed's default said nothing."""

    def note(section: Section, key: str, value: Any) -> None:
        if value != reads[section.child_path(key)].default:
            unused.note_unused(section, key, value)

    return note


def test_negative_control_the_old_rule_drops_given_defaults(monkeypatch):
    dropped, _ = _given_defaults_dropped(monkeypatch, rule=_old_rule)
    assert any("zero_optimization.overlap_comm = False (base stage 2)" in d for d in dropped)
    assert any("fp16.auto_cast = False" in d for d in dropped)
    assert any("zero_optimization.stage3_max_live_parameters" in d for d in dropped)


def _absent_keys_warned(monkeypatch) -> list[str]:
    """The warnings the base configs, which give none of ``unused.UNUSED``, bring."""
    warned = []
    for base in BASES:
        assert all(_value_at(base, name) is None for name in unused.UNUSED)
        _, messages, error = _parse(base)
        assert error is None, error
        warned += messages
    return warned


def test_keys_absent_from_the_config_say_nothing(monkeypatch):
    assert _absent_keys_warned(monkeypatch) == []


def test_negative_control_absent_keys_read_at_their_default_would_warn(monkeypatch):
    def note_even_if_absent(section: Section, key: str, value: Any) -> None:
        name = section.child_path(key)
        if value != unused.UNUSED[name].matches:
            warnings.warn(f"config {name}: {value!r}", UserWarning, stacklevel=2)

    for module in NOTE_UNUSED_USERS:
        monkeypatch.setattr(module, "note_unused", note_even_if_absent)
    assert any("zero_optimization.overlap_comm" in m for m in _absent_keys_warned(monkeypatch))
