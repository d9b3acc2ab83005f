"""Sharded safetensors checkpoints that survive crashes and load on any number of ranks.

``save_checkpoint`` runs on every rank: each rank writes the ranges it owns (see
``ckpt/slots.py``) of the parameters and of the optimizer state, then world rank 0 writes
the index (format: ``ckpt/format.py``, [Note: checkpoint layout]). ``load_checkpoint`` runs on
every rank of any world size and strategy: each rank computes the ranges it holds now and
reads only the pieces that overlap them.

This module is the face; the work is in ``ckpt/``, by concept: saving ``save.py`` (the
index's commit ``commit.py``, in the background ``async_save.py``), loading ``loading.py``
(reading ``reader.py``), what is saved, by state kind ([Note: state kinds] in
``piece_records.py``; each kind's save and load: ``kinds.py``, the run state ``run_state.py``),
the memory and disk tiers ([Note: checkpoint tiers]) ``tier_options.py``, ``tiered_save.py``,
``selection.py``, ``tiered_load.py``, ``peer_copy.py``, optimizer state ``optim_state.py``,
state dicts ``state_dict.py``, one-file export ``consolidate.py``, Hugging Face loading
``pretrained.py``.
"""

from __future__ import annotations

from .ckpt.format import CheckpointError
from .ckpt.save import save_checkpoint
from .ckpt.tier_options import CheckpointTiers
from .ckpt.tiered_load import load_checkpoint, load_newest, newest_checkpoint
from .ckpt.tiered_save import save_tiered

__all__ = [
    "CheckpointError",
    "CheckpointTiers",
    "load_checkpoint",
    "load_newest",
    "newest_checkpoint",
    "save_checkpoint",
    "save_tiered",
]
