"""A rank's random number streams and data position: taken, encoded as JSON, decoded,
restored (the ``rng`` and ``data`` of a run state file: [Note: run state files] in
``run_state.py``)."""

from __future__ import annotations

import base64
import hashlib
import json
import random
import sys
from dataclasses import dataclass
from typing import Any

import torch

from .format import CheckpointError


def _b64(tensor: torch.Tensor) -> str:
    return base64.b64encode(tensor.cpu().contiguous().numpy().tobytes()).decode("ascii")


def _unb64(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text, validate=True)), dtype=torch.uint8)


@dataclass(frozen=True)
class RunSnapshot:
    """A rank's generator states and data position as of one moment, not yet encoded: an
    asynchronous save takes it on the caller's thread (a few small copies) and encodes it
    on its background thread, once the save id is known."""

    torch_cpu: torch.Tensor
    accelerator: tuple[str, torch.Tensor] | None  # (device type, state)
    python: tuple  # random.getstate() (immutable)
    numpy: tuple | None  # numpy.random.get_state(legacy=True), when NumPy is imported
    data_text: str  # the sampler's state_dict() as JSON text ("null" without a sampler)


def snapshot_run(sampler: Any) -> RunSnapshot:
    """This process's generators and ``sampler``'s position, as of now."""
    data = sampler.state_dict() if sampler is not None else None
    try:
        data_text = json.dumps(data)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"sampler: state_dict() must be JSON-serialisable ({exc})") from exc
    accelerator = None
    if torch.accelerator.is_available():
        kind = torch.accelerator.current_accelerator().type
        index = torch.accelerator.current_device_index()
        accelerator = (kind, torch.get_device_module(kind).get_rng_state(index))
    numpy = sys.modules.get("numpy")
    numpy_state = numpy.random.get_state(legacy=True) if numpy is not None else None
    return RunSnapshot(
        torch.get_rng_state(), accelerator, random.getstate(), numpy_state, data_text
    )


def rng_json(snapshot: RunSnapshot) -> dict[str, Any]:
    """The generator states of ``snapshot``, as JSON."""
    version, internal, gauss = snapshot.python
    state: dict[str, Any] = {
        "torch_cpu": _b64(snapshot.torch_cpu),
        "accelerator": None,
        "python": [version, list(internal), gauss],
        "numpy": None,
    }
    if snapshot.accelerator is not None:
        kind, accelerator_state = snapshot.accelerator
        state["accelerator"] = {"type": kind, "state": _b64(accelerator_state)}
    if snapshot.numpy is not None:
        name, key, pos, has_gauss, cached = snapshot.numpy
        state["numpy"] = [name, [int(k) for k in key], int(pos), int(has_gauss), float(cached)]
    return state


@dataclass(frozen=True)
class Streams:
    """Decoded generator states, checked before any is set."""

    torch_cpu: torch.Tensor
    accelerator: tuple[str, torch.Tensor] | None
    python: tuple
    numpy: tuple | None

    @staticmethod
    def decode(raw: Any, where: str) -> Streams:
        try:
            accel = raw["accelerator"]
            numpy = raw["numpy"]
            version, internal, gauss = raw["python"]
            streams = Streams(
                _unb64(raw["torch_cpu"]),
                None if accel is None else (str(accel["type"]), _unb64(accel["state"])),
                (int(version), tuple(int(x) for x in internal), gauss),
                None if numpy is None else (str(numpy[0]), list(numpy[1]), *numpy[2:]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{where}: key 'rng' is malformed: {exc!r}") from exc
        # Sizes are checked now: a state that set_state refuses must fail the load on
        # every rank, not one rank after the others went on.
        sizes = {
            "torch_cpu": (streams.torch_cpu.numel(), torch.get_rng_state().numel()),
            "python": (len(streams.python[1]), len(random.getstate()[1])),
        }
        if streams.numpy is not None:
            sizes["numpy"] = (len(streams.numpy[1]) if len(streams.numpy) == 5 else -1, 624)
        if not (gauss is None or isinstance(gauss, float)):
            sizes["python"] = (-1, 0)
        for key, (got, want) in sizes.items():
            if got != want:
                raise CheckpointError(f"{where}: key 'rng.{key}' has the wrong size or form")
        return streams

    def restore(self) -> None:
        torch.set_rng_state(self.torch_cpu)
        random.setstate(self.python)
        if self.accelerator is not None and torch.accelerator.is_available():
            kind, state = self.accelerator
            if kind == torch.accelerator.current_accelerator().type:
                index = torch.accelerator.current_device_index()
                torch.get_device_module(kind).set_rng_state(state, index)
        if self.numpy is not None:
            import numpy

            name, key, *rest = self.numpy
            numpy.random.set_state((name, numpy.asarray(key, dtype=numpy.uint32), *rest))


def derive_rng(base_digest: str, rank: int) -> None:
    """Seed every generator of a rank the checkpoint did not have (see the note)."""
    digest = hashlib.sha256(f"{base_digest}:{rank}".encode()).digest()
    seed = int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)
    torch.manual_seed(seed)  # also every accelerator's generator
    random.seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed % (1 << 32))
