"""The `fairway` command line: one module per command group, each adding its commands.

This package is the composition root: the one place that imports every backend (the simulator,
the proxy, the workers, the reports) and hands each what it needs. Nothing imports it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from router.cli import bench, offline, reports, serve


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fairway",
        description="Cluster-level router and scheduler for LLM serving: simulate, serve, compare.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for group in (offline, serve, reports, bench):
        group.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from traces.schema import TraceError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (TraceError, ValueError) as e:
        print(f"fairway: error: {e}", file=sys.stderr)
        return 2
