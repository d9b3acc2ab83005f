"""Checkpoint tiers: a fault costs the steps since the newest good checkpoint.

Each test runs one script (tests/dist/tier_cases.py) uninterrupted, breaks its tiers, and
resumes a restarted model from ``load_checkpoint(tiers)``; the reference is the
uninterrupted run of the same script: losses after the resumed step, parameter shards
and optimizer state equal bit for bit. Nodes are faked on one machine with
``ranks_per_node`` (2 ranks as 2 nodes of 1, 4 ranks as 2 nodes of 2): each node writes
its own memory folder, which a test deletes to lose the node.
"""

from __future__ import annotations

import pytest

from tests.dist.harness import run_ranks
from tests.dist.tier_cases import (
    FAULT_AFTER,
    load_during_background_save,
    peer_traffic,
    run_fault_resume,
    save_one_step_twice,
)


def _tiers(tmp_path, **changes) -> dict:
    kwargs = {
        "memory": str(tmp_path / "shm"),
        "memory_every": 2,  # steps 2, 4, 6; keeps 4 and 6
        "disk": str(tmp_path / "disk"),
        "disk_every": 4,  # step 4
        "keep": 2,
        "ranks_per_node": 1,
    }
    return {**kwargs, **changes}


def _same_on_every_rank(results: list[dict]) -> dict:
    """The outcome every rank saw (the folders they loaded differ by node)."""
    per_rank = ("folder", "first_loss_gap")
    outcomes = [{k: v for k, v in r.items() if k not in per_rank} for r in results]
    assert all(o == outcomes[0] for o in outcomes), results
    return results[0]


def _resumed_exactly(result: dict) -> None:
    assert result["losses_equal"] and result["state_equal"], result


@pytest.mark.parametrize(("world_size", "background"), [(2, False), (3, False), (2, True)])
def test_restart_resumes_from_the_memory_tier_bit_for_bit(tmp_path, world_size, background):
    """A worker restart with the memory tier intact resumes from its newest step (6, not
    the disk tier's 4). At 3 ranks (3 nodes of 1) a node's folder lacks a file its rank
    reads (rank 0's, which holds the optimizer's scalar state) and gets it first. With
    ``background``, both tiers are saved asynchronously (peer copies included; a control,
    run once: with ``after_save`` skipped on the background thread, no index reached node
    1 and the load fell back to the disk tier's step 4, memory steps skipped as missing
    files; the same in the lost-node test's background case). Without
    that fetch (a negative control, run once) the 3-rank load failed on every rank:
    ``<id>-rank00000.safetensors', tensor 'body.0.weight/step' ...: the file is missing``. Negative
    control (run once): loading with ``restore_rng=False``
    made the first resumed loss differ from the uninterrupted run's by 0.043 on rank 0 and
    0.87 on rank 1 (dropout masks and input noise drawn from other streams), and the final
    shards and optimizer state differ on both ranks."""
    tiers = _tiers(tmp_path, memory_asynchronous=background, disk_asynchronous=background)
    results = run_ranks(run_fault_resume, world_size, tiers, "none")
    result = _same_on_every_rank(results)
    assert result["background"] == background, result
    assert result["chosen"] == ("memory", FAULT_AFTER) and result["skipped"] == [], result
    _resumed_exactly(result)
    if world_size == 3:  # node 2 saved rank 2's files and held rank 1's copies
        assert any("-rank00000.safetensors" in n for n in results[2]["folder"]), results[2]


@pytest.mark.parametrize(
    ("world_size", "ranks_per_node", "lost", "background"),
    [(2, 1, 1, False), (3, 1, 1, False), (4, 2, 1, False), (4, 2, 0, False), (4, 2, 1, True)],
)
def test_a_lost_node_resumes_from_the_peer_copies(
    tmp_path, world_size, ranks_per_node, lost, background
):
    """One node's memory folder deleted (node 1, or node 0, where world rank 0 committed
    the index): the next node's folder holds the lost node's copies, the others the rest;
    the lost node's ranks get their files from them (at 3 nodes, from two nodes) and the
    run resumes from step 6 exactly (also with the memory tier saved in the background). Negative
    controls: without peer copies, the next test;
    with the restore step off (no rank fetches what its node lacks; run once), the load
    failed on every rank in each case, naming a file of the lost node's folder:
    ``...node-<lost>/step-000000006/<id>-rank<r>.run.json: missing`` for one of its ranks
    ``r`` (at 3 ranks the first missing was rank 0's safetensors file)."""
    tiers = _tiers(tmp_path, ranks_per_node=ranks_per_node, memory_asynchronous=background)
    results = run_ranks(run_fault_resume, world_size, tiers, f"lose_node{lost}")
    result = _same_on_every_rank(results)
    assert result["background"] == background, result
    assert result["chosen"] == ("memory", FAULT_AFTER) and result["skipped"] == [], result
    _resumed_exactly(result)
    # The replaced node's folder was refilled: the index and its own ranks' files.
    for rank in range(lost * ranks_per_node, (lost + 1) * ranks_per_node):
        held = results[rank]["folder"]
        assert "index.json" in held and any(f"rank{rank:05d}.safetensors" in n for n in held)


