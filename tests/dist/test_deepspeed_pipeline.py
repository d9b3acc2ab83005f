"""The DeepSpeed door to pipeline parallelism: ``PipelineModule`` + ``train_batch``.

A config with ``"pipeline": {"stages": 2}`` and ZeRO-1/2/3 (which DeepSpeed's own
pipeline engine refuses beyond stage 1) trains the MLP of ``pipeline_cases`` on 4 ranks
(PP2 x DP2) with the losses and final parameters of single-process training on the same
global batches, gradient clipping over all stages included. The same door at ZeRO-3 trains
the benchmark's GPT (``benchmarks/gpt.py``, tiny) expressed as a layer list: embeddings,
transformer blocks, final norm, head, with integer token ids entering stage 0.

The data-parallel halves and micro-batches sum each gradient in another order than the
single process, so both compare within the bounds of tests/tolerances.py
(:func:`_reordered_tols`), under the reorder-safe AdamW. Seen at ZeRO-3 on the MLP: losses
up to 6e-8 apart (bounds 7e-6 to 4e-3), parameters 1.5e-8 (bound 1.4e-3). Controls against
the same engine run: a reference on half of each global batch (a lost data-parallel
reduce) put the parameters 2.7e-2 and the losses up to 0.24 apart; the last bias's
gradient zeroed, 4.3e-3 and 3.5e-3 at step 1 (bound 8.3e-4). A doubled gradient is no
control here: every step clips, which scales it back.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwrap
from benchmarks import gpt
from shardwrap.deepspeed.config import DeepSpeedConfig
from tests.dist import pipeline_cases as pc
from tests.dist.harness import run_ranks
from tests.tolerances import (
    ADAMW_EPS,
    GRAD_SCALE,
    check_losses,
    clipped_grad_multiple,
    reordered_loss_atols,
    reordered_param_atol,
    step_rounding_rtol,
)

PP, WORLD = 2, 4
CLIP = 0.05  # small enough that every step clips (so the cross-stage norm matters)
LR = 0.01


class ReferenceRun:
    """Single-process training's losses, final parameters, and per step the sum of the
    gradient's magnitudes and its largest element (both before clipping)."""

    def __init__(self, model: nn.Module, optim, batches, loss_fn) -> None:
        self.losses, self.grad_l1s, self.largest = [], [], 0.0
        for x, y in batches:
            loss = loss_fn(model(x), y)
            loss.backward()
            grads = [p.grad for p in model.parameters()]
            self.grad_l1s.append(sum(float(g.abs().sum()) for g in grads))
            self.largest = max(self.largest, max(float(g.abs().max()) for g in grads))
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            optim.step()
            optim.zero_grad()
            self.losses.append(float(loss.detach()))
        self.params = {n: p.detach() for n, p in model.named_parameters()}
        self.numel = sum(p.numel() for p in model.parameters())


def _reordered_tols(ref: ReferenceRun, grad_scale: float) -> tuple[list[float], dict]:
    """Per step the loss's ``atol``, and the final parameters' ``assert_close`` keywords:
    ``tolerances.reordered_param_atol`` at ``LR`` for gradients of ``grad_scale`` clipped
    to ``CLIP`` (``tolerances.clipped_grad_multiple``), and ``reordered_loss_atols`` with
    the parameters drifted by the steps before each loss."""
    scale = grad_scale * clipped_grad_multiple(ref.numel, CLIP, grad_scale=grad_scale)

    def param_tol(steps: int) -> dict:
        atol = reordered_param_atol(steps, lr=LR, grad_scale=scale)
        return {"rtol": step_rounding_rtol(steps), "atol": atol}

    largest = max(float(p.abs().max()) for p in ref.params.values())
    loss_atols = reordered_loss_atols(ref.losses, ref.grad_l1s, largest, param_tol)
    return loss_atols, param_tol(len(ref.losses))


def _config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": pc.MICRO_BATCH,
        "gradient_accumulation_steps": pc.NUM_MICROBATCHES,
        # eps: a reordered comparison's bound (tests/tolerances.py)
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "eps": ADAMW_EPS}},
        "zero_optimization": {"stage": stage},
        "gradient_clipping": CLIP,
        "pipeline": {"stages": PP},
    }


def _micro_batches(step: int, dp: int, dp_rank: int):
    x, y = pc.local_batch(step, dp, dp_rank)
    return zip(x.split(pc.MICRO_BATCH), y.split(pc.MICRO_BATCH), strict=True)


def train_batch_worker(rank: int, world_size: int, stages: list[int], save_dir: str) -> dict:
    results = {}
    for stage in stages:
        layers = list(pc.whole_model())
        model = shardwrap.pipe.PipelineModule(layers=layers, num_stages=PP, loss_fn=F.mse_loss)
        engine, *_ = shardwrap.initialize(model=model, config=_config(stage))
        dp = world_size // PP
        losses, norms = [], []
        for step in range(pc.NUM_STEPS):
            losses.append(float(engine.train_batch(iter(_micro_batches(step, dp, rank % dp)))))
            norms.append(engine.get_global_grad_norm())
        final = dict(engine.module.state_dict())
        results[stage] = {"losses": losses, "final": final, "norms": norms}
    # The last engine's checkpoint loads into the plain model at plain data parallelism.
    engine.save_checkpoint(save_dir)
    plain = shardwrap.ShardedModule(pc.whole_model())
    shardwrap.load_checkpoint(os.path.join(save_dir, f"global_step{pc.NUM_STEPS}"), plain)
    results["plain"] = dict(plain.state_dict())
    return results


