"""A DeepSpeed training script in DeepSpeed's own style (argparse, ``add_config_arguments``,
``initialize(args=...)``, ``backward``/``step``, checkpoints), written for ``import deepspeed``.

``test_deepspeed_script.py`` runs it twice in the same ranks: as written, on DeepSpeed
0.19.8, and with that one import line changed to ``import shardwrap as deepspeed``.
"""

import argparse

import deepspeed
import torch


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def main(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--save_dir", type=str, required=True)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    model = Net()
    engine, optimizer, _, scheduler = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters()
    )
    micro = engine.train_micro_batch_size_per_gpu()
    accumulation = engine.gradient_accumulation_steps()
    generator = torch.Generator().manual_seed(100 + engine.global_rank)
    batches = [
        (torch.randn(micro, 8, generator=generator), torch.randn(micro, 4, generator=generator))
        for _ in range((args.steps + 2) * accumulation)
    ]

    def train(batches):
        losses, lrs, norms = [], [], []
        engine.train()
        for x, y in batches:
            x, y = x.to(engine.device), y.to(engine.device)
            loss = torch.nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            lrs.append(engine.get_lr()[0])
            norms.append(engine.get_global_grad_norm())
        return losses, lrs, norms

    split = args.steps * accumulation
    losses, lrs, norms = train(batches[:split])
    engine.save_checkpoint(args.save_dir, client_state={"seen": split})
    after_save, _, _ = train(batches[split:])
    path, client_state = engine.load_checkpoint(args.save_dir)
    after_load, _, _ = train(batches[split:])
    engine.eval()
    with torch.no_grad():
        eval_loss = torch.nn.functional.mse_loss(engine(batches[0][0]), batches[0][1]).item()
    return {
        "losses": losses + after_save,
        "after_load": after_load,
        "lrs": lrs,
        "norms": [None if n is None else float(n) for n in norms],
        "client_seen": client_state["seen"],
        "loaded": path is not None,
        "eval_loss": eval_loss,
        "stage": engine.zero_optimization_stage(),
        "batch": (engine.train_batch_size(), micro, accumulation),
        "precision": (engine.fp16_enabled(), engine.bfloat16_enabled()),
        "ranks": (engine.global_rank, engine.world_size, engine.local_rank),
        "step_applied": engine.was_step_applied(),
    }
