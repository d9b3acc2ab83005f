"""``shardwrap.install()`` and torch's own ``set_model_state_dict`` / ``set_optimizer_state_dict``.

User code imports the functions from ``torch.distributed.checkpoint.state_dict`` after
``install()`` and calls them on a shardwrap model. The state it loads comes from an
unwrapped model trained one step (torch's functions on that model, no shardwrap code);
what the sharded model then holds is read from its shard views and optimizer state
directly (``ckpt_workers.local_pieces``), not through the functions under test, and must
equal the unwrapped model's values bit for bit. Training on from there must agree with
the unwrapped model going on. The negative control runs the same load without
``install()`` (torch's functions on the shardwrap model) and shows the check catches it.
"""

from __future__ import annotations

import importlib

import torch
from torch.distributed.checkpoint import state_dict as torch_dsd

import shardwrap
from shardwrap.install import DSD_FUNCTIONS
from tests import models
from tests.dist import ckpt_workers, parity
from tests.dist.harness import run_ranks

WORLD_SIZE = 3  # forces padding of the flat shards


def _source() -> tuple[dict, dict]:
    """An unwrapped model's state after one AdamW step: (model, optimizer) state dicts."""
    torch.manual_seed(7)
    model = models.TinyGPT()
    optim = parity.make_optimizer(model, "adamw")
    parity.loss_for("gpt", model, parity.batch_for("gpt", 5), 0).backward()
    optim.step()
    optim.zero_grad()
    return torch_dsd.get_model_state_dict(model), torch_dsd.get_optimizer_state_dict(model, optim)


def _differences(rank: int, world_size: int, model_sd: dict, optim_sd: dict) -> list[str]:
    """Where this rank's pieces differ from the slices of the unwrapped state."""
    torch.manual_seed(99)  # other weights until loaded
    sharded = ckpt_workers.wrap(models.TinyGPT(), world_size, "FULL_SHARD")
    optim = parity.make_optimizer(sharded, "adamw")
    # Imported as user code imports them, after install() (or without it: the control).
    dsd = importlib.import_module("torch.distributed.checkpoint.state_dict")
    try:
        dsd.set_model_state_dict(sharded, model_sd)
        dsd.set_optimizer_state_dict(sharded, optim, optim_sd)
    except Exception as error:  # torch's own functions may refuse the model outright
        return [f"load: {type(error).__name__}"]
    found = []
    for name, (_shape, start, end, flat, state) in ckpt_workers.local_pieces(
        sharded, optim
    ).items():
        if not torch.equal(flat, model_sd[name].reshape(-1)[start:end]):
            found.append(name)
        wanted = optim_sd["state"].get(name, {})  # none for the frozen table
        if set(state) != set(wanted):
            found.append(f"{name}: state {sorted(state)}, expected {sorted(wanted)}")
        for key, value in wanted.items():
            want = value if key == "step" else value.reshape(-1)[start:end]
            if key in state and not torch.equal(state[key], want):
                found.append(f"{name}/{key}")
    return found


def _worker(rank: int, world_size: int, installed: bool) -> list[str]:
    model_sd, optim_sd = _source()
    if installed:
        shardwrap.install()
    try:
        return _differences(rank, world_size, model_sd, optim_sd)
    finally:
        shardwrap.uninstall()


def _continue_worker(rank: int, world_size: int) -> bool:
    """Loaded through torch's functions, the sharded model trains on as the unwrapped one."""
    model_sd, optim_sd = _source()
    reference = models.TinyGPT()
    reference.load_state_dict(model_sd)
    ref_optim = parity.make_optimizer(reference, "adamw")
    # strict=False: the unused parameter (``extra``) has no state after one step
    loose = torch_dsd.StateDictOptions(strict=False)
    torch_dsd.set_optimizer_state_dict(reference, ref_optim, optim_sd, options=loose)
    shardwrap.install()
    try:
        torch.manual_seed(99)
        sharded = ckpt_workers.wrap(models.TinyGPT(), world_size, "FULL_SHARD")
        optim = parity.make_optimizer(sharded, "adamw")
        dsd = importlib.import_module("torch.distributed.checkpoint.state_dict")
        missing, unexpected = dsd.set_model_state_dict(sharded, model_sd)
        assert not missing and not unexpected, (missing, unexpected)
        dsd.set_optimizer_state_dict(sharded, optim, optim_sd)
    finally:
        shardwrap.uninstall()
    ckpt_workers.train_steps(sharded, optim, reference, ref_optim, world_size, rank, 1)
    return True


def test_install_rebinds_every_model_function_of_torchs_module() -> None:
    public = {n for n in torch_dsd.__all__ if n.startswith(("get_", "set_"))}
    assert public == set(DSD_FUNCTIONS)
    shardwrap.install()
    try:
        for name in public:
            assert getattr(torch_dsd, name).__doc__.endswith("(install()).")
    finally:
        shardwrap.uninstall()
    assert torch_dsd.set_model_state_dict.__module__ == "torch.distributed.checkpoint.state_dict"


def test_torchs_set_functions_load_exactly_after_install() -> None:
    assert run_ranks(_worker, WORLD_SIZE, True) == [[]] * WORLD_SIZE


def test_the_check_catches_torchs_own_functions_without_install() -> None:
    for found in run_ranks(_worker, WORLD_SIZE, False):
        assert found, "torch's own set_*_state_dict loaded a shardwrap model exactly"


def test_training_continues_as_the_unwrapped_model() -> None:
    assert run_ranks(_continue_worker, WORLD_SIZE) == [True] * WORLD_SIZE
