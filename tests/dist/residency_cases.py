"""How much of DiskOffload's state a rank holds resident, measured through training steps.

[Note: measuring what is resident of the offloaded state]
``DiskOffload`` keeps master shards, gradients and Adam state in shared mappings of files
in the store's directory (unlinked at once; shardwrap/offload/disk.py). A page of such a
mapping is resident in the process while its page-table entry is present: what a release
(``madvise(MADV_DONTNEED)``) takes away and the next access brings back, wherever the
file's pages sit (page cache: ``RssFile``; tmpfs: ``RssShmem``). ``/proc/self/maps`` names
the mappings of the store's files and ``/proc/self/pagemap`` says which of their pages are
present; the sum is the offloaded state the rank holds and nothing else (``RLIMIT_DATA``
and ``VmData`` count none of it, ``VmRSS`` the rest of the process too). Once per run the
count is checked against the kernel's own, the ``Rss:`` of the same mappings in
``/proc/self/smaps``, with every page touched (too slow to sample: it walks every mapping).

The rank samples it where shardwrap says it has released what it touched:

* ``materialised``: after wrapping (each shard was written into its file);
* ``forward``: at each unit's forward pre-hook, after its gather;
* ``backward``: at each unit's output gradient, before the unit's backward;
* ``after forward`` / ``after backward``: at the end of each pass;
* ``gradient norm``: between the clipping's pass over the gradients for the norm and its
  pass scaling them; ``clipped``: after ``clip_grad_norm_``;
* ``sub-group``: after each sub-group of a streamed step ([Note: a streamed optimizer
  step]), the streamed run only;
* ``loaded state``: after the step's pre-hook has put optimizer state that
  ``load_state_dict`` left in memory back into its files;
* ``after step``: after ``optimizer.step()``.

Runs: FULL_SHARD with a streamed step and with a step in one sub-group, and NO_SHARD
(streamed), where the module computes on the mapped shard itself.

The bound at a unit boundary in forward and backward is one unit's shard (``UNIT_BYTES``,
twice that under NO_SHARD; page-rounded): the shard of a gather issued ahead (backward prefetch) is
read by the
collective until it is waited for and released. Everywhere else it is zero: every place
that touched a buffer has released it, and a release covers whatever reading its tensor
can have mapped ([Note: fault-around] in shardwrap/base/pages.py). No slack: on Linux
6.18 (ext4, 4 KiB pages) every phase peaked at exactly its bound or at 0 (``pytest
tests/dist/test_beyond_ram.py``), and a kernel that maps more per touch (a fault-around
window set above 64 KiB, tmpfs with huge pages) does leave more resident. Linux only,
as the releases are. The model's offloaded state is ``4 * NUM_UNITS`` units (with a second gradient
buffer while accumulating, more), so a release that does nothing leaves several units
resident where it should have left none.

Negative controls (:func:`residency_without`): one release site at a time is made a
no-op, in the rank, for the calls from one library function, and the bound of the phase
that site serves must fail; and releases cut to the page (not widened to the fault-around
window) must break the bound between sub-groups.
"""

from __future__ import annotations

import contextlib
import copy
import mmap
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

import shardwrap
from shardwrap import flat_param
from shardwrap.base import pages
from shardwrap.base.pages import release_resident
from shardwrap.core import grads as grads_module
from shardwrap.features import grad_clip
from shardwrap.offload import disk, disk_step
from shardwrap.policies import ModuleWrapPolicy
from shardwrap.runtime import step as step_runtime

PAGE = mmap.PAGESIZE
WIDTH, NUM_UNITS = 256, 8
UNIT_BYTES = (WIDTH * WIDTH + WIDTH) * 4 // 2  # one unit's fp32 shard on each of 2 ranks
SUB_GROUP = UNIT_BYTES // 4 * 3 // 4  # elements: sub-groups cut units, at odd places
MICRO_BATCHES = (2, 1)  # per step; the second backward of the first adds to stored gradients
# (DiskOffload.sub_group_size, sharding strategy); under NO_SHARD the module computes on
# the shard itself, twice a FULL_SHARD unit's shard.
CONFIGS = {
    "streamed": (SUB_GROUP, "FULL_SHARD"),
    "one group": (1_000_000_000, "FULL_SHARD"),
    "no shard": (SUB_GROUP, "NO_SHARD"),
}