def test_without_peer_copies_a_lost_node_falls_back_to_disk(tmp_path):
    """Negative control of the previous test, in the suite: with ``peer_copy=False`` the
    lost node's files exist nowhere, both memory steps are skipped as missing files and
    the run resumes (exactly) from the disk tier's older step 4."""
    tiers = _tiers(tmp_path, peer_copy=False)
    result = _same_on_every_rank(run_ranks(run_fault_resume, 2, tiers, "lose_node1"))
    assert result["chosen"] == ("disk", 4), result
    assert [s[:3] for s in result["skipped"]] == [
        ("memory", 6, "missing file"),
        ("memory", 4, "missing file"),
    ], result
    assert "-rank00001.safetensors" in result["skipped"][0][3], result
    _resumed_exactly(result)


@pytest.mark.parametrize("disk_asynchronous", [False, True])
def test_a_damaged_newest_step_falls_back_to_the_older_disk_step(tmp_path, disk_asynchronous):
    """Every copy of rank 1's file of memory step 6 has a flipped byte: step 6 is skipped
    for its digest, naming the file, and the run resumes exactly from the disk tier's step
    4 (memory keeps one step here; the disk step saved synchronously or in the background).
    The control of the digest check is the next test."""
    # memory: step 6 only (3 pruned); disk: step 4
    tiers = _tiers(tmp_path, memory_every=3, keep=1, disk_asynchronous=disk_asynchronous)
    result = _same_on_every_rank(run_ranks(run_fault_resume, 2, tiers, "corrupt_newest"))
    assert result["chosen"] == ("disk", 4), result
    ((tier, step, reason, detail),) = result["skipped"]
    assert (tier, step, reason) == ("memory", 6, "digest mismatch"), result
    assert "-rank00001.safetensors" in detail and "sha256 mismatch" in detail, detail
    _resumed_exactly(result)


def test_without_the_digest_check_the_damaged_step_is_taken(tmp_path):
    """Negative control of the previous test, in the suite: a selection that takes every
    file as verified chooses the damaged step 6, and the load itself then refuses it
    (the reader's chunk checksums): no fallback, the resume fails."""
    tiers = _tiers(tmp_path, memory_every=3, keep=1)
    results = run_ranks(run_fault_resume, 2, tiers, "corrupt_newest", True)
    for result in results:
        assert "checksum mismatch" in result["error"], result


def test_one_damaged_copy_is_replaced_from_the_other_node(tmp_path):
    """Node 0's own file of step 6 is damaged but node 1's copy is good: step 6 is still
    complete, node 0 gets the good copy, and the run resumes from step 6 exactly. Negative
    control (run once): with the restore step off, node 0 loaded its damaged file and the
    load failed on every rank: ``checksum mismatch in bytes ... (the file is corrupt)``."""
    result = _same_on_every_rank(
        run_ranks(run_fault_resume, 2, _tiers(tmp_path), "corrupt_one_copy")
    )
    assert result["chosen"] == ("memory", FAULT_AFTER) and result["skipped"] == [], result
    _resumed_exactly(result)


def test_saving_a_step_again_leaves_one_save_in_every_node_folder(tmp_path):
    """World rank 0's commit removes the earlier save's files on its own node only; every
    other node's first rank removes them from its node's folder. Negative control (run
    once): without that removal node 1's folder held 9 files, the index and both saves'
    4 (2 save ids)."""
    folders = run_ranks(save_one_step_twice, 2, _tiers(tmp_path))
    for held in folders:
        assert len(held) == 5, held  # the index, 2 ranks' safetensors and run files
        assert len({n.split("-")[0] for n in held if n != "index.json"}) == 1, held


@pytest.mark.parametrize(("world_size", "ranks_per_node"), [(2, 1), (4, 2)])
def test_a_rank_sends_its_own_files_once(tmp_path, world_size, ranks_per_node):
    """The peer copy of a memory-tier save: each rank sends one bundle to one peer, its
    size (8 bytes) then its own safetensors and run files with a manifest of under 1 KiB;
    nothing grows with the world size. Negative control (run once): bundling every file
    of the rank's node folder instead failed at both sizes: at 2 ranks the bundle carried
    the index too (23857 bytes sent for 21449 of own files), at 4 ranks two ranks sent the
    same files to one node and their writes collided (``FileNotFoundError``)."""
    tiers = _tiers(tmp_path, ranks_per_node=ranks_per_node)
    for result in run_ranks(peer_traffic, world_size, tiers):
        size, payload = result["sends"]
        assert size == 8 and 0 < payload - result["own_bytes"] < 1024, result


def test_a_load_waits_for_the_save_in_the_background(tmp_path):
    """A load of the tiers into the model whose memory-tier save is still written (held
    back 0.3 s) takes that step, once written (another model's load does not wait: a
    model's saves are its own). Negative control (run once): without the wait
    the load found step 2 unfinished and refused (``no loadable checkpoint: ... memory
    step 2 ...: incomplete``)."""
    tiers = _tiers(tmp_path, disk=None, memory_asynchronous=True)
    assert run_ranks(load_during_background_save, 2, tiers) == ["2", "2"]
