"""Python's small objects on transparent huge pages, for a process that simulates.

A large fleet's simulation holds hundreds of MiB of small objects (each engine's cached blocks,
the prefix index, the trace) and touches them in no order a cache can follow, so many loads miss
the TLB too. pymalloc maps its 1 MiB arenas one by one, which no 2 MiB page can back. The
compiled helper (`router/runtime/huge_arenas.c`, built by `make` with the compiled modules) hands
pymalloc its arenas from 2 MiB-aligned reservations advised for huge pages instead. Measured on
the first 120 s of the Mooncake trace tiled onto 1,024 workers: docs/benchmarks.md.

It is process-wide and for good: installed, it stays until the process exits. So only commands
that simulate install it, as early as they can (what is allocated before keeps its small
pages). The live proxy does not: a huge page fault may stop to compact memory, and a decision
must not wait on that.
"""

from __future__ import annotations

import importlib
import os
import sys

from router.runtime.native import native_root, put_shared_on_path

OFF = "FAIRWAY_HUGE_PAGES"  # set to 0 to keep pymalloc's own arenas


def use_huge_page_arenas() -> bool:
    """Install the huge-page arena allocator in this process, if it is built and not turned off;
    whether it is in use."""
    root = native_root()
    if os.environ.get(OFF) == "0" or not sys.platform.startswith("linux") or root is None:
        return False
    put_shared_on_path(root)
    try:
        helper = importlib.import_module("fairway_huge_arenas")
    except ImportError:
        return False  # a build without it: plain arenas, as before
    helper.install()
    return True


def reserved_bytes() -> int:
    """Address space reserved for huge-page arenas so far (0 when not installed)."""
    helper = sys.modules.get("fairway_huge_arenas")
    return 0 if helper is None else int(helper.reserved())
