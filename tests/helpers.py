"""Builders the tests share: requests, hand-built cluster views, the default cost model."""

from __future__ import annotations

from pathlib import Path

import pytest

from router.cost_model import roofline
from router.prefix_index import PrefixIndex
from router.request import Request
from router.view import ClusterView, WorkerState

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "traces" / "samples" / "mooncake_conversation_head1000.jsonl"
BS = 16  # tokens per block in hand-built requests and views
COST = roofline("llama-3-8b", "a100-80g")


def make_req(
    i: int, blocks: list[int], client: str = "a", tail: int = 8, out: int = 10, weight: float = 1.0
) -> Request:
    """Request `i` at time 0: a prompt of `blocks` full blocks and `tail` tokens more."""
    return Request(i, 0.0, len(blocks) * BS + tail, out, list(blocks), client=client, weight=weight)


def make_view(*outstanding: int, capacity: int = 10_000, now: float = 0.0) -> ClusterView:
    """A view of one worker per entry, each with that many requests waiting, an empty index."""
    workers = {
        i: WorkerState(i, num_waiting=n, tokens_in_flight=100 * n, kv_capacity_blocks=capacity)
        for i, n in enumerate(outstanding)
    }
    return ClusterView(now, workers, PrefixIndex(), BS, COST)


def no_cache(_: Request) -> int:
    """A local discipline's `cached` callback for a worker that holds nothing."""
    return 0


def mark_folder(items: list[pytest.Item], folder: Path, *markers: str) -> None:
    """Give every test collected below `folder` these markers (a folder conftest calls it)."""
    for item in items:
        if folder in item.path.parents:
            for name in markers:
                item.add_marker(name)
