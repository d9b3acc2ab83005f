"""Run under torchrun as one of two "nodes": HYBRID_SHARD parity with single-process training.

Shards inside a node (consecutive global ranks), replicates across nodes. Rank 0 writes the
reference losses to the JSON path given as the only argument; any mismatch raises and makes
torchrun exit non-zero.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from tests.dist.parity import Case, train_and_compare


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_world = int(os.environ["LOCAL_WORLD_SIZE"])  # set by torchrun, ranks per node
    results = {}
    for model in ("gpt", "mlp"):
        case = Case(strategy="HYBRID_SHARD", model=model, hybrid_shard_size=local_world)
        results[model] = train_and_compare(rank, world_size, case)
    if rank == 0:
        with open(sys.argv[1], "w") as f:
            json.dump({"world_size": world_size, "losses": results}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
