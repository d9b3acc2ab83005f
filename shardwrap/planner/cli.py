"""``python -m shardwrap estimate``: the memory planner's table, and the stage that fits."""

from __future__ import annotations

import argparse

import torch

from ..base.sizes import read_size
from .estimate import OPTIMIZER_STATES, cheapest_fitting, estimate_memory, format_table
from .resident import DiskRunShape, resident_peak
from .shapes import assumed_shape

ASSUMED_SHAPE_HELP = """\
--params is taken as a standard decoder: 12 x hidden^2 parameters per layer, one wrapped
unit per layer, the rest (embeddings, head) in the root unit; the assumption is printed.
hidden: --hidden, else isqrt(P / (12 x --layers)), else the largest of the common shapes
(GPT-3, LLaMA: 768/12 layers .. 8192/80, 12288/96) whose 12 L h^2 is at most P, above them
128 * round(cbrt(32 P / 3) / 128). ZeRO-3 then gathers at most two layers (the one computing
and the prefetched one, in the compute dtype), shown apart from the sharded model state
(16 bytes per parameter / N for Adam)."""


def parse_bytes(text: str) -> int:
    """``"80GB"`` -> 80e9, ``"80GiB"`` -> 80 * 2**30 (case-insensitive; plain = bytes)."""
    value = read_size(text)
    if value is None:
        raise argparse.ArgumentTypeError(
            f"--budget: expected a size such as 80GB or 80GiB, got {text!r}"
        )
    return value


