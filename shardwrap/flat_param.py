"""One unit's parameters as a flat, sharded buffer, and its state machine.

The rest of a unit, by file: its gradients ``core/grads.py`` (``handle.grads``), the
``Unit`` record and its training states ``core/unit.py``, its dtypes ``core/precision.py``,
where its shard lives ``core/storage.py``; the layout's arithmetic ``layout/flat.py``,
which unit owns which parameter ``layout/partition.py``; the hooks that move it
``hooks.py``, a step across units ``runtime/step.py``.

[Note: two views of each parameter]
Every original parameter has two ``nn.Parameter`` objects, created once and kept for the
life of the handle:

* its *shard* view: this rank's piece of the parameter, a view into ``flat_shard``. It is
  what the module shows outside forward/backward, what the optimizer holds, and where
  reduced gradients land (``.grad``). Its identity never changes, so optimizer state stays
  attached.
* its *full* view: the whole parameter, a view into ``flat_full``. It is what the module
  shows while the unit computes; autograd accumulates local gradients into its ``.grad``.

``flat_full``'s storage is released (resized to 0) when the unit reshards and re-allocated
in place when it unshards, so the full views stay valid objects without holding memory.
With one shard, ``flat_full`` *is* ``flat_shard`` and nothing is ever gathered or freed,
unless mixed precision asks for a low-precision ``flat_full`` or ``CPUOffload`` keeps the
shard in host memory (``separate_full``; see ``[Note: mixed-precision data flow]`` in
``core/precision.py`` and ``[Note: host shards and staging]`` in ``offload/host.py``).

[Note: version counters]
Writing gathered data into ``flat_full`` must not bump its autograd version counter:
tensors saved for backward alias it, and the re-gather before backward writes the very
same values back. ``flat_shard``'s counter, on the other hand, tells us when the gathered
copy is stale: an in-place update of a shard view through autograd's in-place ops (a
for-loop or foreach optimizer step, a user edit under ``no_grad``) bumps the counter it
shares with ``flat_shard``.

[Note: optimizer steps that bump no version]
The counter alone is not enough. Fused optimizer kernels (``AdamW(fused=True)``, the
default choice of some frameworks on GPUs) write parameters without bumping their version
counters, so a gathered copy kept across the step (ZeRO-1, a low-precision or device copy
of a one-shard unit) looked current and the next forward computed with the parameters of
the step before. Every optimizer step over a handle's shard views therefore also counts
as an update: the optimizer's step post-hook calls :meth:`note_shard_updated`, and
the gathered copy is current only when both the counter and the number of such steps are
what they were when it was gathered (:attr:`shard_version`).
"""

from __future__ import annotations

import enum
from typing import Any

import torch
from torch import nn

from .base.pages import release_resident
from .base.torch_compat import preserve_version_counter
from .comm.collectives import ROOT_LABEL, Communicator
from .comm.user_comms import UserComms, gather_params
from .core.chunk_copy import copy_out, gather_full, landing_for, place_gathered, take_shard
from .core.comm_quant import UnitCommQuant
from .core.grads import UnitGrads
from .core.pending_gather import PendingGather
from .core.precision import HandlePrecision
from .core.storage import HostStorage, ShardAllocator, StagedShard
from .core.tensor_parallel import TPSpec, as_parameter, shard_dim_comms
from .layout.chunks import ChunkLayout
from .layout.flat import FlatLayout
from .layout.partition import ParamSite
from .options import ShardingStrategy

# (flat_shard's autograd version, optimizer steps over it); see FlatParamHandle.shard_version.
ShardVersion = tuple[int, int]


class ShardedState(enum.Enum):
    SHARDED = "SHARDED"  # module shows shard views; flat_full freed (or kept stale, ZeRO-1)
    UNSHARDED = "UNSHARDED"  # module shows full views; flat_full holds gathered parameters


