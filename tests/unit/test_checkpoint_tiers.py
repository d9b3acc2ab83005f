"""Checkpoint tiers in one process: the options' refusals, the node arithmetic, pruning,
file bundles, and the choice among folders on one rank (in-process group)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from shardwrap import CheckpointTiers, ShardedModule, load_checkpoint, save_checkpoint, save_tiered
from shardwrap.checkpoint import CheckpointError, load_newest, newest_checkpoint
from shardwrap.ckpt.format import SHARD_FILE_PATTERN, read_index
from shardwrap.ckpt.nodes import NodeMap, nodes_of_hosts
from shardwrap.ckpt.peer_copy import bundle, unbundle
from shardwrap.ckpt.tier_options import saved_steps
from shardwrap.ckpt.tiered_save import prune_steps
from shardwrap.comm.ledger import CommRecord
from tests import models
from tests.dist import parity


@pytest.mark.parametrize(
    ("kwargs", "error", "argument"),
    [
        ({}, ValueError, "memory, disk"),
        ({"memory": 3}, TypeError, "memory"),
        ({"disk": b"/x"}, TypeError, "disk"),
        ({"memory": "/a", "disk": "/a"}, ValueError, "memory, disk"),
        ({"memory": "/a", "memory_every": 0}, ValueError, "memory_every"),
        ({"memory": "/a", "memory_every": True}, TypeError, "memory_every"),
        ({"disk": "/a", "disk_every": 2.0}, TypeError, "disk_every"),
        ({"disk": "/a", "keep": 0}, ValueError, "keep"),
        ({"memory": "/a", "peer_copy": 1}, TypeError, "peer_copy"),
        ({"memory": "/a", "ranks_per_node": 0}, ValueError, "ranks_per_node"),
        ({"disk": "/a", "disk_asynchronous": "yes"}, TypeError, "disk_asynchronous"),
        ({"memory": "/a", "memory_asynchronous": None}, TypeError, "memory_asynchronous"),
    ],
)
def test_invalid_options_name_the_argument(kwargs, error, argument):
    """Negative control (run once): without ``keep``'s check, ``keep=0`` was accepted
    (``DID NOT RAISE ValueError``)."""
    with pytest.raises(error, match=f"^{argument}"):
        CheckpointTiers(**kwargs)


def test_options_are_frozen_and_take_paths():
    tiers = CheckpointTiers(memory=Path("/dev/shm/run"), disk="/ckpt")
    assert tiers.memory == "/dev/shm/run" and tiers.node_folder(3) == "/dev/shm/run/node-00003"
    with pytest.raises(AttributeError):
        tiers.keep = 5  # type: ignore[misc]


@pytest.mark.parametrize(("world_size", "per_node"), [(2, 1), (4, 2), (6, 3), (8, 2)])
def test_every_rank_has_one_peer_on_another_node(world_size, per_node):
    """Negative control (run once): a peer at ``rank + 1`` was on the same node at 4, 6
    and 8 ranks (rank 0's peer 1 on node 0)."""
    nodes = NodeMap(world_size, per_node)
    peers = [nodes.peer_of(r) for r in range(world_size)]
    assert sorted(peers) == list(range(world_size))  # a permutation: one copy each
    for rank, peer in enumerate(peers):
        assert nodes.node_of(peer) != nodes.node_of(rank)
        assert nodes.source_of(peer) == rank
        assert nodes.local_index(peer) == nodes.local_index(rank)


def test_nodes_are_found_from_host_names():
    """Ranks of one host must be consecutive. Negative control (run once): grouping by
    host name alone took ``a b a b`` for 2 nodes of 2 (``DID NOT RAISE ValueError``)."""
    assert nodes_of_hosts(["a", "a", "b", "b"]) == NodeMap(4, 2)
    assert nodes_of_hosts(["x"]) == NodeMap(1, 1)
    for hosts in (["a", "b", "a", "b"], ["a", "a", "b"], ["a", "a", "b", "b", "a", "a"]):
        with pytest.raises(ValueError, match="^ranks_per_node: .* pass ranks_per_node"):
            nodes_of_hosts(hosts)


def test_nodes_must_tile_the_world():
    with pytest.raises(ValueError, match="^ranks_per_node"):
        NodeMap(6, 4)


def test_pruning_keeps_the_step_and_the_newest_before_it(tmp_path):
    for step in (1, 2, 3, 5, 8):
        os.makedirs(tmp_path / f"step-{step:09d}")
    # step 8 is of a run rolled back to step 3: it goes; 2 and 3 stay (keep=3)
    assert prune_steps(str(tmp_path), 5, keep=3) == [1, 8]
    assert sorted(saved_steps(str(tmp_path))) == [2, 3, 5]


def test_a_bundle_writes_its_files_only_when_their_digests_hold(tmp_path):
    """Negative control (run once): without the receiver's digest comparison the damaged
    copy was written (``DID NOT RAISE CheckpointError``)."""
    source, target = tmp_path / "a", tmp_path / "b"
    source.mkdir()
    (source / "x.bin").write_bytes(b"hello" * 100)
    (source / "y.bin").write_bytes(b"")
    payload = bundle(str(source), ["x.bin", "y.bin"])
    assert unbundle(payload, str(target), None, {}, 0) == ["x.bin", "y.bin"]
    assert (target / "x.bin").read_bytes() == b"hello" * 100
    damaged = payload.clone()
    damaged[-3] ^= 1  # a byte of x.bin's data
    with pytest.raises(CheckpointError, match="'x.bin' from rank 4: sha256 mismatch"):
        unbundle(damaged, str(tmp_path / "c"), None, {}, 4)
    assert not (tmp_path / "c" / "x.bin").exists()
    with pytest.raises(CheckpointError, match="sha256 mismatch"):  # not the digest expected
        unbundle(payload, str(tmp_path / "d"), None, {"y.bin": "0" * 64}, 0)
    missing = bundle(str(source), ["absent.bin"])
    with pytest.raises(CheckpointError, match="rank 1 could not send.*absent.bin"):
        unbundle(missing, str(tmp_path / "e"), None, {}, 1)


def _trained(step: int):
    torch.manual_seed(0)
    model = ShardedModule(models.MLP())
    optim = parity.make_optimizer(model, "adamw")
    for s in range(step):
        models.mlp_loss(model, models.mlp_batch(s)).backward()
        optim.step()
        optim.zero_grad()
    return model, optim


def test_peer_copy_on_one_node_is_refused(one_rank, tmp_path):
    model, optim = _trained(1)
    tiers = CheckpointTiers(memory=str(tmp_path / "shm"), ranks_per_node=1)
    with pytest.raises(ValueError, match="^peer_copy: .* one node"):
        save_tiered(tiers, 1, model, optim)


def test_one_rank_tiers_prune_and_resume_from_the_newest(one_rank, tmp_path):
    """Memory every step (keep 2), disk every 2 steps (keep 2): the newest memory step is
    taken and loads exactly (the multi-rank cases, with their controls, are in
    tests/dist/test_checkpoint_tiers.py)."""
    tiers = CheckpointTiers(
        memory=str(tmp_path / "shm"), disk=str(tmp_path / "disk"), disk_every=2, peer_copy=False
    )
    torch.manual_seed(0)
    model = ShardedModule(models.MLP())
    optim = parity.make_optimizer(model, "adamw")
    for step in range(1, 6):
        models.mlp_loss(model, models.mlp_batch(step)).backward()
        optim.step()
        optim.zero_grad()
        saved = save_tiered(tiers, step, model, optim, extra={"step": step})
        assert (saved.memory is not None, saved.disk is not None) == (True, step % 2 == 0)
    assert sorted(saved_steps(tiers.node_folder(0))) == [4, 5]
    assert sorted(saved_steps(tiers.disk)) == [2, 4]
    fresh, fresh_optim = _trained(0)
    resumed = load_newest(tiers, fresh, fresh_optim)
    assert resumed.extra == {"step": 5} and resumed.selection.skipped == ()
    for p, q in zip(model.parameters(), fresh.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=0, atol=0)


def test_folders_are_tried_in_order_and_skips_say_why(one_rank, tmp_path, caplog):
    """An unfinished folder and a damaged one are skipped, each with its reason, and the
    load says so. Negative control (run once): without the sha256 comparison the damaged
    folder was taken (``took folder (.../damaged)``)."""
    model, optim = _trained(2)
    good, damaged, unfinished = (str(tmp_path / n) for n in ("good", "damaged", "unfinished"))
    save_checkpoint(good, model, optim, extra="good")
    save_checkpoint(damaged, model, optim, extra="damaged")
    (name,) = [n for n in os.listdir(damaged) if SHARD_FILE_PATTERN.match(n)]
    with open(os.path.join(damaged, name), "r+b") as handle:
        handle.seek(-2, os.SEEK_END)
        handle.write(b"\xff\xff")
    os.makedirs(unfinished)
    selection = newest_checkpoint([unfinished, damaged, good], model)
    assert str(selection.chosen) == f"folder ({good})", selection.describe()
    reasons = [(s.candidate.where, s.reason.value) for s in selection.skipped]
    assert reasons == [(unfinished, "incomplete"), (damaged, "digest mismatch")]
    assert name in selection.skipped[1].detail
    fresh, fresh_optim = _trained(0)
    with caplog.at_level("WARNING", logger="shardwrap.checkpoint"):
        assert load_checkpoint([unfinished, damaged, good], fresh, fresh_optim) == "good"
    (logged,) = caplog.records
    assert logged.getMessage().startswith(f"load_checkpoint: took folder ({good}); skipped"), (
        logged.getMessage()
    )
    assert "incomplete" in logged.getMessage() and "digest mismatch" in logged.getMessage()
    read_index(good)  # untouched
    with pytest.raises(CheckpointError, match="no loadable checkpoint.*skipped folder"):
        load_newest([unfinished, damaged], fresh, fresh_optim)
    with pytest.raises(TypeError, match="^path: "):
        load_newest([good, 3], fresh, fresh_optim)


def test_a_rolled_back_run_replaces_the_steps_after_it(one_rank, tmp_path):
    """Saving step 3 after step 5 (a run resumed from an older checkpoint) removes steps 4
    and 5: a later load must not prefer them. Negative control (run once): with
    ``prune_steps`` keeping the steps after the one saved, steps 4 and 5 stayed
    (``[3, 4, 5]``)."""
    tiers = CheckpointTiers(memory=str(tmp_path / "shm"), peer_copy=False, keep=2)
    model, optim = _trained(1)
    for step in (4, 5):
        save_tiered(tiers, step, model, optim)
    save_tiered(tiers, 3, model, optim)
    assert sorted(saved_steps(tiers.node_folder(0))) == [3]


def test_a_send_moves_all_its_bytes():
    """The peer copy's records (``send``) count every byte on the wire, not a ring's
    (N-1)/N. Negative control (run once): without the ``send`` case, 1000 bytes in a
    group of 4 counted 750."""
    assert CommRecord("send", "checkpoint_peer", 1000, 4).wire_bytes == 1000
