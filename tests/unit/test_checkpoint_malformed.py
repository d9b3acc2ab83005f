"""Malformed checkpoints and failed saves (issue #20, item 2): each refusal names the file
and the key, and a refused load leaves the model, the optimizer, the sampler and the
random streams as they were."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil

import pytest
import torch

from shardwrap import (
    CheckpointError,
    ResumableSampler,
    ShardedModule,
    load_checkpoint,
    save_checkpoint,
)
from shardwrap.ckpt import safetensors_writer
from tests import models
from tests.dist import parity
from tests.dist.refusal_cases import changes, run_snapshot


def _trained(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    model = ShardedModule(models.MLP(depth=1))
    optim = parity.make_optimizer(model, kind)
    models.mlp_loss(model, models.mlp_batch(seed)).backward()
    optim.step()
    optim.zero_grad()
    return model, optim


def _sampler() -> ResumableSampler:
    return ResumableSampler(12, global_batch_size=3, rank=0, world_size=1, seed=2)


@pytest.fixture
def adamw_checkpoint(one_rank, tmp_path):
    model, optim = _trained("adamw")
    sampler = _sampler()
    next(iter(sampler))
    save_checkpoint(tmp_path / "adamw", model, optim, sampler=sampler)
    return str(tmp_path / "adamw")


def _edited(source: str, folder: str, edit) -> str:
    shutil.copytree(source, folder)
    path = os.path.join(folder, "index.json")
    with open(path) as handle:
        text = handle.read()
    with open(path, "w") as handle:
        handle.write(edit(text))
    return folder


def _refused(folder: str, kind: str, *patterns: str) -> None:
    """Loading ``folder`` into a trained model and ``kind`` optimizer fails, changing nothing:
    parameters, buffers, optimizer, sampler, random streams."""
    model, optim = _trained(kind, seed=5)
    sampler = _sampler()
    torch.manual_seed(77)  # other streams than the saved ones
    snapshot = run_snapshot(model, optim, sampler)
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(folder, model, optim, sampler=sampler)
    for pattern in patterns:
        assert pattern in str(caught.value), str(caught.value)
    assert changes(snapshot, run_snapshot(model, optim, sampler)) == []
    models.mlp_loss(model, models.mlp_batch(1)).backward()
    optim.step()  # still usable


def test_adamw_state_into_sgd_is_refused_naming_both_classes(adamw_checkpoint):
    _refused(adamw_checkpoint, "sgd", "torch.optim.adamw.AdamW", "torch.optim.sgd.SGD")


def test_a_checkpoint_without_the_class_record_is_refused_by_the_settings(
    adamw_checkpoint, tmp_path
):
    def drop_class(text: str) -> str:
        raw = json.loads(text)
        del raw["optimizer_class"]
        return json.dumps(raw)

    old = _edited(adamw_checkpoint, str(tmp_path / "old"), drop_class)
    _refused(old, "sgd", "param_groups[0] lacks the settings", "'momentum'")


def test_a_parameter_listed_twice_is_refused(adamw_checkpoint, tmp_path):
    """The second copy points at another tensor's pieces: every checksum would pass."""

    def doubled(text: str) -> str:
        raw = json.loads(text)
        other = raw["params"]["body.0.weight"]
        entry = json.dumps({**other, "pieces": raw["params"]["head.weight"]["pieces"]})
        doubled = f'"head.weight": {entry}, "head.weight": {{'
        return re.sub(r'"head\.weight":\s*\{', lambda _: doubled, text, count=1)

    folder = _edited(adamw_checkpoint, str(tmp_path / "twice"), doubled)
    _refused(folder, "adamw", f"{folder}/index.json: key 'head.weight' is given twice")


@pytest.mark.parametrize(
    ("edit", "key"),
    [
        (lambda raw: raw.update(params=list(raw["params"])), "'params'"),
        (lambda raw: raw.update(files=list(raw["files"])), "'files'"),
        (lambda raw: raw["optimizer"].update(state=[]), "'optimizer.state'"),
        (lambda raw: raw["optimizer"].update(param_groups=2), "'optimizer.param_groups'"),
    ],
)
def test_a_section_of_the_wrong_type_is_refused(adamw_checkpoint, tmp_path, edit, key):
    def change(text: str) -> str:
        raw = json.loads(text)
        edit(raw)
        return json.dumps(raw)

    folder = _edited(adamw_checkpoint, str(tmp_path / "typed"), change)
    _refused(folder, "adamw", f"{folder}/index.json", key)


def test_a_save_on_a_full_disk_names_the_file_and_leaves_nothing(one_rank, tmp_path, monkeypatch):
    model, optim = _trained("adamw")
    folder = tmp_path / "ckpt"
    save_checkpoint(folder, model, optim)
    before = sorted(os.listdir(folder))
    real = safetensors_writer._raw_bytes
    calls = []

    def fill_the_disk(item):
        calls.append(item.key)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(item)

    monkeypatch.setattr(safetensors_writer, "_raw_bytes", fill_the_disk)
    with pytest.raises(CheckpointError, match=r"No space left on device") as caught:
        save_checkpoint(folder, model, optim)
    assert f"{folder}{os.sep}" in str(caught.value) and "-rank00000.safetensors" in str(
        caught.value
    )
    assert sorted(os.listdir(folder)) == before  # no temporary, the last save intact
    monkeypatch.undo()
    fresh, fresh_optim = _trained("adamw", seed=3)
    load_checkpoint(folder, fresh, fresh_optim)
    for p, q in zip(model.parameters(), fresh.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=0, atol=0)


def test_a_later_parameter_of_another_dtype_changes_nothing(adamw_checkpoint, tmp_path):
    def other_dtype(text: str) -> str:
        raw = json.loads(text)
        raw["params"]["head.bias"]["dtype"] = "float64"
        return json.dumps(raw)

    folder = _edited(adamw_checkpoint, str(tmp_path / "dtype"), other_dtype)
    _refused(folder, "adamw", "'head.bias'", "checkpoint dtype torch.float64")


@pytest.mark.parametrize("section", ["params", "optimizer"])
def test_a_later_piece_its_file_lacks_changes_nothing(adamw_checkpoint, tmp_path, section):
    """Found while reading the last parameter (or its optimizer state): found before the
    first copy instead ([Note: a refused load changes nothing])."""

    def renamed(text: str) -> str:
        raw = json.loads(text)
        entry = raw["params"]["head.bias"]
        if section == "optimizer":
            entry = raw["optimizer"]["state"]["head.bias"]["exp_avg"]
        entry["pieces"][0]["key"] += "~"
        return json.dumps(raw)

    folder = _edited(adamw_checkpoint, str(tmp_path / "renamed"), renamed)
    _refused(folder, "adamw", "'head.bias", "~'")
