"""``python -m shardwrap <command>``: command-line tools."""

from __future__ import annotations

import argparse
import sys

from . import cli_estimate


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m shardwrap")
    subparsers = parser.add_subparsers(dest="command", required=True)
    cli_estimate.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
