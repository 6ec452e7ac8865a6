"""The garbage collector's two pacings (router.runtime.collector): for the live proxy's short
pauses, and for a simulation's throughput. Each hands the collector back as it found it."""

from __future__ import annotations

import gc

import pytest

from router.runtime.collector import BATCH_THRESHOLDS, NEVER, CollectorPacing, paced_for_throughput
from simulator.driver import SimCluster, SimConfig
from simulator.engine import EngineConfig
from tests.unit.test_engine_cohorts import COST, WORKLOADS, chat


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
        assert seen == [(BATCH_THRESHOLDS, True)]
        assert BATCH_THRESHOLDS[1:] == (NEVER, NEVER), "survivors not walked again"
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


@pytest.fixture(scope="module")
def warm() -> None:
    # A process's first run builds some classes once (enums, dataclass helpers): not a run's.
    SimCluster(chat(), COST, SimConfig(num_workers=2)).run()


@pytest.mark.usefixtures("warm")
class TestNoCyclicGarbage:
    """`paced_for_throughput` leaves what survived a young pass uncollected until the run is
    over, which costs nothing only while a run frees what it drops by reference counting. Every
    workload of the cohort differential suite (each policy, split fleets, KV events, adapters,
    classes, preemptions, closed loops) runs with the collector off and must leave no cycle
    behind, its cluster still alive."""

    @pytest.mark.parametrize(
        ("make_trace", "sim", "engine"), [pytest.param(*w[1:4], id=w[0]) for w in WORKLOADS]
    )
    def test_a_run_makes_no_cyclic_garbage(self, make_trace, sim, engine) -> None:
        config = SimConfig(engine=EngineConfig(**engine), **sim)
        cluster = SimCluster(make_trace(), COST, config)
        gc.collect()
        gc.disable()
        try:
            result = cluster.run()
            garbage = gc.collect()
        finally:
            gc.enable()
        assert result.records, "the workload ran"
        assert garbage == 0, f"{garbage} objects freed only by the collector"

    def test_a_cycle_is_seen(self) -> None:
        """The check above sees a cycle a run drops (a policy's own, here)."""
        cluster = SimCluster(chat(), COST, SimConfig(num_workers=2))
        route = cluster.policy.route

        def route_and_drop_a_cycle(request, view):  # type: ignore[no-untyped-def]
            node: dict[str, object] = {}
            node["self"] = node
            return route(request, view)

        cluster.policy.route = route_and_drop_a_cycle  # type: ignore[method-assign]
        gc.collect()
        gc.disable()
        try:
            cluster.run()
            garbage = gc.collect()
        finally:
            gc.enable()
        assert garbage >= len(cluster.trace.requests)
