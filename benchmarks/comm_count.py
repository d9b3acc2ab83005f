"""Count the bytes every implementation sends into ``torch.distributed`` collectives.

A benchmark-only shim: it wraps the public collective functions of ``torch.distributed``
(and of ``distributed_c10d``, where they live) so that each call while counting is on adds
the bytes of this rank's input to a per-kind total. Nested calls (a deprecated alias
calling its successor) are counted once. Collectives issued from C++ (DDP's built-in
reducer) are invisible here, so the benchmark gives DDP the stock Python all-reduce hook.
Point-to-point sends (``ProcessGroup.send``, which ``isend`` and shardwrap's pairwise gloo
collectives call) count as kind ``"send"``: their bytes are already bytes on the wire.
"""

from __future__ import annotations

import functools
import threading
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d


def _nbytes(t) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return 0


# kind -> (name in torch.distributed, function giving this rank's input bytes from the args)
_INPUTS = {
    "all_reduce": ("all_reduce", lambda a, k: _nbytes(k.get("tensor", a[0] if a else None))),
    "all_gather_into_tensor": ("all_gather", lambda a, k: _nbytes(_arg(a, k, 1, "input_tensor"))),
    "_all_gather_base": ("all_gather", lambda a, k: _nbytes(_arg(a, k, 1, "input_tensor"))),
    "all_gather_single": ("all_gather", lambda a, k: _nbytes(_arg(a, k, 1, "input_tensor"))),
    "all_gather": ("all_gather", lambda a, k: _nbytes(_arg(a, k, 1, "tensor"))),
    "reduce_scatter_tensor": ("reduce_scatter", lambda a, k: _nbytes(_arg(a, k, 1, "input"))),
    "_reduce_scatter_base": ("reduce_scatter", lambda a, k: _nbytes(_arg(a, k, 1, "input"))),
    "reduce_scatter_single": ("reduce_scatter", lambda a, k: _nbytes(_arg(a, k, 1, "input"))),
    "reduce_scatter": ("reduce_scatter", lambda a, k: _nbytes(_arg(a, k, 1, "input_list"))),
    "broadcast": ("broadcast", lambda a, k: _nbytes(_arg(a, k, 0, "tensor"))),
    "reduce": ("reduce", lambda a, k: _nbytes(_arg(a, k, 0, "tensor"))),
    "all_to_all_single": ("all_to_all", lambda a, k: _nbytes(_arg(a, k, 1, "input"))),
    "all_gather_object": ("all_gather_object", lambda a, k: 0),
}


def _arg(args, kwargs, index: int, name: str):
    if name in kwargs:
        return kwargs[name]
    return args[index] if len(args) > index else None


class CollectiveCounter:
    """Per-kind ``[count, bytes]`` of collectives issued while ``counting`` is true."""

    def __init__(self) -> None:
        self.counting = False
        self.totals: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        self._depth = threading.local()

    def reset(self) -> dict[str, tuple[int, int]]:
        """Return the totals so far and start again from zero."""
        out = {kind: (c, b) for kind, (c, b) in self.totals.items()}
        self.totals.clear()
        return out

    def install(self) -> None:
        """Wrap the collectives (call once per process, before building any model)."""
        for name, (kind, input_bytes) in _INPUTS.items():
            original = getattr(c10d, name, None)
            if original is None:
                continue
            wrapped = self._wrap(original, kind, input_bytes)
            setattr(c10d, name, wrapped)
            if getattr(dist, name, None) is original:
                setattr(dist, name, wrapped)
        send = dist.ProcessGroup.send
        dist.ProcessGroup.send = self._wrap(
            send, "send", lambda a, k: _nbytes(_arg(a, k, 1, "tensors"))
        )

    def _wrap(self, original, kind: str, input_bytes):
        @functools.wraps(original)
        def counted(*args, **kwargs):
            depth = getattr(self._depth, "value", 0)
            if self.counting and depth == 0:
                entry = self.totals[kind]
                entry[0] += 1
                entry[1] += input_bytes(args, kwargs)
            self._depth.value = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth.value = depth

        return counted
