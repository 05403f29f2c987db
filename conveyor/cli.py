"""`conveyor` command line: generate, run (chat REPL), serve, bench."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="conveyor", description="Continuous-batching LLM inference server")
    subparsers = parser.add_subparsers(dest="command", required=True)
    from conveyor.bench import cli as bench_cli

    bench_cli.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
