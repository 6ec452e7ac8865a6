"""The orders a tracked view keeps (least loaded, shortest queue, smallest cache) must name the
same worker a pass over the fleet would, whatever the router core and KV events did since."""

from __future__ import annotations

import random

import pytest

import policies
from policies.baselines import least_tokens
from policies.lpm import shortest_queue, shortest_queue_among, smallest_cache
from router.config import RouterConfig
from router.core import Router
from router.kv_events import KVEventIndexer
from router.request import Request
from router.view import BOXED_IDS, ClusterView, boxed_id

BS = 16
KEYS = (least_tokens, shortest_queue, smallest_cache)


def scanned(view: ClusterView) -> ClusterView:
    """The same state, read by a pass over the workers."""
    return ClusterView(view.now, view.workers, view.index, view.block_size, view.cost)


def assert_orders_agree(view: ClusterView, least_only: bool) -> None:
    plain = scanned(view)
    for key in KEYS:
        assert view.least(key).id == plain.least(key).id, key.__name__
        if least_only:  # the view keeps a heap for a key only ever asked for its least
            continue
        assert view.most(key).id == plain.most(key).id, key.__name__
        assert list(view.ordered(key)) == plain.ordered(key), key.__name__
    assert view.healthy_ids() == plain.healthy_ids()  # kept until the roster changes
    assert view.healthy_set() == set(plain.healthy_ids())
    # Holders of a prefix, some perhaps down: the healthy one with the shortest queue, from
    # the fleet's order (a third of it) or by comparing them (two).
    for every in (3, 13):
        candidates = {w for w in view.workers if w % every == 0}
        healthy = [view.workers[w] for w in candidates if view.workers[w].healthy]
        if healthy:
            expected = min(healthy, key=lambda w: shortest_queue(view, w)).id
            assert shortest_queue_among(view, candidates) == expected
            assert shortest_queue_among(plain, candidates) == expected


@pytest.mark.parametrize("least_only", [False, True])
@pytest.mark.parametrize("precise", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_tracked_orders_match_a_scan(precise: bool, seed: int, least_only: bool) -> None:
    rng = random.Random(seed)
    router = Router(
        policies.global_policies.create("lpm"),
        lambda: policies.local_policies.create("fcfs"),
        RouterConfig(
            block_size=BS,
            window=rng.choice([None, 2]),
            index="precise" if precise else "approximate",
        ),
    )
    # Ids CPython keeps as one object each (to 256), ids the view boxes once, and past those.
    ids = [*range(8), *range(252, 260), *range(BOXED_IDS - 4, BOXED_IDS + 4)]
    for w in ids:
        router.add_worker(w, kv_capacity_blocks=rng.randint(40, 400))
    indexers = {w: KVEventIndexer(router.view.index, w, changed=router.view.changed) for w in ids}
    docs = [[rng.getrandbits(60) for _ in range(rng.randint(2, 30))] for _ in range(12)]
    live: dict[int, Request] = {}
    now = 0.0
    for i in range(1500):
        now += rng.random() * 0.01
        op = rng.random()
        if op < 0.35 or not live:
            blocks = rng.choice(docs) + [rng.getrandbits(60) for _ in range(rng.randint(0, 3))]
            request = Request(i, now, len(blocks) * BS + 1, rng.randint(1, 50), blocks)
            router.route(request, now)
            live[i] = request
        elif op < 0.6:
            router.tokens(live[rng.choice(list(live))], rng.randint(1, 8), now)
        elif op < 0.75:
            request = live.pop(rng.choice(list(live)))
            router.first_token(request, now)
            router.finish(request, now)
        elif op < 0.82:
            router.report(
                rng.choice(ids),
                waiting=rng.randint(0, 3),
                kv_used_blocks=rng.randint(0, 300),
            )
        elif op < 0.86:
            wid = rng.choice(ids)
            for request in router.worker_down(wid, now):
                live.pop(request.id, None)
        elif op < 0.9:
            router.worker_up(rng.choice(ids))
        elif op < 0.95 and precise:  # a worker tells what it stored or evicted
            w, doc = rng.choice(ids), rng.choice(docs)
            if rng.random() < 0.5:
                hashes = doc[: rng.randint(1, len(doc))]
                indexers[w].stored(hashes, None, hashes, now)
            else:
                indexers[w].removed(doc[rng.randint(0, len(doc) - 1) :])
        else:
            router.indexes.set_level(rng.choice(router.indexes.levels()), now)
        if any(s.healthy for s in router.view.workers.values()):
            assert_orders_agree(router.view, least_only)


def test_a_boxed_id_is_the_id_and_below_the_table_one_object() -> None:
    for wid in (0, 7, 256, 257, 1000, BOXED_IDS - 1, BOXED_IDS, 10**6):
        assert boxed_id(wid) == wid and type(boxed_id(wid)) is int
    made = [int(str(w)) for w in (300, BOXED_IDS - 1)]  # new objects, equal to the ids
    assert all(boxed_id(w) is boxed_id(w) and boxed_id(w) is not w for w in made)


@pytest.mark.parametrize("seed", range(4))
def test_least_first_heap_orders_any_key_as_its_tuples_do(seed: int) -> None:
    """The least-only heap compares a key's first term as a float and the tuples on a tie:
    first terms that tie, ints past a float's exact range, floats, and first terms that are not
    numbers must all come out as min() over the tuples has them."""
    rng = random.Random(seed)
    big = 2**60
    values = [
        lambda: rng.randint(0, 5),  # ties, broken by the later terms
        lambda: big + rng.randint(0, 3),  # distinct ints that convert to one float
        lambda: rng.choice([0.5, 1.5, -2.0, float("inf")]),
        lambda: rng.choice(["a", "b", "c"]),  # not a number: the tuples decide
    ]
    draw = rng.choice(values)
    first: dict[int, object] = {}

    def key(view: ClusterView, worker: object) -> tuple:
        wid = worker.id  # type: ignore[attr-defined]
        return (first[wid], -wid % 3, wid)

    router = Router(
        policies.global_policies.create("round_robin"),
        lambda: policies.local_policies.create("fcfs"),
        RouterConfig(block_size=BS),
    )
    view = router.view
    for w in range(40):
        first[w] = draw()
        router.add_worker(w, kv_capacity_blocks=100)
    for _ in range(600):
        wid = rng.randrange(40)
        op = rng.random()
        if op < 0.1:
            view.workers[wid].healthy = not view.workers[wid].healthy
        else:
            first[wid] = draw()
        view.changed(wid)
        healthy = [w for w in view.workers.values() if w.healthy]
        if healthy:
            assert view.least(key).id == min(healthy, key=lambda w: key(view, w)).id