def parse_count(text: str) -> int:
    """``"7e9"`` or ``"7000000000"`` -> 7000000000."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number such as 7e9, got {text!r}") from None
    if value < 1 or not value.is_integer():
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}")
    return int(value)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the ``estimate`` subcommand on an ``add_subparsers()`` object."""
    parser = subparsers.add_parser(
        "estimate",
        help="per-rank memory for ZeRO stages 0-3",
        description="Per-rank memory by category for ZeRO stages 0-3 (formulas printed).",
    )
    add_arguments(parser)
    parser.set_defaults(run=run)
    return parser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``estimate`` options (and, after the description, what a count is assumed to be)."""
    parser.description = f"{parser.description or ''}\n\n{ASSUMED_SHAPE_HELP}".strip()
    parser.add_argument("--params", type=parse_count, required=True, help="parameters, e.g. 7e9")
    parser.add_argument("--world-size", type=int, required=True, help="data-parallel ranks")
    parser.add_argument(
        "--tp", type=int, default=1, help="tensor-parallel degree (splits --params first)"
    )
    parser.add_argument(
        "--pp", type=int, default=1, help="pipeline-parallel stages (splits --params first)"
    )
    parser.add_argument(
        "--bf16",
        action="store_true",
        help="bf16 mixed precision: fp32 master shards and optimizer state, bf16 compute",
    )
    parser.add_argument(
        "--offload",
        choices=["cpu", "disk", "nvme"],
        default=None,
        help="nvme: disk (DiskOffload), plus the resident peak per rank of a ZeRO-3 run",
    )
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZER_STATES), default="adamw")
    parser.add_argument(
        "--largest-unit-params",
        type=parse_count,
        default=None,
        help="parameters of the largest wrapped unit (ZeRO-3 peak); default: one decoder "
        "layer, 12 x hidden^2",
    )
    parser.add_argument(
        "--layers", type=int, default=None, help="decoder layers (hidden = isqrt(P / (12 L)))"
    )
    parser.add_argument(
        "--hidden", type=int, default=None, help="hidden size: a layer is 12 x hidden^2"
    )
    parser.add_argument("--budget", type=parse_bytes, default=None, help="device memory per rank")
    parser.add_argument(
        "--vocab", type=int, default=0, help="--offload nvme: vocabulary (a head unit V x hidden)"
    )
    parser.add_argument(
        "--tokens-per-rank", type=int, default=0, help="--offload nvme: tokens per rank and step"
    )
    parser.add_argument(
        "--sub-group-size",
        type=parse_count,
        default=1_000_000_000,
        help="--offload nvme: DiskOffload.sub_group_size (DeepSpeed's sub_group_size)",
    )


def run(args: argparse.Namespace) -> int:
    """Print the table; with ``--budget``, the cheapest stage that fits. Returns an exit code."""
    for flag, value in (("--world-size", args.world_size), ("--tp", args.tp), ("--pp", args.pp)):
        if value < 1:
            raise SystemExit(f"{flag}: expected a positive number, got {value}")
    largest = args.largest_unit_params
    if largest is None:
        try:
            shape = assumed_shape(args.params, args.layers, args.hidden)
        except ValueError as error:
            raise SystemExit(f"--{error}") from None
        largest = shape.layer_params
        print(shape.describe() + "\n")
    elif args.layers is not None or args.hidden is not None:
        raise SystemExit("--largest-unit-params: give it or --layers/--hidden, not both")
    estimates = estimate_memory(
        args.params,
        world_size=args.world_size,
        compute_dtype=torch.bfloat16 if args.bf16 else None,
        optimizer=args.optimizer,
        offload="disk" if args.offload == "nvme" else args.offload,
        largest_unit_params=largest,
        tensor_parallel=args.tp,
        pipeline_parallel=args.pp,
    )
    if args.tp * args.pp > 1:
        share = -(-args.params // (args.tp * args.pp))
        print(
            f"TP {args.tp} x PP {args.pp}: each rank of a data-parallel group holds "
            f"{share:,} of the {args.params:,} parameters (P below), its layers' TP blocks "
            f"(largest unit / {args.tp}); ZeRO shards them over the {args.world_size} DP ranks\n"
        )
    print(format_table(estimates))
    if args.offload == "nvme":
        print_resident_peak(args)
    if args.budget is None:
        return 0
    best = cheapest_fitting(estimates, args.budget)
    budget_gib = args.budget / 2**30
    if best is None:
        smallest = min(e.device_bytes for e in estimates) / 2**30
        print(
            f"\nno stage fits {budget_gib:,.3f} GiB per rank (smallest: {smallest:,.3f} GiB); "
            "add ranks, offload, or shrink the largest unit"
        )
        return 1
    print(
        f"\ncheapest stage that fits {budget_gib:,.3f} GiB per rank: stage {best.stage} "
        f"({best.strategy.name}, {best.device_bytes / 2**30:,.3f} GiB on the device; "
        "activations not included)"
    )
    return 0


def print_resident_peak(args: argparse.Namespace) -> None:
    """The resident peak per rank of a ZeRO-3 run under DiskOffload ([Note: the resident
    peak under disk offload])."""
    if args.largest_unit_params is not None:
        raise SystemExit("--offload nvme: give --layers/--hidden, not --largest-unit-params")
    if args.tp * args.pp > 1:
        raise SystemExit("--offload nvme: the resident peak is modelled for --tp 1 --pp 1 only")
    model = assumed_shape(args.params, args.layers, args.hidden)
    if model.hidden == 0:
        raise SystemExit("--offload nvme: the model is too small for a decoder shape")
    for name in ("vocab", "tokens_per_rank"):
        if getattr(args, name) < 0:
            raise SystemExit(f"--{name.replace('_', '-')}: expected a number >= 0")
    shape = DiskRunShape(
        num_params=args.params,
        world_size=args.world_size,
        layer_params=model.layer_params + 13 * model.hidden,
        hidden=model.hidden,
        layers=model.num_layers,
        tokens_per_rank=args.tokens_per_rank,
        vocab=args.vocab,
        sub_group_size=args.sub_group_size,
        compute_bytes=2 if args.bf16 else 4,
        num_states=OPTIMIZER_STATES[args.optimizer],
    )
    print(
        f"\nresident peak per rank, ZeRO-3 with DiskOffload (stage 3 above; master shards, "
        f"gradients and optimizer state in files):\n{resident_peak(shape).format()}"
    )
