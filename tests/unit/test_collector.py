"""The garbage collector's two pacings (router.runtime.collector): for the live proxy's short
pauses, and for a simulation's throughput. Each hands the collector back as it found it."""

from __future__ import annotations

import gc

import pytest

from router.runtime.collector import CollectorPacing, paced_for_throughput


class TestCollectorPacing:
    """What keeps a large index out of the collector's walks (router.runtime.collector)."""

    def test_freezes_on_schedule_and_hands_the_collector_back(self) -> None:
        before = gc.get_threshold()
        pacing = CollectorPacing(every=10.0, gen0_threshold=200, gen1_threshold=3)
        try:
            pacing.tick(0.0)
            assert gc.get_threshold()[:2] == (200, 3), "young passes small"
            frozen = gc.get_freeze_count()
            survivors = [[i] for i in range(1000)]
            pacing.tick(5.0)
            # Not an equality: a frozen object an earlier test left leaves the count as it dies.
            assert gc.get_freeze_count() <= frozen, "nothing frozen before `every` elapsed"
            pacing.tick(10.0)
            assert gc.get_freeze_count() >= frozen + len(survivors), "survivors frozen"
        finally:
            pacing.stop()
        assert gc.get_threshold() == before and gc.get_freeze_count() == 0


class TestPacedForThroughput:
    """A batch run (a simulation) paces the process's collector for throughput and hands it back."""

    def test_a_run_freezes_the_heap_and_restores_the_collector(self) -> None:
        thresholds, frozen = gc.get_threshold(), gc.get_freeze_count()
        seen = []
        with paced_for_throughput():
            seen.append((gc.get_threshold(), gc.get_freeze_count() > 0))
        assert seen == [((50_000, 50, 100), True)]
        assert gc.get_threshold() == thresholds and gc.get_freeze_count() == frozen

    def test_a_callers_freeze_is_left_alone(self) -> None:
        gc.freeze()
        try:
            frozen = gc.get_freeze_count()
            with paced_for_throughput():
                pass
            # Still frozen, and not frozen again. (Not an equality: a frozen object that the
            # previous tests left only referenced from a frame leaves the count when it dies.)
            assert 0 < gc.get_freeze_count() <= frozen
        finally:
            gc.unfreeze()

    def test_restored_when_the_run_fails(self) -> None:
        thresholds, frozen = gc.get_threshold(), gc.get_freeze_count()
        with pytest.raises(RuntimeError), paced_for_throughput():
            raise RuntimeError("engine error")
        assert gc.get_threshold() == thresholds and gc.get_freeze_count() == frozen
