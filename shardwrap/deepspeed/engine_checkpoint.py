"""DeepSpeed-style checkpoint directories on top of :mod:`shardwrap.checkpoint`.

``save_dir/<tag>/`` holds one of our sharded checkpoints (loadable on any number of
ranks); ``save_dir/latest`` holds the newest tag as text, as DeepSpeed writes it. The
engine's counters, the scheduler's state and the user's ``client_state`` travel in the
checkpoint's ``extra`` record; every rank's random number generators in its run state file
(restored unless ``load_module_only``).
"""

from __future__ import annotations

import functools
import os
from typing import Any, Protocol

import torch
from torch import nn

from .. import checkpoint
from ..ckpt.async_save import AsyncSave

LATEST_FILE = "latest"


class CheckpointedEngine(Protocol):
    """What a checkpoint saves and restores of an engine (``engine.ShardedEngine``)."""

    module: nn.Module  # the ShardedModule
    optimizer: torch.optim.Optimizer
    lr_scheduler: Any  # None, or an object with state_dict/load_state_dict
    loss_scaler: Any  # None, or the fp16 loss scaler
    global_steps: int
    micro_steps: int
    skipped_steps: int


def _check_tag(tag: object) -> str:
    if not isinstance(tag, str) or not tag or tag in (".", "..") or os.sep in tag:
        raise ValueError(f"tag: expected a plain directory name, got {tag!r}")
    return tag


def save(
    engine: CheckpointedEngine,
    save_dir: str | os.PathLike,
    tag: str | None,
    client_state: dict,
    save_latest: bool,
    asynchronous: bool = False,
) -> tuple[str, AsyncSave | None]:
    """Save under ``save_dir/tag``; the path, and the handle of an asynchronous save."""
    tag = _check_tag(f"global_step{engine.global_steps}" if tag is None else tag)
    if not isinstance(client_state, dict):
        raise TypeError(f"client_state: expected a dict, got {type(client_state).__name__}")
    path = os.path.join(os.fspath(save_dir), tag)
    scheduler = engine.lr_scheduler
    extra = {
        "engine": {
            "global_steps": engine.global_steps,
            "micro_steps": engine.micro_steps,
            "skipped_steps": engine.skipped_steps,
        },
        "lr_scheduler": scheduler.state_dict() if scheduler is not None else None,
        "client_state": client_state,
        "loss_scaler": engine.loss_scaler.state_dict() if engine.loss_scaler else None,
    }
    # Rank 0 writes `latest` once the index is, before any rank learns that the save
    # succeeded: no rank goes on (and perhaps reads `latest`) before it is written.
    on_commit = functools.partial(_write_latest, os.fspath(save_dir), tag) if save_latest else None
    handle = checkpoint.save_checkpoint(
        path,
        engine.module,
        engine.optimizer,
        extra=extra,
        asynchronous=asynchronous,
        on_commit=on_commit,
    )
    return path, handle


def _write_latest(save_dir: str, tag: str) -> None:
    """Replace ``latest`` atomically: a crash leaves the old tag or the new one."""
    temporary = os.path.join(save_dir, f".{LATEST_FILE}.tmp")
    with open(temporary, "w", encoding="utf-8") as handle:
        handle.write(tag)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, os.path.join(save_dir, LATEST_FILE))


def load(
    engine: CheckpointedEngine,
    load_dir: str | os.PathLike,
    tag: str | None,
    *,
    strict: bool,
    load_optimizer: bool,
    load_scheduler: bool,
    load_counters: bool,
) -> tuple[str | None, dict | None]:
    load_dir = os.fspath(load_dir)
    if tag is None:
        latest = os.path.join(load_dir, LATEST_FILE)
        if not os.path.isfile(latest):
            return None, None
        with open(latest, encoding="utf-8") as handle:
            tag = handle.read().strip()
    path = os.path.join(load_dir, _check_tag(tag))
    if not os.path.isdir(path):
        raise FileNotFoundError(f"load_checkpoint: no checkpoint directory {path!r}")
    optimizer = engine.optimizer if load_optimizer else None
    # Random number generators continue too (as the counters do), unless only the module is
    # loaded (a fine-tune from weights keeps its own streams).
    extra = (
        checkpoint.load_checkpoint(
            path, engine.module, optimizer, strict=strict, restore_rng=load_counters
        )
        or {}
    )
    if load_counters and "engine" in extra:
        engine.global_steps = int(extra["engine"]["global_steps"])
        engine.micro_steps = int(extra["engine"]["micro_steps"])
        engine.skipped_steps = int(extra["engine"].get("skipped_steps", 0))
    if load_counters and engine.loss_scaler is not None and extra.get("loss_scaler"):
        engine.loss_scaler.load_state_dict(extra["loss_scaler"])
    if load_scheduler and engine.lr_scheduler is not None:
        state = extra.get("lr_scheduler")
        if state is None:
            raise ValueError(f"load_checkpoint: {path!r} holds no learning-rate scheduler state")
        engine.lr_scheduler.load_state_dict(state)
    return path, extra.get("client_state", {})
