"""A checkpoint written by an earlier shardwrap still loads, bit for bit.

``tests/data/ckpt_main_v2/`` was written by ``main`` at commit 0bc5584 (index format 2,
per-rank ``<save_id>-rank<r>.run.json`` run files) with :func:`_save_fixture` on 2 ranks:
a tiny GPT (tied embedding, a frozen table, a buffer) under FULL_SHARD, AdamW after two
steps (sharded and scalar state), a ``ResumableSampler`` three batches in, and known
generator seeds. Beside it, ``expected.safetensors`` holds what those ranks held (whole
parameters, buffer, optimizer state, gathered at the save) and ``expected.json`` the
``extra``, the sampler's state and what each rank's generators drew right after the save.

Users have such checkpoints; a change to the checkpoint code must load them. Regenerate
only with the code that wrote them (``python -m tests.dist.test_checkpoint_from_main``
writes a new fixture with today's code: that defeats the test unless the format is the
same). Negative control, seen once: flipping one weight in ``expected.safetensors`` (or
loading with ``restore_rng=False``) fails the comparison.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from shardwrap import ResumableSampler, ShardedModule, load_checkpoint, save_checkpoint
from shardwrap.ckpt.state_dict import optim_state_dict
from tests import models
from tests.dist.harness import run_ranks

FIXTURE = os.path.join(os.path.dirname(__file__), os.pardir, "data", "ckpt_main_v2")
CHECKPOINT = os.path.join(FIXTURE, "checkpoint")
SAVED_WORLD_SIZE = 2
EXTRA = {"step": 2, "note": "written by main 0bc5584"}


def _model() -> ShardedModule:
    torch.manual_seed(0)
    return ShardedModule(models.TinyGPT(vocab=16, dim=8, depth=1, seq=4))


def _optimizer(model: ShardedModule) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=0.01)


def _sampler(rank: int, world_size: int, global_batch_size: int = 4) -> ResumableSampler:
    return ResumableSampler(
        32, global_batch_size=global_batch_size, rank=rank, world_size=world_size, seed=3
    )


def _position(state: dict) -> dict:
    """A sampler's state less its batch size (a load may change it)."""
    return {k: v for k, v in state.items() if k != "global_batch_size"}


def _draws() -> list:
    """One draw of every generator a checkpoint restores."""
    return [torch.rand(3).tolist(), random.random(), np.random.rand(2).tolist()]


def _batch(step: int):
    return models.gpt_batch(step, batch=2, seq=4, vocab=16)


def _save_fixture(rank: int, world_size: int, folder: str) -> dict:
    """What wrote the fixture (kept to show how; see the module docstring)."""
    model = _model()
    optimizer = _optimizer(model)
    for step in range(2):
        models.gpt_loss(model, _batch(10 * rank + step)).backward()
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        model.module.scale.fill_(1.5)  # a buffer that is not its initial value
    sampler = _sampler(rank, world_size)
    for _, _ in zip(range(3), sampler, strict=False):
        pass
    torch.manual_seed(100 + rank)
    random.seed(200 + rank)
    np.random.seed(300 + rank)
    save_checkpoint(
        os.path.join(folder, "checkpoint"), model, optimizer, extra=EXTRA, sampler=sampler
    )
    draws = _draws()
    state = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    osd = optim_state_dict(model, optimizer)
    for name, states in osd["state"].items():
        state.update({f"optim.{name}.{k}": torch.as_tensor(v).clone() for k, v in states.items()})
    if rank == 0:
        save_file(
            {k: v.contiguous() for k, v in state.items()},
            os.path.join(folder, "expected.safetensors"),
        )
    return {"draws": draws, "sampler": sampler.state_dict(), "lr": osd["param_groups"][0]["lr"]}


