"""Train a Hugging Face causal LM with shardwrap, then reload it with ``from_pretrained``.

    torchrun --standalone --nproc-per-node 2 examples/train_hf.py --arch gpt2
    torchrun --standalone --nproc-per-node 2 examples/train_hf.py --arch llama

The model is a small GPT-2 or Llama built from a config written here (nothing is
downloaded); the corpus is the project's README, one token per byte. Each decoder layer is
a unit (``transformer_auto_wrap_policy``), FULL_SHARD (ZeRO-3), bf16 compute with fp32
master weights, and the model's own activation checkpointing. At the end the sharded
checkpoint is consolidated into Hugging Face layout with the config beside it, reloaded
with ``AutoModelForCausalLM.from_pretrained`` and compared with the trained weights.

Needs ``transformers`` (the ``test`` extra). On CPU the ranks use gloo; with CUDA, NCCL
and one GPU per rank.
"""

from __future__ import annotations

import argparse
import functools
import os
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, PretrainedConfig

import shardwrap
from shardwrap.checkpoint import save_checkpoint
from shardwrap.ckpt.consolidate import consolidate
from shardwrap.policies import transformer_auto_wrap_policy

VOCAB = 256  # one token per byte


def build_config(args: argparse.Namespace) -> PretrainedConfig:
    if args.arch == "gpt2":
        return GPT2Config(
            vocab_size=VOCAB,
            n_positions=args.seq,
            n_embd=args.hidden,
            n_layer=args.layers,
            n_head=args.heads,
            bos_token_id=0,
            eos_token_id=0,
            use_cache=False,
        )  # GPT-2 always ties lm_head to wte
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=max(1, args.heads // 2),
        max_position_embeddings=args.seq,
        tie_word_embeddings=args.tie,
        bos_token_id=0,
        eos_token_id=0,
        use_cache=False,
    )


def decoder_layer_classes(model: torch.nn.Module) -> set[type[torch.nn.Module]]:
    """The model's decoder-layer classes, from the names Hugging Face keeps whole."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    classes = {type(m) for m in model.modules() if type(m).__name__ in names}
    if not classes:
        raise ValueError(f"{type(model).__name__}: no decoder layer class found to wrap")
    return classes


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    # transformers >= 5 checkpoints each layer's forward *inside* the unit's hooks, so the
    # recomputation finds the unit still gathered (no extra all-gather); older versions
    # call it gradient_checkpointing_enable.
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def corpus() -> torch.Tensor:
    text = (Path(__file__).resolve().parent.parent / "README.md").read_bytes()
    return torch.tensor(list(text), dtype=torch.long)


def batch(data: torch.Tensor, seq: int, size: int, generator: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(data) - seq, (size,), generator=generator)
    return torch.stack([data[s : s + seq] for s in starts])


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=("gpt2", "llama"), default="gpt2")
    parser.add_argument(
        "--tie",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="llama: tie lm_head to the embedding (gpt2 always ties)",
    )
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--out", default="runs/train_hf", help="checkpoint and export folder")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    on_gpu = torch.cuda.is_available()
    dist.init_process_group("nccl" if on_gpu else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))  # set by torchrun
    device = torch.device("cuda", local_rank) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)

    config = build_config(args)
    torch.manual_seed(0)  # the same initial weights on every rank
    model = AutoModelForCausalLM.from_config(config)
    enable_activation_checkpointing(model)
    layers = decoder_layer_classes(model)
    model = shardwrap.ShardedModule(
        model,
        sharding_strategy=shardwrap.ShardingStrategy.FULL_SHARD,
        auto_wrap_policy=functools.partial(
            transformer_auto_wrap_policy, transformer_layer_cls=layers
        ),
        mixed_precision=shardwrap.MixedPrecision(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        ),
        device_id=device if on_gpu else None,
    )
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    if rank == 0:
        total = sum(p.numel() for p in model.module.parameters())  # this rank's pieces
        print(
            f"{args.arch}: {len(model.units)} units ({', '.join(c.__name__ for c in layers)}),"
            f" {world_size} ranks, this rank holds {total:,} parameter elements"
        )

    data = corpus()
    generator = torch.Generator().manual_seed(1000 + rank)  # different data on each rank
    model.train()
    for step in range(args.steps):
        tokens = batch(data, args.seq, args.batch, generator).to(device)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        model.clip_grad_norm_(1.0)
        optim.step()
        optim.zero_grad(set_to_none=True)
        if step % 10 == 0 or step == args.steps - 1:
            mean = loss.detach().float().clone()
            dist.all_reduce(mean)
            if rank == 0:
                print(f"step {step:4d}  loss {mean.item() / world_size:.4f}")

    out = Path(args.out)
    ckpt, export = out / "checkpoint", out / "hf"
    save_checkpoint(ckpt, model, optim, extra={"step": args.steps})
    trained = model.state_dict()  # every rank gathers; full fp32 tensors, unwrapped names
    if rank == 0:
        files = consolidate(str(ckpt), str(export))
        config.save_pretrained(export)  # config.json beside the weights
        reloaded = AutoModelForCausalLM.from_pretrained(export)
        loaded = reloaded.state_dict()
        worst = max((loaded[k] - v).abs().max().item() for k, v in trained.items())
        if sorted(loaded) != sorted(trained) or worst != 0.0:
            raise SystemExit(f"reloaded model differs from the trained one (max |diff| {worst})")
        print(
            f"saved {ckpt}, exported {', '.join(files)} + config.json to {export}; "
            "from_pretrained gives the trained weights exactly"
        )
        prompt = torch.tensor([list(b"ZeRO ")])
        sample = reloaded.generate(prompt, max_new_tokens=24, do_sample=False, pad_token_id=0)
        print("sample:", bytes(sample[0].tolist()).decode("utf-8", errors="replace"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
