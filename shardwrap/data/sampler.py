"""A batch sampler whose global sample order does not depend on the number of ranks.

[Note: world-independent data order]
An epoch's order is one permutation of ``range(num_samples)``, drawn from ``(seed, epoch)``
only. The order is cut into global batches of ``global_batch_size`` consecutive positions
(a last, partial batch is dropped: ranks must step together); rank ``r`` of ``W`` takes
the ``r``-th of ``W`` equal consecutive slices of each global batch. Concatenating the
ranks' batches in rank order gives the global batch, whatever ``W`` is.

The position is one number, the samples of the epoch consumed by all ranks together, so
it means the same at any world size: a run saved after ``k`` steps at 2 ranks and resumed
at 3 continues at position ``k * global_batch_size`` of the same order. The arithmetic is
in pure functions below (unit- and property-tested); the class only keeps the position.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Sampler

from ..base.validate import check_bool, check_int

STATE_VERSION = 1
# Keys of a saved state that must equal the sampler's own: another value means another
# order, so continuing at the saved position would repeat or skip samples.
FIXED_KEYS = ("num_samples", "seed", "shuffle")


# ------------------------------------------------------------------ pure arithmetic
def local_batch_size(global_batch_size: int, world_size: int) -> int:
    """Each rank's share of a global batch; the global batch must divide evenly."""
    if global_batch_size % world_size:
        raise ValueError(
            f"global_batch_size: {global_batch_size} does not divide by world_size "
            f"{world_size}; every rank must take the same number of samples per step "
            f"(use a multiple of {world_size})"
        )
    return global_batch_size // world_size


def epoch_seed(seed: int, epoch: int) -> int:
    """The generator seed of one epoch's permutation: a hash, so (seed, epoch) pairs differ."""
    digest = hashlib.sha256(f"shardwrap-sampler:{seed}:{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def epoch_order(num_samples: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """The global order of one epoch's samples (the same on every rank and world size)."""
    if not shuffle:
        return list(range(num_samples))
    generator = torch.Generator().manual_seed(epoch_seed(seed, epoch))
    return torch.randperm(num_samples, generator=generator).tolist()


def rank_span(position: int, global_batch_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """Positions ``[start, end)`` of the epoch's order that ``rank`` takes of the global
    batch starting at ``position``."""
    local = local_batch_size(global_batch_size, world_size)
    start = position + rank * local
    return start, start + local


def batches_left(num_samples: int, position: int, global_batch_size: int) -> int:
    """Whole global batches left in the epoch from ``position`` (a partial one is dropped)."""
    return max(num_samples - position, 0) // global_batch_size


# --------------------------------------------------------------------- the sampler
class ResumableSampler(Sampler[list[int]]):
    """Yields this rank's list of sample indices for each step: a ``batch_sampler``.

    ``DataLoader(dataset, batch_sampler=ResumableSampler(len(dataset), global_batch_size=B,
    rank=r, world_size=W, seed=s))`` gives each rank ``B // W`` samples per step; see
    [Note: world-independent data order]. The position counts the batches handed out, so
    it is exact with ``num_workers=0``; a loader with workers fetches batches ahead, and
    then the position is ahead of the training loop (set it with :meth:`seek`).

    An epoch that runs to its end moves the sampler to the next epoch. ``set_epoch(e)``
    with another epoch starts ``e`` from its beginning; with the current one it keeps the
    position (so a resumed loop may call it as an uninterrupted one does).
    """

    def __init__(
        self,
        num_samples: int,
        *,
        global_batch_size: int,
        rank: int,
        world_size: int,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        self.num_samples = check_int("num_samples", num_samples, minimum=1)
        self.global_batch_size = check_int("global_batch_size", global_batch_size, minimum=1)
        self.world_size = check_int("world_size", world_size, minimum=1)
        self.rank = check_int("rank", rank, minimum=0)
        if rank >= world_size:
            raise ValueError(f"rank: must be < world_size {world_size}, got {rank}")
        self.local_batch_size = local_batch_size(global_batch_size, world_size)
        self.seed = check_int("seed", seed, minimum=0)
        self.shuffle = check_bool("shuffle", shuffle)
        self.epoch = 0
        self.position = 0  # samples of this epoch consumed by all ranks together

    def __len__(self) -> int:
        """The batches left in the current epoch."""
        return batches_left(self.num_samples, self.position, self.global_batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        order = epoch_order(self.num_samples, self.seed, self.epoch, self.shuffle)
        while batches_left(self.num_samples, self.position, self.global_batch_size):
            start, end = rank_span(
                self.position, self.global_batch_size, self.rank, self.world_size
            )
            self.position += self.global_batch_size
            yield order[start:end]
        self.epoch += 1
        self.position = 0

    def set_epoch(self, epoch: int) -> None:
        check_int("epoch", epoch, minimum=0)
        if epoch != self.epoch:
            self.epoch, self.position = epoch, 0

    def seek(self, epoch: int, position: int) -> None:
        """Continue at ``position`` (samples consumed by all ranks) of ``epoch``."""
        check_int("epoch", epoch, minimum=0)
        check_int("position", position, minimum=0)
        if position > self.num_samples:
            raise ValueError(f"position: {position} is past num_samples {self.num_samples}")
        self.epoch, self.position = epoch, position

    def state_dict(self) -> dict[str, Any]:
        """JSON: the order's inputs and the global position (no world size: it need not match)."""
        return {
            "version": STATE_VERSION,
            "num_samples": self.num_samples,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "global_batch_size": self.global_batch_size,
            "epoch": self.epoch,
            "position": self.position,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where ``state`` was saved, at this sampler's rank and world size.

        The order's inputs must match; a different ``global_batch_size`` is allowed (the
        next batches start at the saved position of the same order).
        """
        if not isinstance(state, dict):
            raise TypeError(f"state: expected a dict, got {type(state).__name__}")
        if state.get("version") != STATE_VERSION:
            raise ValueError(
                f"state['version']: {state.get('version')!r}, this sampler reads {STATE_VERSION}"
            )
        for key in (*FIXED_KEYS, "epoch", "position"):
            if key not in state:
                raise ValueError(f"state: key {key!r} is missing")
        for key in FIXED_KEYS:
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"state[{key!r}]: saved {state[key]!r}, this sampler has "
                    f"{getattr(self, key)!r}; another order would repeat or skip samples"
                )
        self.seek(state["epoch"], state["position"])
