"""accelerate's and the Trainer's own FSDP1 code run shardwrap after ``install()`` (2 ranks).

A tiny GPT-2 and Llama are prepared by ``Accelerator`` with a
``FullyShardedDataParallelPlugin`` (FULL_SHARD, transformer auto-wrap,
``cpu_offload=CPUOffload(offload_params=False)``), trained, saved with
``accelerator.save_state``, and resumed with ``load_state`` in fresh processes:

* fp32: every loss of the saved-and-resumed run equals accelerate's DDP run bit for bit
  (at 2 ranks our FULL_SHARD sums gradients as DDP does). Torch's own FSDP1 does not run
  on this path on CPU (it refuses accelerate's ``device_id=cpu``), so DDP is the reference;
* bf16 (mixed precision through the plugin): the resumed run equals the uninterrupted one
  bit for bit, and training makes progress; with SGD, every rank's full parameters follow
  accelerate's own bf16 DDP run within a bound from bf16's precision, and zeroed
  gradients (the negative control) do not.

``transformers.Trainer`` with ``fsdp="full_shard auto_wrap"`` (FSDP1) trains a GPT-2,
writes its checkpoints and resumes from one in fresh processes: the resumed losses equal
the uninterrupted run's bit for bit, and those equal the Trainer's DDP run within a derived
bound (:func:`trainer_loss_atols`: the Trainer clips gradients by default, and the total
norm is summed over shards, in another order than over whole gradients).
"""

from __future__ import annotations

import accelerate  # noqa: F401 (a declared test dependency: a broken install fails, never skips)
import torch

from tests import tolerances
from tests.dist import hf_frameworks as hf
from tests.dist import parity
from tests.dist.harness import run_ranks

KINDS = ("gpt2", "llama")


def _first_processes(rank: int, world_size: int, folder: str) -> dict:
    import shardwrap

    hf.set_launcher_env(rank, world_size)
    out = {}
    for kind in KINDS:
        out[kind, "ddp"] = hf.train(
            rank, kind, fsdp=False, mixed_precision="no", first_step=0, num_steps=2 * hf.STEPS
        )
        shardwrap.install()
        try:
            for precision in ("no", "bf16"):
                out[kind, precision] = hf.train(
                    rank, kind, fsdp=True, mixed_precision=precision, first_step=0,
                    num_steps=hf.STEPS, save_to=f"{folder}/{kind}-{precision}",
                )  # fmt: skip
            out[kind, "bf16-straight"] = hf.train(
                rank, kind, fsdp=True, mixed_precision="bf16", first_step=0,
                num_steps=2 * hf.STEPS,
            )  # fmt: skip
        finally:
            shardwrap.uninstall()
    return out


def _resumed_processes(rank: int, world_size: int, folder: str) -> dict:
    import shardwrap

    hf.set_launcher_env(rank, world_size)
    shardwrap.install()
    try:
        return {
            (kind, precision): hf.train(
                rank,
                kind,
                fsdp=True,
                mixed_precision=precision,
                first_step=hf.STEPS,
                num_steps=hf.STEPS,
                load_from=f"{folder}/{kind}-{precision}",
            )  # fmt: skip
            for kind in KINDS
            for precision in ("no", "bf16")
        }
    finally:
        shardwrap.uninstall()


def test_accelerate_fsdp_trains_saves_and_resumes(tmp_path) -> None:
    firsts = run_ranks(_first_processes, 2, str(tmp_path))
    for first, resumed in zip(firsts, run_ranks(_resumed_processes, 2, str(tmp_path))):
        _check_saved_and_resumed(first, resumed)


def _check_saved_and_resumed(first: dict, resumed: dict) -> None:
    for kind in KINDS:
        assert first[kind, "no"]["wrapper"] == "ShardedModule"
        assert first[kind, "no"]["num_fsdp"] == 3  # the root and two layers
        fp32 = first[kind, "no"]["losses"] + resumed[kind, "no"]["losses"]
        assert fp32 == first[kind, "ddp"]["losses"], kind
        bf16 = first[kind, "bf16"]["losses"] + resumed[kind, "bf16"]["losses"]
        assert bf16 == first[kind, "bf16-straight"]["losses"], kind
        assert bf16[-1] < bf16[0]


def _bf16_processes(rank: int, world_size: int) -> dict:
    """bf16 SGD: accelerate's DDP (autocast) and its FSDP1 path on shardwrap, and the
    latter with zeroed gradients (the negative control): full parameters on this rank."""
    import shardwrap

    hf.set_launcher_env(rank, world_size)
    common = {"mixed_precision": "bf16", "first_step": 0, "num_steps": hf.STEPS, "sgd": True}
    out = {}
    for kind in KINDS:
        out[kind, "ddp"] = hf.train(rank, kind, fsdp=False, **common)["params"]
        shardwrap.install()
        try:
            out[kind, "fsdp"] = hf.train(rank, kind, fsdp=True, **common)["params"]
            if kind == KINDS[0]:
                zeroed = hf.train(rank, kind, fsdp=True, grad_factor=0.0, **common)
                out[kind, "zero_grads"] = zeroed["params"]
        finally:
            shardwrap.uninstall()
    return out


