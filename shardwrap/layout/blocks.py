"""Pure arithmetic of tensor-parallel blocks: which part of a global tensor a rank holds.

A parameter that ``torch.distributed.tensor.parallel`` made a ``DTensor`` holds, on each
rank, one rectangular *block* of the global tensor: along every tensor dimension that a
``Shard(d)`` placement splits, ``torch.chunk``'s piece for this rank's mesh coordinate
(``ceil(size / n)`` elements per rank, the last ranks short or empty); whole along the
others. shardwrap flattens that block (row-major) into its unit's flat buffer.

A checkpoint stores 1-D element ranges of the *global* tensor flattened
([Note: checkpoint layout] in ``ckpt/format.py``). A range of the block's flattening is
in general not one range of the global flattening (a ``Shard(1)`` block's rows lie apart),
so :func:`block_runs` cuts it into the longest runs that are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def chunk_span(size: int, num_chunks: int, index: int) -> tuple[int, int]:
    """``(offset, length)`` of ``torch.chunk``'s piece ``index`` of ``size`` elements in
    ``num_chunks`` chunks (a piece past the end is empty, at offset ``size``)."""
    if size < 0 or num_chunks < 1 or not 0 <= index < num_chunks:
        raise ValueError(f"chunk_span: bad arguments {size=}, {num_chunks=}, {index=}")
    step = -(-size // num_chunks) if size else 0
    start = min(size, index * step)
    return start, min(size, start + step) - start


@dataclass(frozen=True, slots=True)
class Block:
    """The block of a global tensor that one rank holds: offset and length per dimension."""

    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    shape: tuple[int, ...]  # the local tensor's shape

    def __post_init__(self) -> None:
        if not len(self.global_shape) == len(self.offsets) == len(self.shape):
            raise ValueError(f"Block: dimensions differ in {self}")
        for size, offset, length in zip(self.global_shape, self.offsets, self.shape, strict=True):
            if offset < 0 or length < 0 or offset + length > size:
                raise ValueError(f"Block: {self} leaves the global shape")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def is_whole(self) -> bool:
        return self.shape == self.global_shape


def sharded_block(global_shape: tuple[int, ...], shards: list[tuple[int, int, int]]) -> Block:
    """The block that ``shards`` cut: ``(tensor dim, number of chunks, chunk index)`` each,
    one per mesh dimension that shards (a tensor dim sharded twice is refused)."""
    offsets = [0] * len(global_shape)
    shape = list(global_shape)
    seen: set[int] = set()
    for dim, num_chunks, index in shards:
        if dim in seen:
            raise ValueError(f"sharded_block: tensor dim {dim} is sharded over two mesh dims")
        seen.add(dim)
        offsets[dim], shape[dim] = chunk_span(global_shape[dim], num_chunks, index)
    return Block(tuple(global_shape), tuple(offsets), tuple(shape))


def _strides(shape: tuple[int, ...]) -> list[int]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return strides[::-1]


def block_runs(block: Block, start: int, end: int) -> list[tuple[int, int, int]]:
    """Elements ``[start, end)`` of ``block`` flattened, as ``(local_start, local_end,
    global_start)`` runs: each contiguous in the global tensor flattened, in order, merged
    where they meet."""
    if not 0 <= start <= end <= block.numel:
        raise ValueError(f"block_runs: range [{start}, {end}) outside {block.numel} elements")
    if start == end:
        return []
    if not block.shape:  # 0-dim: the block is the tensor
        return [(start, end, start)]
    # The innermost dimensions the block holds whole (and the one inside them) make runs.
    row = 1
    inner = len(block.shape)
    while inner > 0:
        inner -= 1
        row *= block.shape[inner]
        if block.shape[inner] != block.global_shape[inner]:
            break
    local_strides = _strides(block.shape)
    global_strides = _strides(block.global_shape)
    runs: list[tuple[int, int, int]] = []
    position = start
    while position < end:
        row_start = position - position % row
        run_end = min(end, row_start + row)
        global_start = _global_index(position, block, local_strides, global_strides)
        last = runs[-1] if runs else None
        if last and last[1] == position and last[2] + position - last[0] == global_start:
            runs[-1] = (last[0], run_end, last[2])
        else:
            runs.append((position, run_end, global_start))
        position = run_end
    return runs


def _global_index(
    local: int, block: Block, local_strides: list[int], global_strides: list[int]
) -> int:
    index = 0
    for offset, local_stride, global_stride in zip(
        block.offsets, local_strides, global_strides, strict=True
    ):
        coordinate, local = divmod(local, local_stride)
        index += (coordinate + offset) * global_stride
    return index
