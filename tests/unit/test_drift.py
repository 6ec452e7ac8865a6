"""The drift guard: predicted against actual hits, step-by-step fallback, and recovery."""

from __future__ import annotations

import policies
from router.config import RouterConfig
from router.core import Router
from router.drift import DriftGuard
from router.request import Request

BS = 16


def test_agreeing_predictions_keep_the_best_level() -> None:
    guard = DriftGuard(window=10)
    for _ in range(50):
        assert guard.observe({"precise": 160, "approximate": 176}, 160) is None
    assert guard.level == "precise"


def test_falls_back_step_by_step_and_recovers() -> None:
    guard = DriftGuard(window=10, threshold=0.5, recover=0.25)
    changes = []
    # Lost KV events: the precise index says nothing is cached, the worker reuses plenty.
    for _ in range(10):
        changes.append(guard.observe({"precise": 0, "approximate": 320}, 320))
    assert [c for c in changes if c] == ["approximate"]
    # Then a restarted worker whose clearing event was lost too: both indexes promise hits
    # and every one is a miss.
    for _ in range(10):
        changes.append(guard.observe({"precise": 320, "approximate": 320}, 0))
    assert [c for c in changes if c] == ["approximate", "load"]
    # Events flow again and agree: back to the top, not one step at a time.
    for _ in range(10):
        changes.append(guard.observe({"precise": 320, "approximate": 320}, 320))
    assert [c for c in changes if c] == ["approximate", "load", "precise"]


def test_a_short_burst_does_not_flip_the_level() -> None:
    guard = DriftGuard(window=20)
    for i in range(60):
        wrong = i % 10 == 0
        assert guard.observe({"precise": 0 if wrong else 160}, 160) is None


def test_router_switches_what_policies_route_by() -> None:
    router = Router(
        policies.global_policies.create("lpm"),
        lambda: policies.local_policies.create("fcfs"),
        RouterConfig(block_size=BS, window=4),
    )
    router.add_worker(0)
    router.add_worker(1)
    router.drift = DriftGuard(levels=router.indexes.levels(), window=5)
    doc = list(range(100, 140))
    for i in range(10):
        request = Request(i, 0.0, len(doc) * BS + 8, 4, doc)
        routed = router.route(request, float(i))
        for r in routed.released:
            router.first_token(r, float(i))
            # The worker reuses nothing, though the index promised the document (say, it
            # restarted with an empty cache on every request).
            router.finish(r, float(i) + 0.5, cached_tokens=0)
    assert router.indexes.level == "load"
    assert router.indexes.level_changes and router.indexes.level_changes[-1][1:] == (
        "approximate",
        "load",
    )
    assert router.view.index.num_blocks(0) == 0, "load only: policies see an empty index"


def test_cold_prompts_take_no_dropped_level_back() -> None:
    """A window where nothing was predicted or reused says nothing of an index: one that can
    never match (another block size) must not be believed again over unshared prompts."""
    guard = DriftGuard(window=4)
    for _ in range(4):
        guard.observe({"precise": 0, "approximate": 640}, 640)
    assert guard.level == "approximate"
    for _ in range(8):
        assert guard.observe({"precise": 0, "approximate": 0}, 0) is None
    assert guard.level == "approximate"