# bf16 through accelerate's FSDP1 path (bf16 parameters, reductions and buffers, under
# autocast) against its DDP path (fp32 parameters under autocast): each computes with
# 8-bit mantissas, a rounding moving a value by at most BF16_EPS / 2 of itself. Between
# the loss and a weight's gradient a 2-layer model rounds at most 32 times on either
# path, so to first order an SGD update stays within 32 * BF16_EPS / 2 of the other's,
# relative, as a 2-norm per parameter; zeroed gradients are off by 1.0.
BF16_EPS = 2.0**-8
BF16_UPDATE_RTOL = 16 * BF16_EPS


def _update_error(initial: torch.Tensor, want: torch.Tensor, got: torch.Tensor) -> float:
    return float((got - want).norm() / (want - initial).norm())


def test_accelerate_bf16_fsdp_follows_its_ddp_on_every_rank() -> None:
    initial = {k: {n: p.detach() for n, p in hf.build_model(k).named_parameters()} for k in KINDS}
    for rank, out in enumerate(run_ranks(_bf16_processes, 2)):
        for (kind, run), params in out.items():
            if run == "ddp":
                continue
            ddp = out[kind, "ddp"]
            assert set(params) == set(ddp), (rank, kind, run)
            errors = {n: _update_error(initial[kind][n], ddp[n], p) for n, p in params.items()}
            worst = max(errors, key=errors.get)
            if run == "fsdp":
                assert errors[worst] <= BF16_UPDATE_RTOL, (rank, kind, worst, errors[worst])
            else:  # the negative control must fail the same check
                assert errors[worst] > BF16_UPDATE_RTOL, (rank, kind, run, "went unnoticed")


def _trainer_first(rank: int, world_size: int, folder: str) -> dict:
    import shardwrap

    hf.set_launcher_env(rank, world_size)
    record: dict = {}
    ddp = hf.trainer_run(fsdp=False, output_dir=f"{folder}/ddp", record=record)
    shardwrap.install()
    try:
        fsdp = hf.trainer_run(fsdp=True, output_dir=f"{folder}/fsdp")
        return {"ddp": ddp, "fsdp": fsdp, "ddp_record": record}
    finally:
        shardwrap.uninstall()


def _trainer_resumed(rank: int, world_size: int, folder: str) -> list[float]:
    import shardwrap

    hf.set_launcher_env(rank, world_size)
    shardwrap.install()
    try:
        checkpoint = f"{folder}/fsdp/checkpoint-{hf.STEPS}"
        return hf.trainer_run(fsdp=True, output_dir=f"{folder}/fsdp", resume=checkpoint)
    finally:
        shardwrap.uninstall()


def trainer_loss_atols(record: dict, losses: list[float]) -> list[float]:
    """Each logged loss of the Trainer's FSDP run against its DDP run's: the gradients
    summed in another order (and, with them, the clipping norm), under the Trainer's AdamW
    with ``tolerances.ADAMW_EPS``. GPT-2 here is TinyGPT's shape (2 blocks, 32 wide, an MLP
    of 128, 64 tokens a step): parity's relative bound. The DDP run's ``record`` gives the
    clipped gradients; times max(1, norm / max_norm) they are the loss's own, whose L1 sum
    ``reordered_loss_atols`` takes, and twice their largest element is the terms' scale
    (as tolerances.GRAD_SCALE sits above its models'), times the clipping's
    ``clipped_grad_multiple``. Measured: equal bit for bit on this AMD machine, where the
    bounds run from 3.6e-5 (step 0) to 4.4e-2 (step 5, the drift of five clipped steps
    through |grad|_1); the losses of these 6 batches spread over 4.26 to 4.30, so the bound
    sees gross errors only: the resumed run is compared bit for bit."""
    relative = parity.reordered_relative(tokens=2 * 2 * hf.SEQ)
    unclip = [max(1.0, n / hf.TRAINER_MAX_GRAD_NORM) for n in record["grad_norms"]]
    grad_l1s = [l1 * u for l1, u in zip(record["grad_l1s"], unclip, strict=True)]
    scale = 2.0 * max(g * u for g, u in zip(record["largest_grads"], unclip, strict=True))
    numel = sum(p.numel() for p in hf.build_model("gpt2").parameters())
    clipping = tolerances.clipped_grad_multiple(numel, hf.TRAINER_MAX_GRAD_NORM, relative, scale)

    def param_tol(steps: int) -> dict:
        atol = tolerances.reordered_param_atol(
            steps, lr=hf.TRAINER_LR, relative=relative, grad_scale=scale * clipping
        )
        return {"rtol": tolerances.step_rounding_rtol(steps), "atol": atol}

    largest = record["largest_param"]
    return tolerances.reordered_loss_atols(losses, grad_l1s, largest, param_tol, relative)


def test_trainer_fsdp_trains_checkpoints_and_resumes(tmp_path) -> None:
    first = run_ranks(_trainer_first, 2, str(tmp_path))[0]
    resumed = run_ranks(_trainer_resumed, 2, str(tmp_path))[0]
    assert len(first["ddp"]) == 2 * hf.STEPS
    atols = trainer_loss_atols(first["ddp_record"], first["ddp"])
    tolerances.check_losses(first["fsdp"], first["ddp"], atols, "Trainer FSDP against DDP")
    assert resumed == first["fsdp"][hf.STEPS :]
