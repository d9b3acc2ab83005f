"""Ledger traffic of one pipeline step: ShardedPipelineStage against torch's PipelineStage.

    PYTHONPATH=$PWD python benchmarks/bench_pipeline.py --dim 256

4 gloo ranks (2 stages x 2 data-parallel ranks), the MLP of ``tests/dist/pipeline_cases``
(two ``Linear(dim, dim)`` units per stage), 4 micro-batches. Rank 0 (stage 0) prints, for
the last of 5 steps, the gradient reductions and all-gathers its ``ShardedModule`` recorded,
per strategy and schedule, with ZeRO-3's units kept gathered or not, and for torch's plain
``PipelineStage`` around the same ``ShardedModule`` (which reduces every micro-batch).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.dist import pipeline_cases as pc  # noqa: E402

WORLD, PP = 4, 2


def _row(counts: dict) -> tuple[int, int, int, int]:
    reductions = sum(counts["grad_reductions"].values())
    return reductions, counts["grad_bytes"], counts["gathers"], counts["gather_bytes"]


def _torch_stage_row(dim: int) -> tuple[int, int, int, int]:
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    mesh, (ours,), (module,) = pc.build_stages(PP, WORLD // PP, "FULL_SHARD", 1, False)
    first = ours.stage_index == 0
    example_in = torch.zeros(pc.MICRO_BATCH, dim, requires_grad=not first)
    example_out = torch.zeros(pc.MICRO_BATCH, dim, requires_grad=True)
    stage = PipelineStage(
        module,
        ours.stage_index,
        PP,
        torch.device("cpu"),
        input_args=(example_in,),
        output_args=(example_out,),
        group=mesh["pp"].get_group(),
    )
    schedule = ScheduleGPipe(stage, n_microbatches=pc.NUM_MICROBATCHES, loss_fn=F.mse_loss)
    for step in range(2):
        module.comm_ledger.reset()
        x, y = pc.local_batch(step, WORLD // PP, mesh["dp"].get_local_rank())
        schedule.step(*((x,) if first else ()), target=None if first else y)
    return _row(pc._ledger_counts(module))


def _worker(rank: int, init_file: str, dim: int) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    pc.DIM = dim
    rows = {}
    for strategy in ("SHARD_OPTIM", "SHARD_GRAD_OP", "FULL_SHARD"):
        for schedule in ("gpipe", "1f1b"):
            for keep in (False, True) if strategy == "FULL_SHARD" else (False,):
                counts = pc.train(WORLD, PP, strategy, schedule, keep)["counts"][-1][0]
                rows[f"ShardedPipelineStage {strategy} {schedule} keep={keep}"] = _row(counts)
    rows["torch PipelineStage FULL_SHARD gpipe"] = _torch_stage_row(dim)
    if rank == 0:
        print("| stage wrapped as | reductions | bytes reduced | all-gathers | bytes gathered |")
        print("|---|---|---|---|---|")
        for name, (reductions, grad_bytes, gathers, gather_bytes) in rows.items():
            print(f"| {name} | {reductions} | {grad_bytes:,} | {gathers} | {gather_bytes:,} |")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=256)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_worker, args=(os.path.join(folder, "init"), args.dim), nprocs=WORLD)


if __name__ == "__main__":
    main()