IN_FLIGHT_PHASES = ("forward", "backward")
QUIESCENT_PHASES = (
    "materialised",
    "after forward",
    "after backward",
    "gradient norm",
    "clipped",
    "sub-group",
    "loaded state",
    "after step",
)


def phases(config: str) -> set[str]:
    """The phases a run of ``config`` samples."""
    sampled = {*IN_FLIGHT_PHASES, *QUIESCENT_PHASES}
    return sampled if CONFIGS[config][0] == SUB_GROUP else sampled - {"sub-group"}


def bound(phase: str, config: str) -> int:
    """The most resident bytes of the offloaded state allowed in ``phase`` (see the Note)."""
    shard_bytes = UNIT_BYTES * (2 if CONFIGS[config][1] == "NO_SHARD" else 1)
    return -(-shard_bytes // PAGE) * PAGE if phase in IN_FLIGHT_PHASES else 0


def over_bound(peaks: dict[str, int], config: str) -> dict[str, int]:
    """The phases whose peak exceeds their bound, with the peak."""
    return {phase: peak for phase, peak in peaks.items() if peak > bound(phase, config)}


_MAPPING = re.compile(r"^[0-9a-f]+-[0-9a-f]+ ")  # a mapping's header line in smaps


def _mappings(directory: str) -> list[tuple[int, int]]:
    """``[start, end)`` addresses of this process's mappings of files in ``directory``."""
    prefix = directory.rstrip("/") + "/"
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5) if prefix in line else ()
            if len(fields) == 6 and fields[5].startswith(prefix):
                start, end = (int(address, 16) for address in fields[0].split("-"))
                ranges.append((start, end))
    return ranges


def offloaded_resident(directory: str) -> int:
    """Bytes of this process's mappings of files in ``directory`` that are resident."""
    present = 0
    with open("/proc/self/pagemap", "rb") as pagemap:
        for start, end in _mappings(directory):
            pagemap.seek(start // PAGE * 8)
            entries = bytearray(pagemap.read((end - start) // PAGE * 8))
            # Bit 63 of an entry: the page is present (negative as an int64).
            present += int((torch.frombuffer(entries, dtype=torch.int64) < 0).sum())
    return present * PAGE


def smaps_resident(directory: str) -> int:
    """The kernel's ``Rss:`` of the same mappings, from ``/proc/self/smaps``."""
    prefix = directory.rstrip("/") + "/"
    total, counting = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            if _MAPPING.match(line):
                fields = line.split(maxsplit=5)
                counting = len(fields) == 6 and fields[5].startswith(prefix)
            elif counting and line.startswith("Rss:"):
                total += int(line.split()[1]) * 1024
    return total


@dataclass
class Probe:
    """The most resident bytes of the offloaded state seen in each phase."""

    directory: str
    peaks: dict[str, int]

    def sample(self, phase: str) -> None:
        resident = offloaded_resident(self.directory)
        self.peaks[phase] = max(self.peaks.get(phase, 0), resident)


def _watch_units(model: nn.Module, probe: Probe) -> None:
    def on_output(module, args, output):
        if output.requires_grad:
            output.register_hook(lambda grad: probe.sample("backward"))

    for module in model.modules():
        if isinstance(module, nn.Linear):  # registered after the wrapper's: after its gather
            module.register_forward_pre_hook(lambda module, args: probe.sample("forward"))
            module.register_forward_hook(on_output)


@contextlib.contextmanager
def _sampled_after(owner: object, name: str, probe: Probe, phase: str) -> Iterator[None]:
    """``owner.name`` (a function or method) samples ``phase`` each time it returns."""
    original = getattr(owner, name)

    def sampled(*args, **kwargs):
        result = original(*args, **kwargs)
        probe.sample(phase)
        return result

    setattr(owner, name, sampled)
    try:
        yield
    finally:
        setattr(owner, name, original)


def _probes(probe: Probe) -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    stack.enter_context(_sampled_after(grad_clip, "sharded_grad_norm", probe, "gradient norm"))
    stack.enter_context(
        _sampled_after(disk_step.StreamedStep, "_step_sub_group", probe, "sub-group")
    )
    stack.enter_context(_sampled_after(disk.DiskStore, "place_state", probe, "loaded state"))
    return stack


def _reload_state(optim: torch.optim.Optimizer) -> None:
    """Round-trip the state through memory: the next step puts it back into its files."""
    saved = copy.deepcopy(optim.state_dict())
    for state in optim.state.values():  # what the copy read (the test did, not the library)
        for tensor in state.values():
            release_resident(tensor)
    optim.load_state_dict(saved)


def residency(rank: int, world_size: int, path: str, config: str, check_count: bool) -> dict:
    """Wrap, then one step per entry of ``MICRO_BATCHES`` with clipping; the phases' peaks.

    ``check_count``: at the end, touch every mapped buffer and return the count of resident
    bytes next to the kernel's (``counted``, ``smaps``).
    """
    torch.manual_seed(0)
    with torch.device("meta"):
        plain = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(NUM_UNITS)])
    sub_group_size, strategy = CONFIGS[config]
    model = shardwrap.ShardedModule(
        plain,
        auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
        sharding_strategy=strategy,
        cpu_offload=shardwrap.DiskOffload(path, sub_group_size),
    )
    store = model.disk_store
    probe = Probe(store.directory, {})
    probe.sample("materialised")
    _watch_units(model, probe)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    with _probes(probe):
        for step, micro_batches in enumerate(MICRO_BATCHES):
            for micro in range(micro_batches):
                seed = 1000 * rank + 10 * step + micro
                inputs = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(seed))
                loss = model(inputs).square().mean()
                probe.sample("after forward")
                loss.backward()
                probe.sample("after backward")
            model.clip_grad_norm_(0.5)
            probe.sample("clipped")
            optim.step()
            probe.sample("after step")
            optim.zero_grad()
            if step == 0:
                _reload_state(optim)
    result = {"peaks": probe.peaks, "mapped": store.num_bytes}
    if check_count:
        states = [t for s in optim.state.values() for t in s.values() if t.dim()]
        for tensor in [*model.parameters(), *states]:
            float(tensor.detach().sum())  # reads every page
        result.update(counted=offloaded_resident(store.directory))
        result.update(smaps=smaps_resident(store.directory))
    return result