def _reference(stage: int) -> ReferenceRun:
    model = pc.whole_model()
    optim = DeepSpeedConfig.load(_config(stage)).optimizer.build(model.parameters())
    batches = [pc.global_batch(step, WORLD // PP) for step in range(pc.NUM_STEPS)]
    return ReferenceRun(model, optim, batches, F.mse_loss)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    save_dir = str(tmp_path_factory.mktemp("ds_pipe"))
    return run_ranks(train_batch_worker, WORLD, [1, 2, 3], save_dir)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_train_batch_matches_single_process(results, stage):
    ref = _reference(stage)
    # the MLP's gradients stay under GRAD_SCALE on these batches (tests/unit/test_tolerances)
    loss_atols, params_tol = _reordered_tols(ref, GRAD_SCALE)
    seen = set()
    for rank, by_stage in enumerate(results):
        out = by_stage[stage]
        check_losses(out["losses"], ref.losses, loss_atols, f"rank {rank}")
        assert all(norm > CLIP for norm in out["norms"]), out["norms"]  # every step clipped
        for name, value in out["final"].items():
            torch.testing.assert_close(value, ref.params[name], msg=name, **params_tol)
            seen.add(name)
    assert seen == set(ref.params)


def test_pipeline_engine_checkpoint_loads_as_plain_model(results):
    """Saved by the ZeRO-3 pipeline engine, loaded at plain DP4: the same tensors, exactly."""
    whole = {}
    for by_stage in results:
        whole.update(by_stage[3]["final"])
    for by_stage in results:
        assert set(by_stage["plain"]) == set(whole)
        for name, value in whole.items():
            torch.testing.assert_close(by_stage["plain"][name], value, rtol=0, atol=0)


# ------------------------------------------------------------- a GPT as a layer list
GPT_CONFIG = gpt.GPTConfig(vocab=32, dim=16, depth=2, num_heads=2, seq=8)
GPT_MICRO, GPT_MICROBATCHES, GPT_STEPS = 2, 2, 3


class Embed(nn.Module):
    """The GPT's token and position embeddings as the pipeline's first layer."""

    def __init__(self, tok: nn.Embedding, pos: nn.Embedding) -> None:
        super().__init__()
        self.tok, self.pos = tok, pos

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))


def _gpt_layers(model: gpt.GPT) -> list[nn.Module]:
    return [Embed(model.tok, model.pos), *model.blocks, model.ln_f, model.head]


def _gpt_names() -> dict[str, str]:
    """PipelineModule parameter name (``"<layer>.<name>"``) -> the GPT's own name."""
    model = gpt.build(GPT_CONFIG)
    own = {id(p): n for n, p in model.named_parameters()}
    return {
        f"{i}.{n}": own[id(p)]
        for i, layer in enumerate(_gpt_layers(model))
        for n, p in layer.named_parameters()
    }


def _gpt_batch(step: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: ``dp`` ranks' micro-batches, rank by rank."""
    return gpt.batch(GPT_CONFIG, step=step, rank=0, batch_size=dp * GPT_MICRO * GPT_MICROBATCHES)


def _gpt_config() -> dict:
    config = _config(3)
    config["train_micro_batch_size_per_gpu"] = GPT_MICRO
    config["gradient_accumulation_steps"] = GPT_MICROBATCHES
    return config


def gpt_worker(rank: int, world_size: int) -> dict:
    layers = _gpt_layers(gpt.build(GPT_CONFIG))
    model = shardwrap.pipe.PipelineModule(layers=layers, num_stages=PP, loss_fn=gpt.loss_fn)
    engine, *_ = shardwrap.initialize(model=model, config=_gpt_config())
    dp = world_size // PP
    rows = GPT_MICRO * GPT_MICROBATCHES
    losses = []
    for step in range(GPT_STEPS):
        x, y = _gpt_batch(step, dp)
        mine = slice((rank % dp) * rows, (rank % dp + 1) * rows)
        micro = zip(x[mine].split(GPT_MICRO), y[mine].split(GPT_MICRO), strict=True)
        losses.append(float(engine.train_batch(iter(micro))))
    return {"losses": losses, "final": dict(engine.module.state_dict())}


def test_gpt_pipeline_zero3_matches_single_process():
    """``"pipeline": {"stages": 2}`` with ZeRO-3 on 4 ranks trains the GPT as one process."""
    model = gpt.build(GPT_CONFIG)
    optim = DeepSpeedConfig.load(_gpt_config()).optimizer.build(model.parameters())
    batches = [_gpt_batch(step, WORLD // PP) for step in range(GPT_STEPS)]
    ref = ReferenceRun(model, optim, batches, gpt.loss_fn)
    # the terms' scale: twice the largest gradient element seen, as GRAD_SCALE sits above
    # its models'; the GPT is 2 blocks deep, its sums at most 64 terms (tolerances' defaults)
    loss_atols, params_tol = _reordered_tols(ref, 2.0 * ref.largest)
    names, seen = _gpt_names(), set()
    for rank, out in enumerate(run_ranks(gpt_worker, WORLD)):
        check_losses(out["losses"], ref.losses, loss_atols, f"rank {rank}")
        for name, value in out["final"].items():
            torch.testing.assert_close(value, ref.params[names[name]], msg=name, **params_tol)
            seen.add(names[name])
    assert seen == set(ref.params)
