"""The garbage collector's two pacings (router.runtime.collector): for the live proxy's short
pauses, and for a simulation's throughput. Each hands the collector back as it found it."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from pathlib import Path

import pytest

from router.runtime.collector import BATCH_THRESHOLDS, NEVER, CollectorPacing, paced_for_throughput
from tests.unit.test_engine_cohorts import WORKLOADS

ROOT = Path(__file__).resolve().parents[2]


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

    def test_a_dropped_fleet_frees_its_cached_blocks_released_or_not(self) -> None:
        """A run's engines keep their cached blocks in stores of their own
        (simulator/cached_blocks.py): a fleet dropped, whether `simulate` released it first or
        not, no store is kept alive."""
        from router.cost_model import roofline
        from simulator.config import SimConfig
        from simulator.driver import SimCluster
        from traces.generators import shared_prefix

        def holders_left(release: bool) -> list[int]:
            """Of the fleet's stores, with blocks cached at the end, the fleet gone: each one's
            references but ours, where there are any."""
            trace = shared_prefix(num_requests=60, num_tenants=3, prefix_tokens=400, rate=20)
            cost = roofline("llama-3-8b", "a100-80g")
            cluster = SimCluster(trace, cost, SimConfig(num_workers=3))
            cluster.run()
            stores = [engine.blocks.cached for engine in cluster.engines]
            assert sum(len(store) for store in stores) > 50, "few blocks cached tests nothing"
            if release:
                cluster.release()
            del cluster
            gc.collect()  # what is left of the fleet in cycles, its managers with it
            # Three references each: the list's, the loop's and getrefcount's argument's.
            return [n - 3 for n in [sys.getrefcount(s) for s in stores] if n != 3]

        assert holders_left(release=False) == []
        assert holders_left(release=True) == []

    def test_restored_when_the_run_fails(self) -> None:
        thresholds, frozen = gc.get_threshold(), gc.get_freeze_count()
        with pytest.raises(RuntimeError), paced_for_throughput():
            raise RuntimeError("engine error")
        assert gc.get_threshold() == thresholds and gc.get_freeze_count() == frozen


# Run in a fresh interpreter: in a process that ran other tests first, what they left (threads,
# a collector pacing of their own, frozen garbage) can surface in the collection counted here.
GARBAGE_CHECK = """
import gc, json
from simulator.config import SimConfig
from simulator.driver import SimCluster
from simulator.engine import EngineConfig
from tests.unit.test_engine_cohorts import COST, WORKLOADS, chat


def garbage_of(cluster):
    gc.collect()
    gc.disable()
    try:
        result = cluster.run()
        return len(result.records), gc.collect()
    finally:
        gc.enable()


# A process's first run builds some classes once (enums, dataclass helpers): not a run's.
SimCluster(chat(), COST, SimConfig(num_workers=2)).run()
out = {}
for name, make_trace, sim, engine, *_ in WORKLOADS:
    config = SimConfig(engine=EngineConfig(**engine), **sim)
    out[name] = garbage_of(SimCluster(make_trace(), COST, config))

# The check sees a cycle a run drops: a policy that drops one per decision.
cluster = SimCluster(chat(), COST, SimConfig(num_workers=2))
route = cluster.policy.route


def route_and_drop_a_cycle(request, view):
    node = {}
    node["self"] = node
    return route(request, view)


cluster.policy.route = route_and_drop_a_cycle
out["a policy's cycles"] = garbage_of(cluster)
print(json.dumps(out))
"""


@pytest.mark.slow
def test_a_run_makes_no_cyclic_garbage() -> None:
    """`paced_for_throughput` leaves what survived a young pass uncollected until the run is
    over, which costs nothing only while a run frees what it drops by reference counting. Every
    workload of the cohort differential suite (each policy, split fleets, KV events, adapters,
    classes, preemptions, closed loops) runs with the collector off and must leave no cycle
    behind, its cluster still alive; a policy that drops a cycle per decision is seen."""
    done = subprocess.run(
        [sys.executable, "-c", GARBAGE_CHECK],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.splitlines()[-1])
    cycles = found.pop("a policy's cycles")
    assert cycles[1] >= cycles[0] > 0, f"a dropped cycle per decision not seen: {cycles}"
    assert {name for name, *_ in WORKLOADS} == set(found)
    for name, (records, garbage) in found.items():
        assert records > 0, f"{name}: nothing ran"
        assert garbage == 0, f"{name}: {garbage} objects freed only by the collector"