def both_configs(rank: int, world_size: int, path: str) -> dict:
    """:func:`residency` of each of ``CONFIGS``, with the count checked."""
    return {config: residency(rank, world_size, path, config, True) for config in CONFIGS}


# Each site: the module whose ``release_resident`` it calls, the calling function, the
# config that uses it, and the phase whose bound it keeps.
RELEASE_SITES = {
    "materialisation": (flat_param, "_place_tensors", "streamed", "materialised"),
    "gather": (flat_param, "_finish_gather", "streamed", "forward"),
    "gradient store": (grads_module, "_stored", "streamed", "backward"),
    "gradient accumulation": (grads_module, "assign_grads", "streamed", "after backward"),
    "clipping norm": (grad_clip, "_partial", "streamed", "gradient norm"),
    "clipping scale": (grad_clip, "clip_grad_norm_", "streamed", "clipped"),
    "streamed step": (disk_step, "_step_sub_group", "streamed", "sub-group"),
    "loaded state": (disk, "place_state", "streamed", "loaded state"),
    "after step": (disk, "release_pages", "one group", "after step"),
    "computed in place": (step_runtime, "_release_at", "no shard", "after forward"),
}


@contextlib.contextmanager
def disabled_release(site: str) -> Iterator[None]:
    """``release_resident`` does nothing when ``site``'s function calls it."""
    module, caller, _, _ = RELEASE_SITES[site]
    original = module.release_resident

    def release_unless_from_site(tensor: torch.Tensor) -> None:
        if sys._getframe(1).f_code.co_name != caller:
            original(tensor)

    module.release_resident = release_unless_from_site
    try:
        yield
    finally:
        module.release_resident = original


def residency_without(rank: int, world_size: int, path: str, site: str) -> dict:
    """:func:`residency` of ``site``'s config with ``site``'s page release a no-op."""
    with disabled_release(site):
        return residency(rank, world_size, path, RELEASE_SITES[site][2], False)


def residency_with_page_exact_releases(rank: int, world_size: int, path: str) -> dict:
    """:func:`residency`, streamed, with releases not widened to the fault-around window."""
    original = pages._RELEASE_ALIGN
    pages._RELEASE_ALIGN = PAGE
    try:
        return residency(rank, world_size, path, "streamed", False)
    finally:
        pages._RELEASE_ALIGN = original
