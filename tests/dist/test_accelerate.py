"""accelerate's and the Trainer's own FSDP1 code run shardwrap after ``install()`` (2 ranks).

A tiny GPT-2 and Llama are prepared by ``Accelerator`` with a
``FullyShardedDataParallelPlugin`` (FULL_SHARD, transformer auto-wrap,
``cpu_offload=CPUOffload(offload_params=False)``), trained, saved with
``accelerator.save_state``, and resumed with ``load_state`` in fresh processes:

* fp32: every loss of the saved-and-resumed run equals accelerate's DDP run bit for bit
  (at 2 ranks our FULL_SHARD sums gradients as DDP does). Torch's own FSDP1 does not run
  on this path on CPU (it refuses accelerate's ``device_id=cpu``), so DDP is the reference;
* bf16 (mixed precision through the plugin): the resumed run equals the uninterrupted one
  bit for bit, and training makes progress.

``transformers.Trainer`` with ``fsdp="full_shard auto_wrap"`` (FSDP1) trains a GPT-2,
writes its checkpoints and resumes from one in fresh processes: the resumed losses equal
the uninterrupted run's bit for bit, and those equal the Trainer's DDP run within
``assert_close``'s defaults (the Trainer clips gradients by default, and the total norm is
summed over shards, in another order than over whole gradients).
"""

from __future__ import annotations

import accelerate  # noqa: F401 (a declared test dependency: a broken install fails, never skips)
import pytest
import torch

from tests.dist import hf_frameworks as hf
from tests.dist.harness import run_ranks

KINDS = ("gpt2", "llama")


def _first_processes(rank: int, world_size: int, folder: str) -> dict:
    import shardwrap

    hf.set_launcher_env(rank, world_size)
    out = {}
    for kind in KINDS:
        out[kind, "ddp"] = hf.train(
            rank, kind, fsdp=False, mixed_precision="no", first_step=0, num_steps=2 * hf.STEPS
        )
        shardwrap.install()
        try:
            for precision in ("no", "bf16"):
                out[kind, precision] = hf.train(
                    rank, kind, fsdp=True, mixed_precision=precision, first_step=0,
                    num_steps=hf.STEPS, save_to=f"{folder}/{kind}-{precision}",
                )  # fmt: skip
            out[kind, "bf16-straight"] = hf.train(
                rank, kind, fsdp=True, mixed_precision="bf16", first_step=0,
                num_steps=2 * hf.STEPS,
            )  # fmt: skip
        finally:
            shardwrap.uninstall()
    return out


def _resumed_processes(rank: int, world_size: int, folder: str) -> dict:
    import shardwrap

    hf.set_launcher_env(rank, world_size)
    shardwrap.install()
    try:
        return {
            (kind, precision): hf.train(
                rank,
                kind,
                fsdp=True,
                mixed_precision=precision,
                first_step=hf.STEPS,
                num_steps=hf.STEPS,
                load_from=f"{folder}/{kind}-{precision}",
            )  # fmt: skip
            for kind in KINDS
            for precision in ("no", "bf16")
        }
    finally:
        shardwrap.uninstall()


def test_accelerate_fsdp_trains_saves_and_resumes(tmp_path) -> None:
    first = run_ranks(_first_processes, 2, str(tmp_path))[0]
    resumed = run_ranks(_resumed_processes, 2, str(tmp_path))[0]
    for kind in KINDS:
        assert first[kind, "no"]["wrapper"] == "ShardedModule"
        assert first[kind, "no"]["num_fsdp"] == 3  # the root and two layers
        fp32 = first[kind, "no"]["losses"] + resumed[kind, "no"]["losses"]
        assert fp32 == first[kind, "ddp"]["losses"], kind
        bf16 = first[kind, "bf16"]["losses"] + resumed[kind, "bf16"]["losses"]
        assert bf16 == first[kind, "bf16-straight"]["losses"], kind
        assert bf16[-1] < bf16[0]


def _trainer_first(rank: int, world_size: int, folder: str) -> dict:
    import shardwrap

    hf.set_launcher_env(rank, world_size)
    ddp = hf.trainer_run(fsdp=False, output_dir=f"{folder}/ddp")
    shardwrap.install()
    try:
        return {"ddp": ddp, "fsdp": hf.trainer_run(fsdp=True, output_dir=f"{folder}/fsdp")}
    finally:
        shardwrap.uninstall()


def _trainer_resumed(rank: int, world_size: int, folder: str) -> list[float]:
    import shardwrap

    hf.set_launcher_env(rank, world_size)
    shardwrap.install()
    try:
        checkpoint = f"{folder}/fsdp/checkpoint-{hf.STEPS}"
        return hf.trainer_run(fsdp=True, output_dir=f"{folder}/fsdp", resume=checkpoint)
    finally:
        shardwrap.uninstall()


def test_trainer_fsdp_trains_checkpoints_and_resumes(tmp_path) -> None:
    first = run_ranks(_trainer_first, 2, str(tmp_path))[0]
    resumed = run_ranks(_trainer_resumed, 2, str(tmp_path))[0]
    assert len(first["ddp"]) == 2 * hf.STEPS
    torch.testing.assert_close(first["fsdp"], first["ddp"])
    assert resumed == first["fsdp"][hf.STEPS :]
