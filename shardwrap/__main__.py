"""``python -m shardwrap`` (or the ``shardwrap`` script): offline checkpoint and planning tools.

Subcommands live in ``_COMMANDS``; add one with a function that fills its parser and a
function that runs it and returns the exit code.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

EXIT_CODES = (
    "exit codes: 0 success; 1 inspect found a missing or damaged file; 2 bad arguments or an "
    "error (the message names the file or argument); 130 interrupted"
)


def _consolidate_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="a shardwrap checkpoint folder")
    parser.add_argument("out", help="output folder (Hugging Face safetensors layout)")
    parser.add_argument("--dtype", default=None, help="cast floating tensors: bf16, fp16, fp32")
    parser.add_argument("--max-shard-size", default="5GB", help="largest output file (5GB)")
    parser.add_argument("--quiet", action="store_true", help="no progress output")


def _consolidate(args: argparse.Namespace) -> int:
    from .ckpt.consolidate import consolidate, parse_dtype

    dtype = parse_dtype(args.dtype) if args.dtype else None

    def progress(done: int, total: int, name: str) -> None:
        width = 30
        filled = width * done // total
        end = "\n" if done == total else ""
        bar = "#" * filled + "." * (width - filled)
        print(f"\r[{bar}] {done}/{total} {name[:40]:<40}", end=end, file=sys.stderr, flush=True)

    files = consolidate(
        args.checkpoint,
        args.out,
        dtype=dtype,
        max_shard_size=args.max_shard_size,
        # A bar redrawn with carriage returns only makes sense on a terminal, not in a log.
        progress=None if args.quiet or not sys.stderr.isatty() else progress,
    )
    print(f"wrote {', '.join(files)} to {args.out}")
    return 0


def _inspect_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="a shardwrap checkpoint folder")
    parser.add_argument("--no-verify", action="store_true", help="skip the file checksums")
    parser.add_argument("--tensors", action="store_true", help="list every tensor")


def _inspect(args: argparse.Namespace) -> int:
    from .ckpt.consolidate import describe

    text, ok = describe(args.checkpoint, verify=not args.no_verify, list_tensors=args.tensors)
    print(text)
    return 0 if ok else 1


def _estimate_args(parser: argparse.ArgumentParser) -> None:
    from .planner.cli import add_arguments

    add_arguments(parser)


def _estimate(args: argparse.Namespace) -> int:
    from .planner.cli import run

    return run(args)


_COMMANDS = {
    "consolidate": (
        "write a checkpoint's model as Hugging Face safetensors",
        _consolidate_args,
        _consolidate,
    ),
    "inspect": ("summarise a checkpoint and verify its checksums", _inspect_args, _inspect),
    "estimate": (
        "per-rank memory for ZeRO stages 0-3, with formulas (and the stage that fits)",
        _estimate_args,
        _estimate,
    ),
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shardwrap", description="shardwrap offline tools")
    commands = parser.add_subparsers(dest="command", required=True)
    parser.epilog = EXIT_CODES
    parser.add_argument("--version", action="version", version=f"shardwrap {_version()}")
    for name, (summary, fill, _run) in _COMMANDS.items():
        fill(commands.add_parser(name, help=summary, description=summary, epilog=EXIT_CODES))
    args = parser.parse_args(argv)
    try:
        return _COMMANDS[args.command][2](args)
    except BrokenPipeError:
        # Whoever read our output stopped (``| head``): nothing to report. Point stdout at
        # /dev/null so that the interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, as a shell reports a command killed by a closed pipe
    except KeyboardInterrupt:
        print(f"shardwrap {args.command}: interrupted", file=sys.stderr)
        return 130
    except (OSError, ValueError, RuntimeError) as exc:
        print(f"shardwrap {args.command}: error: {exc}", file=sys.stderr)
        return 2


def _version() -> str:
    from . import __version__

    return __version__


if __name__ == "__main__":
    raise SystemExit(main())
