"""The `fairway` command line: one module per command group, each adding its commands.

This package is the composition root: the one place that imports every backend (the simulator,
the proxy, the workers, the reports) and hands each what it needs. Nothing imports it.
"""

from __future__ import annotations

import os

# Before numpy is imported. Fairway's numpy work is vector arithmetic and a few small
# least-squares fits, for which no BLAS thread pool pays: OpenBLAS's threads spin for about a
# tenth of a second of CPU after numpy is imported, in every process a command starts (a plan's
# workers too). A value the user set stands.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse  # noqa: E402
import gc  # noqa: E402
import sys  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from typing import NoReturn  # noqa: E402

from router.cli import bench, offline, reports, serve  # noqa: E402


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
    """Run the command `argv` (the process's own arguments if None); its exit status."""
    return _command(build_parser().parse_args(argv))


def run() -> NoReturn:
    """The `fairway` command: one command, then the process's end."""
    args = build_parser().parse_args()
    code = _command(args)
    if getattr(args, "simulates", False):
        # A simulation leaves its fleet alive in reference cycles (engines and their cached KV
        # blocks: a million objects at 1,024 workers), for the collector's last pass at exit
        # to walk and free: a tenth of `fairway simulate`'s CPU there. The OS takes the memory
        # back at once; frozen, that pass skips it (atexit handlers still run).
        gc.freeze()
    raise SystemExit(code)


def _command(args: argparse.Namespace) -> int:
    from traces.schema import TraceError

    if getattr(args, "simulates", False):
        # Before the trace is read: what is allocated earlier keeps its small pages.
        from router.runtime.arenas import use_huge_page_arenas

        use_huge_page_arenas()
    try:
        return args.func(args)
    except (TraceError, ValueError) as e:
        print(f"fairway: error: {e}", file=sys.stderr)
        return 2
