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

    def test_a_simulation_leaves_its_cached_blocks_to_reference_counting(self) -> None:
        """A run's engines keep their cached blocks in a free LRU linked both ways: dropped as
        they are, only the collector's walk frees them, and the next run in the process (a
        plan's next candidate) would freeze them with the living. `simulate` releases them."""
        from router.cost_model import roofline
        from simulator.block_manager import CachedBlock
        from simulator.config import SimConfig
        from simulator.driver import SimCluster, simulate
        from traces.generators import shared_prefix

        def blocks_left_to_the_collector(run) -> int:
            gc.collect()
            gc.disable()
            try:
                trace = shared_prefix(num_requests=60, num_tenants=3, prefix_tokens=400, rate=20)
                run(trace, roofline("llama-3-8b", "a100-80g"), SimConfig(num_workers=3))
                gc.set_debug(gc.DEBUG_SAVEALL)
                gc.collect()
                # Each manager's LRU end is a block of no hash, linked to itself.
                return sum(isinstance(o, CachedBlock) and o.hash is not None for o in gc.garbage)
            finally:
                gc.set_debug(0)
                gc.garbage.clear()
                gc.enable()

        def unreleased(trace, cost, config) -> None:
            SimCluster(trace, cost, config).run()

        assert blocks_left_to_the_collector(unreleased) > 50
        assert blocks_left_to_the_collector(simulate) == 0

    def test_a_released_run_hands_the_collector_back_without_its_blocks(self) -> None:
        """The collector's next pass after a run walks what the run left young and alive.
        Released before the collector is handed back, the engines' cached blocks and the
        blocks the hit bound saw are not in it; kept, they were most of it (0.07 s of a
        512-worker run)."""
        from router.cost_model import roofline
        from simulator.config import SimConfig
        from simulator.driver import SimCluster
        from tests.unit.test_engine_cohorts import long_prompts

        def young_at_the_next_pass(release: bool) -> int:
            """The objects the first pass after the run walks."""
            counts: list[int] = []

            def note(phase: str, info: dict[str, int]) -> None:
                if phase == "start" and not counts:
                    counts.append(gc.get_count()[0])

            cluster = SimCluster(long_prompts(), roofline("llama-3-8b", "a100-80g"),
                                 SimConfig(num_workers=2))  # fmt: skip
            gc.collect()
            gc.callbacks.append(note)
            try:
                cluster.run(release=release)
                gc.collect(0)
            finally:
                gc.callbacks.remove(note)
            return counts[0]

        kept = young_at_the_next_pass(release=False)
        released = young_at_the_next_pass(release=True)
        blocks = len({h for r in long_prompts().requests for h in r.block_hashes})
        assert kept - released > blocks // 2, (kept, released, blocks)
        assert released < kept / 4, (kept, released)

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
