"""Whether a checkpoint fits a model: names, shapes and dtypes, checked before loading.

``load_checkpoint`` runs these before it copies anything, so a checkpoint that does not
fit leaves the model (and the optimizer) as they were.
"""

from __future__ import annotations

from .format import CheckpointError, CheckpointIndex, TensorEntry, dtype_from_name
from .slots import ModelSlots


def match_names(
    index: CheckpointIndex, slots: ModelSlots, strict: bool, elsewhere: set[str] = frozenset()
):
    """Pair each slot with its saved name; report missing/unexpected names.

    ``elsewhere``: names other pipeline stages hold, expected in the checkpoint though not
    in this rank's model ([Note: checkpoints of pipeline stages] in ckpt/fragments.py).
    """
    matched, missing = [], []
    model_aliases: dict[str, list[str]] = {}
    for alias, canonical in slots.aliases.items():
        model_aliases.setdefault(canonical, []).append(alias)
    for slot in slots.slots:
        candidates = [index.resolve(n) for n in (slot.fqn, *model_aliases.get(slot.fqn, []))]
        found = next((n for n in candidates if n in index.params), None)
        if found is None:
            missing.append(slot.fqn)
        else:
            matched.append((slot, found))
    used = {name for _, name in matched}
    unexpected = sorted(set(index.params) - used - elsewhere)
    missing += [n for n in slots.buffers if n not in index.buffers]
    unexpected += sorted(set(index.buffers) - set(slots.buffers) - elsewhere)
    if slots.slots and (not matched or (strict and 2 * len(matched) < len(slots.slots))):
        raise CheckpointError(
            f"the checkpoint holds another model: only {len(matched)} of this model's "
            f"{len(slots.slots)} parameters are in it (checkpoint: e.g. "
            f"{sorted(index.params)[:3]}; model: e.g. {[s.fqn for s in slots.slots[:3]]})"
        )
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"the checkpoint does not fit the model: missing {missing[:10]}"
            f"{' ...' if len(missing) > 10 else ''}, unexpected {unexpected[:10]}"
            f"{' ...' if len(unexpected) > 10 else ''} (pass strict=False to skip them)"
        )
    return matched


def check_entry(name: str, entry: TensorEntry, shape: tuple[int, ...], dtype) -> None:
    saved_dtype = dtype_from_name(entry.dtype, f"tensor {name!r}")
    if entry.shape != tuple(shape):
        raise CheckpointError(
            f"parameter {name!r}: checkpoint shape {entry.shape}, model shape {tuple(shape)}"
        )
    if saved_dtype != dtype:
        raise CheckpointError(f"parameter {name!r}: checkpoint dtype {saved_dtype}, model {dtype}")


def check_fits_model(
    index: CheckpointIndex, slots: ModelSlots, matched: list, with_optimizer: bool
) -> None:
    """Shapes and dtypes of the matched parameters, buffers and sharded optimizer state."""
    for slot, saved_name in matched:
        check_entry(slot.fqn, index.params[saved_name], slot.shape, slot.dtype)
        optim_state = index.optim_state if with_optimizer else None
        states = (optim_state or {}).get(saved_name, {})
        for state, entry in states.items():
            if isinstance(entry, TensorEntry) and entry.shape != ():
                check_entry(f"{slot.fqn}/{state}", entry, slot.shape, slot.dtype)
    for name, buffer in slots.buffers.items():
        if name in index.buffers:
            check_entry(name, index.buffers[name], tuple(buffer.shape), buffer.dtype)
