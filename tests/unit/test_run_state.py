"""The run in a checkpoint on one rank: RNG streams and the data position come back."""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest
import torch

from shardwrap import (
    CheckpointError,
    ResumableSampler,
    ShardedModule,
    load_checkpoint,
    save_checkpoint,
)
from shardwrap.ckpt import run_state
from tests import models


def _draws() -> tuple:
    """One draw of every generator a checkpoint restores."""
    return (torch.rand(3).tolist(), random.random(), np.random.rand(2).tolist())


def _seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed + 1)
    np.random.seed(seed + 2)


def _model():
    torch.manual_seed(0)
    return ShardedModule(models.MLP())


def _save(path, sampler=None):
    model = _model()
    _seed_all(11)
    save_checkpoint(path, model, sampler=sampler)
    return model


def test_generators_continue_where_they_were_saved(one_rank, tmp_path):
    model = _save(tmp_path / "c")
    expected = _draws()  # what the saving run draws next
    _draws()
    load_checkpoint(tmp_path / "c", model)
    assert _draws() == expected
    _seed_all(99)
    moved = _draws()
    _seed_all(99)
    load_checkpoint(tmp_path / "c", model, restore_rng=False)
    assert _draws() == moved  # untouched


def test_the_sampler_position_comes_back(one_rank, tmp_path):
    sampler = ResumableSampler(20, global_batch_size=4, rank=0, world_size=1, seed=5)
    iterator = iter(sampler)
    seen = [next(iterator), next(iterator)]
    model = _save(tmp_path / "c", sampler)
    rest = list(iterator)
    fresh = ResumableSampler(20, global_batch_size=4, rank=0, world_size=1, seed=5)
    load_checkpoint(tmp_path / "c", model, sampler=fresh)
    assert fresh.state_dict()["position"] == 8
    assert list(fresh) == rest
    assert sorted(sum(seen + rest, [])) == list(range(20))
    other = ResumableSampler(20, global_batch_size=4, rank=0, world_size=1, seed=6)
    with pytest.raises(CheckpointError, match="state\\['seed'\\]: saved 5"):
        load_checkpoint(tmp_path / "c", model, sampler=other)
    assert other.state_dict()["position"] == 0


def test_a_checkpoint_without_a_data_position_says_so(one_rank, tmp_path):
    model = _save(tmp_path / "c")
    sampler = ResumableSampler(20, global_batch_size=4, rank=0, world_size=1)
    with pytest.raises(CheckpointError, match="rank00000.run.json: key 'data' is null"):
        load_checkpoint(tmp_path / "c", model, sampler=sampler)
    with pytest.raises(CheckpointError, match="sampler: expected an object with load_state_dict"):
        load_checkpoint(tmp_path / "c", model, sampler=object())
    with pytest.raises(CheckpointError, match="sampler: expected an object with state_dict"):
        save_checkpoint(tmp_path / "d", model, sampler=[1])
    with pytest.raises(CheckpointError, match="restore_rng: expected a bool, got 1"):
        load_checkpoint(tmp_path / "c", model, restore_rng=1)


def test_a_corrupt_or_missing_run_file_is_named(one_rank, tmp_path):
    model = _save(tmp_path / "c")
    (name,) = [n for n in os.listdir(tmp_path / "c") if n.endswith(".run.json")]
    path = tmp_path / "c" / name
    record = json.loads(path.read_text())
    record["payload"]["rng"]["python"][1][0] += 1
    path.write_text(json.dumps(record))
    with pytest.raises(CheckpointError, match=f"run state .*{name}: sha256 mismatch"):
        load_checkpoint(tmp_path / "c", model)
    path.unlink()
    with pytest.raises(CheckpointError, match=f"run state .*{name}: missing"):
        load_checkpoint(tmp_path / "c", model)


def test_a_new_save_replaces_the_run_files(one_rank, tmp_path):
    model = _save(tmp_path / "c")
    first = [n for n in os.listdir(tmp_path / "c") if n.endswith(".run.json")]
    _save(tmp_path / "c")
    second = [n for n in os.listdir(tmp_path / "c") if n.endswith(".run.json")]
    assert len(first) == len(second) == 1 and first != second
    index = json.loads((tmp_path / "c" / "index.json").read_text())
    assert second[0].startswith(index["save_id"])
    load_checkpoint(tmp_path / "c", model)


