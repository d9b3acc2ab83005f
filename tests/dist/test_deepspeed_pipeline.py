"""The DeepSpeed door to pipeline parallelism: ``PipelineModule`` + ``train_batch``.

A config with ``"pipeline": {"stages": 2}`` and ZeRO-1/2/3 (which DeepSpeed's own
pipeline engine refuses beyond stage 1) trains the MLP of ``pipeline_cases`` on 4 ranks
(PP2 x DP2) with the losses and final parameters of single-process training on the same
global batches, gradient clipping over all stages included.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

import shardwrap
from shardwrap.deepspeed.config import DeepSpeedConfig
from tests.dist import pipeline_cases as pc
from tests.dist.harness import run_ranks

PP, WORLD = 2, 4
CLIP = 0.05  # small enough that every step clips (so the cross-stage norm matters)


def _config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": pc.MICRO_BATCH,
        "gradient_accumulation_steps": pc.NUM_MICROBATCHES,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
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


def _reference(stage: int):
    model = pc.whole_model()
    optim = DeepSpeedConfig.load(_config(stage)).optimizer.build(model.parameters())
    losses = []
    for step in range(pc.NUM_STEPS):
        x, y = pc.global_batch(step, WORLD // PP)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optim.step()
        optim.zero_grad()
        losses.append(float(loss.detach()))
    return losses, dict(model.named_parameters())


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    save_dir = str(tmp_path_factory.mktemp("ds_pipe"))
    return run_ranks(train_batch_worker, WORLD, [1, 2, 3], save_dir)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_train_batch_matches_single_process(results, stage):
    ref_losses, ref_params = _reference(stage)
    seen = set()
    for rank, by_stage in enumerate(results):
        out = by_stage[stage]
        torch.testing.assert_close(out["losses"], ref_losses, msg=f"rank {rank}")
        assert all(norm > CLIP for norm in out["norms"]), out["norms"]  # every step clipped
        for name, value in out["final"].items():
            torch.testing.assert_close(value, ref_params[name].detach(), msg=name)
            seen.add(name)
    assert seen == set(ref_params)


def test_pipeline_engine_checkpoint_loads_as_plain_model(results):
    """Saved by the ZeRO-3 pipeline engine, loaded at plain DP4: the same tensors, exactly."""
    whole = {}
    for by_stage in results:
        whole.update(by_stage[3]["final"])
    for by_stage in results:
        assert set(by_stage["plain"]) == set(whole)
        for name, value in whole.items():
            torch.testing.assert_close(by_stage["plain"][name], value, rtol=0, atol=0)
