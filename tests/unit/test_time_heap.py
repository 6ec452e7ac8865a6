"""TimeHeap pops in exactly the order heapq pops (time, worker) tuples: the simulator's records
depend on which engine is synced first when two steps end at the same instant."""

import heapq
import random

import pytest

from simulator.time_heap import TimeHeap


def _drain(heap: TimeHeap) -> list[tuple[float, int]]:
    out = []
    while heap:
        at = heap.first_at()
        out.append((at, heap.pop()))
    return out


@pytest.mark.parametrize("seed", range(5))
def test_pushes_and_pops_interleaved_match_heapq(seed):
    rng = random.Random(seed)
    ours, theirs = TimeHeap(), []
    for _ in range(3000):
        if theirs and rng.random() < 0.45:
            at, payload = ours.first_at(), ours.first_payload()
            popped = (at, ours.pop())
            assert popped == heapq.heappop(theirs)
            assert payload == popped  # what it was pushed with, though its entry is reused
        else:
            # Few distinct times and workers, so ties (and exact duplicates) are common.
            pair = (rng.choice([0.5, 1.0, 1.25, 2.0, float(rng.randrange(50))]), rng.randrange(8))
            ours.push(*pair, pair)
            heapq.heappush(theirs, pair)
        assert len(ours) == len(theirs)
        assert ours.first_at() == (theirs[0][0] if theirs else float("inf"))
    assert _drain(ours) == [heapq.heappop(theirs) for _ in range(len(theirs))]


def test_rebuild_holds_exactly_the_pairs_given():
    rng = random.Random(7)
    heap = TimeHeap()
    for _ in range(20):
        heap.push(rng.random(), rng.randrange(4))
    pairs = [(float(rng.randrange(10)), rng.randrange(100)) for _ in range(500)]
    heap.rebuild(pairs)
    assert _drain(heap) == sorted(pairs)
    heap.rebuild([])
    assert not heap and heap.first_at() == float("inf")