def test_at_another_world_size_new_ranks_derive_their_streams(one_rank, tmp_path):
    _save(tmp_path / "c", ResumableSampler(20, global_batch_size=4, rank=0, world_size=1))
    index = json.loads((tmp_path / "c" / "index.json").read_text())
    meta = {k: index[k] for k in ("save_id", "world_size", run_state.META_KEY)}
    draws = {}
    for rank in (0, 1, 2):
        restore, data = run_state.read_for_load(str(tmp_path / "c"), meta, rank, 3, object())
        assert data["position"] == 0  # rank 0's position, for every rank
        assert (restore.own is None) == (rank > 0)
        restore.restore_rng(rank)
        draws[rank] = _draws()
        restore.restore_rng(rank)
        assert _draws() == draws[rank]  # deterministic
    assert len({str(d) for d in draws.values()}) == 3  # and different for every rank


def test_the_engine_checkpoint_carries_the_generators(one_rank, tmp_path):
    from tests.dist import engine_cases

    engine = engine_cases.make_engine(engine_cases.build_model("gpt"), 3, 1, 0.0)
    _seed_all(5)
    sampler = ResumableSampler(20, global_batch_size=4, rank=0, world_size=1)
    next(iter(sampler))
    engine.save_checkpoint(str(tmp_path), client_state={"sampler": sampler.state_dict()})
    expected = _draws()
    _seed_all(6)
    _, client_state = engine.load_checkpoint(str(tmp_path))
    assert _draws() == expected
    fresh = ResumableSampler(20, global_batch_size=4, rank=0, world_size=1)
    fresh.load_state_dict(client_state["sampler"])  # the data position, through client_state
    assert fresh.state_dict() == sampler.state_dict()
    _seed_all(6)
    moved = _draws()
    _seed_all(6)
    engine.load_checkpoint(str(tmp_path), load_module_only=True)
    assert _draws() == moved


@pytest.mark.parametrize(
    ("key", "change"),
    [
        ("python", lambda rng: rng["python"][1].pop()),
        ("torch_cpu", lambda rng: rng.update(torch_cpu="AAAA")),
        ("numpy", lambda rng: rng["numpy"].pop()),
    ],
)
def test_a_wrong_generator_state_is_refused_before_anything_is_set(one_rank, tmp_path, key, change):
    model = _save(tmp_path / "c")
    (name,) = [n for n in os.listdir(tmp_path / "c") if n.endswith(".run.json")]
    path = tmp_path / "c" / name
    record = json.loads(path.read_text())
    change(record["payload"]["rng"])
    record["sha256"] = run_state._digest(record["payload"])  # well-formed, consistent, wrong
    path.write_text(json.dumps(record))
    _seed_all(3)
    expected = _draws()
    _seed_all(3)
    with pytest.raises(CheckpointError, match=f"{name}: key 'rng.{key}' has the wrong size"):
        load_checkpoint(tmp_path / "c", model)
    assert _draws() == expected


class _FakeAccelerator:
    """Stands in for ``torch.cuda`` where there is no GPU: one generator per device index."""

    type = "fakegpu"

    def __init__(self) -> None:
        self.states = {
            0: torch.arange(16, dtype=torch.uint8),
            1: torch.zeros(16, dtype=torch.uint8),
        }

    def get_rng_state(self, index):
        return self.states[index].clone()

    def set_rng_state(self, state, index):
        self.states[index] = state.clone()


def test_the_current_accelerators_generator_is_saved_and_restored(monkeypatch, tmp_path):
    fake = _FakeAccelerator()
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: fake)
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 1)
    monkeypatch.setattr(torch, "get_device_module", lambda kind: fake)
    fake.states[1] = torch.full((16,), 7, dtype=torch.uint8)
    name = run_state.write_run_file(str(tmp_path), "0" * 16, 0, 1, None)
    saved = json.loads((tmp_path / name).read_text())["payload"]["rng"]["accelerator"]
    assert saved["type"] == "fakegpu"
    fake.states[1] = torch.zeros(16, dtype=torch.uint8)
    record = run_state.read_run_file(str(tmp_path), "0" * 16, 0)
    record.streams.restore()
    assert fake.states[1].tolist() == [7] * 16  # device 1's, the current one
    assert fake.states[0].tolist() == list(range(16))  # another device's is untouched