def _load_and_compare(rank: int, world_size: int) -> list:
    expected = load_file(os.path.join(FIXTURE, "expected.safetensors"))
    with open(os.path.join(FIXTURE, "expected.json"), encoding="utf-8") as handle:
        saved = json.load(handle)
    model = _model()
    optimizer = _optimizer(model)
    sampler = _sampler(rank, world_size, global_batch_size=12)  # divides by 1, 2 and 3
    torch.manual_seed(999)  # generators elsewhere, so that a restore shows
    extra = load_checkpoint(CHECKPOINT, model, optimizer, sampler=sampler)
    draws = _draws()
    wrong = [] if extra == saved["extra"] else ["extra"]
    loaded = {f"model.{k}": v for k, v in model.state_dict().items()}
    osd = optim_state_dict(model, optimizer)
    for name, states in osd["state"].items():
        loaded.update({f"optim.{name}.{k}": torch.as_tensor(v) for k, v in states.items()})
    if set(loaded) != set(expected):  # nothing left uncompared (an optimizer not loaded)
        wrong.append(f"names: {sorted(set(loaded) ^ set(expected))}")
    wrong += [
        k for k in sorted(set(loaded) & set(expected)) if not torch.equal(loaded[k], expected[k])
    ]
    if osd["param_groups"][0]["lr"] != saved["ranks"][0]["lr"]:
        wrong.append("lr")
    # A position that means the same at every world size: rank 0's at another world size.
    saved_position = saved["ranks"][0 if world_size != SAVED_WORLD_SIZE else rank]["sampler"]
    if _position(sampler.state_dict()) != _position(saved_position):
        wrong.append("sampler")
    if rank < SAVED_WORLD_SIZE and draws != saved["ranks"][rank]["draws"]:
        wrong.append("generators")
    return wrong


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_a_checkpoint_written_by_main_loads_exactly(world_size):
    assert os.path.isfile(os.path.join(CHECKPOINT, "index.json"))
    assert run_ranks(_load_and_compare, world_size) == [[]] * world_size


def _files(folder: str) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(Path(folder).iterdir())}


def _resave(rank: int, world_size: int, folder: str) -> None:
    """Main's checkpoint loaded at its world size (model, optimizer, sampler, generators),
    then saved again by today's code. No training runs here: the values saved are the
    loaded ones, so the bytes cannot depend on the CPU's arithmetic (training does:
    the fixture's AdamW steps round differently on AVX-512 and AMX machines)."""
    model = _model()
    optimizer = _optimizer(model)
    sampler = _sampler(rank, world_size)
    extra = load_checkpoint(CHECKPOINT, model, optimizer, sampler=sampler)
    save_checkpoint(
        os.path.join(folder, "checkpoint"), model, optimizer, extra=extra, sampler=sampler
    )


def test_a_save_writes_what_main_wrote(tmp_path):
    """Main's checkpoint loaded and saved again by today's code: the same files, byte for
    byte, once the save id (drawn at random) is main's (the on-disk form did not change;
    the files' digests, which cover the save id, follow from their bytes).

    Negative control, seen once: a shard file's piece key renamed (``param/`` to
    ``params/`` in ``piece_key``) fails here (the loads above read keys from the index)."""
    run_ranks(_resave, SAVED_WORLD_SIZE, str(tmp_path))
    new, old = _files(str(tmp_path / "checkpoint")), _files(CHECKPOINT)
    new_id, old_id = (next(iter(f))[:16].encode() for f in (new, old))
    assert [n.replace(new_id.decode(), old_id.decode()) for n in new] == list(old)
    for (name, data), want in zip(new.items(), old.values(), strict=True):
        if name.endswith(".run.json"):  # its sha256 covers the save id: compare payloads
            got = json.loads(data.replace(new_id, old_id))["payload"]
            assert got == json.loads(want)["payload"], name
        elif name == "index.json":  # the files' digests cover the save id: their sizes
            got, expected = json.loads(data.replace(new_id, old_id)), json.loads(want)
            sizes = [{n: f["size"] for n, f in i.pop("files").items()} for i in (got, expected)]
            assert got == expected and sizes[0] == sizes[1]
            assert list(json.loads(data)) == list(json.loads(want)), "the keys in order"
        else:
            assert data.replace(new_id, old_id) == want, name


def _regenerate(folder: str) -> None:
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    ranks = run_ranks(_save_fixture, SAVED_WORLD_SIZE, folder, fresh=True)
    with open(os.path.join(folder, "expected.json"), "w", encoding="utf-8") as handle:
        json.dump({"extra": EXTRA, "ranks": ranks}, handle, indent=1)
        handle.write("\n")


if __name__ == "__main__":
    _regenerate(sys.argv[1] if len(sys.argv) > 1 else FIXTURE)
