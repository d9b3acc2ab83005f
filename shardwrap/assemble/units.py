"""Building a unit: flatten the parameters it owns into a handle (``layout/partition.py`` decides
which parameters it owns)."""

from __future__ import annotations

from torch import nn

from ..comm.collectives import Communicator
from ..core.precision import handle_precision
from ..core.storage import ShardAllocator
from ..core.tensor_parallel import local_tensor, tp_spec_of
from ..core.unit import Unit
from ..flat_param import FlatParamHandle
from ..layout.flat import FlatLayout
from ..layout.partition import ParamRecord
from ..layout.shard_layout import LayoutBuilder
from ..options import MixedPrecision, ShardingStrategy


def build_unit(
    *,
    name: str,
    module: nn.Module,
    records: list[ParamRecord],
    shard_comm: Communicator,
    replicate_comm: Communicator | None,
    strategy: ShardingStrategy,
    mixed_precision: MixedPrecision | None = None,
    shard_allocator: ShardAllocator | None = None,
    make_layout: LayoutBuilder = FlatLayout.build,
) -> Unit:
    """Flatten ``records`` into one handle (none if empty) and make the unit.

    ``make_layout``: ``FlatLayout.build`` (the FSDP1 and DeepSpeed doors) or
    ``ChunkLayout.build`` (the FSDP2 door's dim-0 chunks, ``layout/chunks.py``).
    """
    handle = None
    if records:
        # DTensor parameters are flattened as their local blocks: [Note: ZeRO over
        # tensor-parallel parameters] in core/tensor_parallel.py.
        specs = [tp_spec_of(r.fqn, r.param) for r in records]
        params = [local_tensor(r.param) for r in records]
        layout = make_layout(
            [
                (r.fqn, tuple(p.shape), r.param.requires_grad)
                for r, p in zip(records, params, strict=True)
            ],
            shard_comm.size,
        )
        handle = FlatParamHandle(
            unit_name=name,
            layout=layout,
            params=params,
            tp_specs=specs,
            sites=[r.sites for r in records],
            shard_comm=shard_comm,
            replicate_comm=replicate_comm,
            strategy=strategy,
            precision=handle_precision(mixed_precision, records[0].param.dtype),
            shard_allocator=shard_allocator,
        )
    return Unit(name=name, module=module, handle=handle, strategy=strategy)
