"""JSON values between ranks (comm/json_values.py): what goes in comes out, pickle-free.

Real ranks exchange them in tests/dist/test_checkpoint_errors.py (a load's names, a
refusal's errors) and tests/dist/test_checkpoint_traffic.py (what that costs); here the
framing, and a group of one rank, which moves nothing.
"""

from __future__ import annotations

import pickle

import pytest

from shardwrap.comm import json_values
from shardwrap.comm.collectives import Communicator
from shardwrap.comm.ledger import CommLedger

VALUES = [
    None,
    "",
    ["blocks.0.weight", "tok.weight"],
    {"error": "OSError: /tmp/caf\udce9/ckpt: no such folder"},  # a path that is not UTF-8
    "ünïcode ✓",
    [1, 2.5, True, {"nested": []}],
]


@pytest.mark.parametrize("value", VALUES)
def test_a_framed_value_comes_back_padded_or_not(value):
    payload = json_values._encoded(value)
    for width in (len(payload), len(payload) + 13):
        assert json_values._unframed(json_values._framed(payload, width)) == value


def test_one_rank_returns_its_value_without_a_collective_or_pickle(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("unpickled")

    monkeypatch.setattr(pickle, "loads", refuse)
    comm = Communicator(None, CommLedger())
    for value in VALUES:
        assert json_values.all_gather_json(comm, value, purpose="t") == [value]
        assert json_values.gather_json(comm, value, purpose="t") == [value]
        assert json_values.broadcast_json(comm, value, purpose="t") == value
    assert comm.ledger.records == []
    with pytest.raises(TypeError, match="not JSON serializable"):
        json_values.all_gather_json(comm, object(), purpose="t")