class FlatParamHandle:
    """A unit's parameters: the flat shard and the gathered buffer (gradients: ``grads``)."""

    def __init__(
        self,
        *,
        unit_name: str,
        layout: FlatLayout | ChunkLayout,
        params: list[nn.Parameter],
        sites: list[list[ParamSite]],
        shard_comm: Communicator,
        replicate_comm: Communicator | None,
        strategy: ShardingStrategy,
        precision: HandlePrecision | None = None,
        shard_allocator: ShardAllocator | None = None,
        tp_specs: list[TPSpec | None] | None = None,
    ) -> None:
        _check_uniform(unit_name, layout, params)
        self.unit_name = unit_name
        # DTensor parameters' layouts; ``params`` are then their local blocks, see
        # [Note: ZeRO over tensor-parallel parameters] in core/tensor_parallel.py.
        self.tp_specs = list(tp_specs) if tp_specs is not None else [None] * len(params)
        # Per parameter: the TP mesh dims' communicators a gradient norm also sums over.
        self.tp_norm_comms = shard_dim_comms(self.tp_specs, shard_comm.ledger)
        self.layout = layout
        self.strategy = strategy
        self.shard_comm = shard_comm
        self.replicate_comm = replicate_comm
        # (module, attribute, parameter index) of every site (tied: several), for show_params.
        self.site_slots = [
            (site.module, site.attr, index)
            for index, param_sites in enumerate(sites)
            for site in param_sites
        ]
        self.state = ShardedState.UNSHARDED
        dtype, device = params[0].dtype, params[0].device
        self.dtype = dtype  # the shard's (master) dtype
        self.precision = precision  # None: compute and reduce in the master dtype
        self.compute_dtype = precision.param_dtype if precision else dtype
        self.reduce_dtype = precision.reduce_dtype if precision else dtype
        self.compute_device = device  # flat_full, local gradients and collectives
        # CPUOffload: the shard lives in host memory, see [Note: host shards and staging].
        self.host_staging = shard_allocator if isinstance(shard_allocator, HostStorage) else None
        # Whether flat_full is its own buffer (several shards, a low-precision or device copy).
        self.separate_full = (
            layout.num_shards > 1 or self.compute_dtype != dtype or self.host_staging is not None
        )
        pieces, flat_shard, flat_full = self._place_tensors(params, shard_allocator)
        self.pieces = pieces  # this rank's piece of each parameter
        # 1D, shard_numel elements; the same tensor as flat_full unless separate_full.
        self.flat_shard = flat_shard
        # 1D, padded, compute_dtype; storage released while resharded (if separate_full).
        self.flat_full = flat_full
        self.full_params = [self._make_full_view(i) for i in range(len(params))]
        self.shard_params = [self._make_shard_view(i) for i in range(len(params))]
        # Optimizer steps over the shard views; see [Note: optimizer steps that bump no version].
        self._num_shard_updates = 0
        self._gathered_version: ShardVersion | None = None  # shard_version at the last gather
        # The all-gather into flat_full issued ahead (prefetch, a bucket), not yet waited.
        self._pending: PendingGather | None = None
        # Fixed at wrap time, as the layout's flags are; a unit with none never reduces.
        self.wrapped_requires_grad = [info.requires_grad for info in layout.params]
        self.has_trainable_params = any(self.wrapped_requires_grad)
        self.grads = self._make_grads()
        self.comm_quant: UnitCommQuant | None = None  # ZeRO++ ([Note: ZeRO++ in a unit])
        self.user_comms = UserComms()  # FSDP2's set_custom_*: [Note: user communicators]
        self._to_sharded(free=True)  # a handle starts sharded, its gathered buffer freed

    def _place_tensors(
        self, params: list[nn.Parameter], shard_allocator: ShardAllocator | None
    ) -> tuple[list, torch.Tensor, torch.Tensor]:
        """Flatten ``params``: this rank's pieces, ``flat_shard`` and ``flat_full``."""
        layout, dtype, device = self.layout, self.dtype, self.compute_device
        flat_init = torch.zeros(layout.padded_numel, dtype=dtype, device=device)  # 1D, padded
        with torch.no_grad():
            for info, param in zip(layout.params, params, strict=True):
                flat_init[info.offset : info.end].copy_(param.detach().reshape(-1))
        # 1D, shard_numel elements; the same tensor as flat_full unless separate_full.
        rank = self.shard_comm.rank
        flat_shard = flat_init if self.num_shards == 1 else take_shard(layout, flat_init, rank)
        if shard_allocator is not None:  # the shard lives elsewhere (DiskOffload: a mapped file)
            placed = shard_allocator(self.unit_name, layout.shard_numel, dtype)
            with torch.no_grad():
                placed.copy_(flat_shard)
            release_resident(placed)  # [Note: releasing mapped pages where they are touched]
            flat_shard = placed
            if self.num_shards == 1 and self.host_staging is None:
                flat_init = placed
        flat_full = (
            flat_init  # released by the constructor's reshard when separate_full
            if self.compute_dtype == dtype
            else torch.empty(layout.padded_numel, dtype=self.compute_dtype, device=device)
        )
        return layout.pieces(self.shard_comm.rank), flat_shard, flat_full

    def _make_grads(self) -> UnitGrads:
        return UnitGrads(
            layout=self.layout,
            full_params=self.full_params,
            shard_params=self.shard_params,
            dtype=self.dtype,
            compute_dtype=self.compute_dtype,
            reduce_dtype=self.reduce_dtype,
            compute_device=self.compute_device,
            shard_comm=self.shard_comm,
            replicate_comm=self.replicate_comm,
            host_staging=self.host_staging,
            comm_label=self.comm_label,
            tp_specs=self.tp_specs,
        )

    # ------------------------------------------------------------------ views
    @property
    def num_shards(self) -> int:
        return self.layout.num_shards

    def _make_full_view(self, index: int) -> nn.Parameter:
        return self.full_param_of(self.flat_full, index)

    def full_param_of(self, flat: torch.Tensor, index: int) -> nn.Parameter:
        """Parameter ``index`` of ``flat`` (laid out like ``flat_full``) as the module shows
        it while computing: a ``DTensor`` for a tensor-parallel parameter."""
        info = self.layout.params[index]
        view = flat[info.offset : info.end].view(info.shape)
        return as_parameter(view, self.tp_specs[index], info.requires_grad)

    def _make_shard_view(self, index: int) -> nn.Parameter:
        view = self.shard_view(self.flat_shard, index)
        return nn.Parameter(view, requires_grad=self.layout.params[index].requires_grad)

    def shard_view(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        """Parameter ``index``'s part of ``flat``, a buffer laid out like this rank's shard.

        A 1-D piece, or the parameter's own shape when there is a single shard.
        """
        info = self.layout.params[index]
        if self.num_shards == 1:
            return flat[info.offset : info.end].view(info.shape)
        piece = self.pieces[index]
        return flat[piece.shard_start : piece.shard_end]

    def shown_params(self) -> list[nn.Parameter]:
        """The parameter the module shows now at each index (tied ones once)."""
        seen: dict[int, nn.Parameter] = {}
        for module, attr, index in self.site_slots:
            seen.setdefault(index, module._parameters[attr])
        return [seen[i] for i in sorted(seen)]

    def show_params(self, params: list[nn.Parameter]) -> None:
        """Register ``params`` (``full_params`` or ``shard_params``, or a summon's copies) at
        every site. Twice per unit and step: one flat loop, no call per site."""
        for module, attr, index in self.site_slots:
            module._parameters[attr] = params[index]

    @property
    def comm_label(self) -> str:
        """The unit's name as its collectives are recorded."""
        return self.unit_name or ROOT_LABEL

    def rename(self, prefix: str) -> None:
        """Prefix every parameter name (the unit was adopted by an enclosing root)."""
        self.unit_name = f"{prefix}.{self.unit_name}" if self.unit_name else prefix
        self.layout = self.layout.with_prefix(prefix)
        self.grads.rename(self.layout, self.comm_label)

    # ------------------------------------------------------------ transitions
    @property
    def full_is_current(self) -> bool:
        return self._gathered_version == self.shard_version

    @property
    def shard_version(self) -> ShardVersion:
        """Changes whenever the shard may have changed: ``flat_shard``'s autograd version
        and the number of optimizer steps over it ([Note: optimizer steps that bump no
        version]).
        """
        return (self.flat_shard._version, self._num_shard_updates)

    def note_shard_updated(self) -> None:
        """An optimizer stepped this handle's shard views: the gathered copy is stale."""
        self._num_shard_updates += 1

    def unshard(self) -> None:
        """Gather the full parameters (if stale), show them (only runtime/step.py calls it)."""
        if self.state is ShardedState.UNSHARDED and self.full_is_current:
            return
        self.start_unshard()
        self._finish_gather()
        if not self.full_is_current:  # the shard changed after a prefetch was issued
            self.start_unshard()
            self._finish_gather()
        self.show_params(self.full_params)
        self.state = ShardedState.UNSHARDED

    def start_unshard(self) -> None:
        """Issue the all-gather of a stale copy without waiting (prefetch).

        :meth:`unshard` completes it; until then ``flat_full`` must not be read.
        """
        if self._pending is not None or self.full_is_current:
            return
        version = self.shard_version
        if not self.separate_full:  # flat_full is the shard itself
            self._gathered_version = version
            return
        self._allocate_full()
        shard, staged = self.gather_source()
        guard = preserve_version_counter(self.flat_full)
        user = self.user_comms.all_gather if self.shard_comm.size > 1 else None
        if user is not None:  # [Note: user communicators] in comm/user_comms.py
            with guard:
                numel = self.layout.gathered_numel
                work, landing = gather_params(
                    self.shard_comm, user, shard, numel, unit=self.comm_label
                )
            self._pending = PendingGather(work, version, guard, shard, staged, landing)
            return
        with guard:
            if self.comm_quant is not None:
                landing = landing_for(self.layout, self.flat_full)  # None: into flat_full
                target = self.flat_full if landing is None else landing
                work = self.comm_quant.gather(
                    self.shard_comm, target, shard, version=version, unit=self.comm_label
                )
            else:
                args = (self.shard_comm, self.layout, self.flat_full, shard)
                work, landing = gather_full(*args, unit=self.comm_label)
        self._pending = PendingGather(work, version, guard, shard, staged, landing)

    def _finish_gather(self) -> None:
        pending = self._pending
        if pending is None:
            return
        # The collective bumps flat_full's version whenever it lands (on gloo, on its own
        # thread): restore the version from before it was issued, see [Note: version counters].
        with pending.version_guard:
            pending.work.wait()
            if pending.landing is not None:
                copy_out(self.layout, pending.landing, self.flat_full)
        if pending.staged is not None:  # [Note: asynchronous copies from pinned memory]
            pending.staged.wait_copied()
        self._pending = None
        self._gathered_version = pending.version
        # The gather has read the shard: [Note: releasing mapped pages where they are touched]
        release_resident(self.flat_shard)

    def _allocate_full(self) -> None:
        """Give ``flat_full`` its storage back if a reshard released it."""
        storage = self.flat_full.untyped_storage()
        needed = self.flat_full.numel() * self.flat_full.element_size()
        if storage.size() != needed:
            storage.resize_(needed)

    def gather_source(self) -> tuple[torch.Tensor, StagedShard | None]:
        """The all-gather's input: the shard in compute_dtype, on the compute device, and
        (CPUOffload) the staged copy whose end the gather's wait must see.

        Cast before gathering, so the collective moves compute_dtype bytes.
        """
        if self.host_staging is None:
            return self.flat_shard.detach().to(self.compute_dtype), None
        staged = self.host_staging.to_device(
            self.flat_shard.detach(), self.compute_device, self.compute_dtype
        )
        return staged.tensor, staged

    @property
    def gather_in_flight(self) -> bool:
        return self._pending is not None

    def accept_gathered(self, full_by_rank: torch.Tensor, *, version: ShardVersion) -> None:
        """Take the gathered parameters from a fused all-gather ([Note: all-gather buckets]).

        ``full_by_rank``: ``(num_shards, shard_numel)``, rank r's shard in row r;
        ``version``: :attr:`shard_version` when the shards were read.
        """
        self._allocate_full()
        # As for a plain all-gather: see [Note: version counters].
        with torch.no_grad(), preserve_version_counter(self.flat_full):
            place_gathered(self.layout, full_by_rank, self.flat_full)
        self._gathered_version = version

    def adopt_gather(self, work: Any, *, version: ShardVersion, staged: StagedShard | None) -> None:
        """Make ``work``, a fused all-gather in flight that fills ``flat_full`` through
        :meth:`accept_gathered`, this unit's gather in flight ([Note: all-gather buckets]).
        ``staged``: what :meth:`gather_source` returned with this handle's input.
        """
        guard = preserve_version_counter(self.flat_full)
        self._pending = PendingGather(work, version, guard, None, staged)

    def reshard(self, *, free: bool, stale: bool = False) -> None:
        """Show the shard views; free the gathered storage if ``free``, or keep it with its
        values stale (gathered again next time) if ``stale`` (runtime/step.py's call)."""
        self._to_sharded(free=free, stale=stale)

    def _to_sharded(self, *, free: bool, stale: bool = False) -> None:
        self.show_params(self.shard_params)
        self.state = ShardedState.SHARDED
        if not self.separate_full:  # the module computed on the shard (DiskOffload: a file)
            release_resident(self.flat_shard)
        if (free or stale) and self.separate_full:
            self._finish_gather()  # never release storage under an all-gather in flight
            if self.comm_quant is not None:  # hpZ
                self.comm_quant.keep_secondary(self.layout, self.flat_full, self._current_version())
            if free:
                self.flat_full.untyped_storage().resize_(0)
            self._gathered_version = None

    def _current_version(self) -> ShardVersion | None:
        return self._gathered_version if self.full_is_current else None

    @property
    def full_storage_bytes(self) -> int:
        """Bytes currently held by the gathered buffer (0 once released)."""
        if not self.separate_full:
            return 0
        return self.flat_full.untyped_storage().size()


def _check_uniform(unit_name: str, layout: FlatLayout, params: list[nn.Parameter]) -> None:
    dtypes = {p.dtype for p in params}
    if len(dtypes) > 1:
        what = ", ".join(f"{i.fqn}: {p.dtype}" for i, p in zip(layout.params, params, strict=True))
        raise ValueError(f"unit {unit_name!r}: parameters of mixed dtypes ({what})")


def holds_shards_of(optimizer: torch.optim.Optimizer, handles: list[FlatParamHandle]) -> bool:
    """Whether ``optimizer`` updates any shard view of ``handles``."""
    mine = {id(p) for h in handles for p in h.shard_params}
    return any(id(p) in mine for g in optimizer.param_groups for p in g["params"])
