"""Router replicas in the simulator, and the ledgers they share counters through."""

from __future__ import annotations

import pytest

from policies.service_params import ServiceCostParams
from router.cost_model import roofline
from router.ledger import Ledger, LedgerStore, Segment
from router.request import Request
from simulator.config import SimConfig
from simulator.driver import SimCluster
from traces.generators import flood

COST = roofline("llama-3-8b", "a100-80g")


def test_ledger_records_changes_and_converges_in_any_order() -> None:
    for order in ((0, 1), (1, 0)):
        ledgers, store = [Ledger(), Ledger()], LedgerStore()
        a, b = ledgers
        a["x"] = 5.0
        a["x"] -= 2.0
        a.setdefault("y", 0.0)
        b["x"] = max(b.get("x", 0.0), 7.0)  # written as a charge, it is one: +7
        for i in order:
            store.apply("k", ledgers[i].take())
        for ledger in ledgers:
            ledger.rebase(store.values["k"])
        assert a["x"] == b["x"] == 10.0
        assert a.take() == [] and b.take() == [], "the store's values are not re-sent"


def test_a_meters_batch_charges_reach_the_other_replicas() -> None:
    """The service meter (compiled, see router/runtime/native.py) writes a batch's charges into the
    ledger through its own item assignment, so each is recorded for the other replicas."""
    meter, ledger = ServiceCostParams(w_in=1.0, w_out=2.0).meter(), Ledger()
    a, b = Request(1, 0.0, 100, 10, [], client="a"), Request(2, 0.0, 100, 10, [], client="b")
    for r in (a, b):
        ledger[r.client] = ledger.get(r.client, 0.0) - meter.start(r, 40)
    ledger.take()
    meter.charge_tokens([a, b, a], 3, ledger, -1)  # a twice: one write of both
    assert dict(ledger) == {"a": -40.0 - 12.0, "b": -40.0 - 6.0}
    inf = float("inf")
    assert ledger.take() == [Segment({"a": (-inf, inf, -12.0), "b": (-inf, inf, -6.0)})]


def test_a_lift_made_at_two_replicas_counts_once() -> None:
    """VTC lifts an arriving client to where the others stand. Two replicas lifting the same
    client between two syncs must not add the lift up (a shared difference did: 0 -> 2,000)."""
    store, ledgers = LedgerStore(), [Ledger(), Ledger()]
    for ledger in ledgers:
        ledger["flood"] = 1000.0
        ledger.take()
    store.apply("k", ledgers[0].take())
    a, b = ledgers
    a.raise_to("calm", 1000.0)
    b.raise_to("calm", 1000.0)
    a["calm"] += 10.0  # then each charges the calm client's admitted request
    b["calm"] += 10.0
    for ledger in ledgers:
        store.apply("k", ledger.take())
    for ledger in ledgers:
        ledger.rebase(store.values["k"])
    assert a["calm"] == b["calm"] == 1020.0


@pytest.fixture(scope="module")
def runs() -> dict[tuple[int, float], tuple[SimCluster, dict]]:
    out = {}
    for n, sync in ((1, 0.0), (3, 0.0), (3, 0.5), (3, 10.0)):
        trace = flood(duration=30.0, flood_rate=60.0, calm_rate=3.0, seed=0)
        config = SimConfig(
            num_workers=3, policy="vtc", placement="router", window=16, routers=n, router_sync=sync
        )
        cluster = SimCluster(trace, COST, config)
        out[(n, sync)] = (cluster, cluster.run().summary)
    return out


def test_every_request_completes_whatever_the_replicas(runs) -> None:
    for cluster, summary in runs.values():
        assert summary["completed"] == summary["total"] == len(cluster.trace)
        for router in cluster.routers:
            assert all(s.tokens_in_flight == 0 for s in router.view.workers.values())


def test_sync_zero_shares_one_store(runs) -> None:
    cluster, _ = runs[(3, 0.0)]
    first = cluster.routers[0].ledgers()
    for router in cluster.routers[1:]:
        for key, ledger in router.ledgers().items():
            assert ledger is first[key]


def test_replicas_agree_after_a_sync(runs) -> None:
    """After the run's last sync, one more: every replica's values are the store's."""
    cluster, _ = runs[(3, 10.0)]
    store = cluster.ledger_store
    for router in cluster.routers:
        for key, ledger in router.ledgers().items():
            store.apply(key, ledger.take())
    for router in cluster.routers:
        for key, ledger in router.ledgers().items():
            ledger.rebase(store.values[key])
    for router in cluster.routers:
        for key, ledger in router.ledgers().items():
            assert dict(ledger) == store.values[key], key
    assert any(store.values.values()), "the run charged"


def test_replicas_behind_a_round_robin_balancer_stay_about_as_fair_as_one_router(runs) -> None:
    """Each replica sees the same mix of clients, so its own counters rank them as shared
    ones would, whatever the sync. (With lifts shared as additions, a calm client lifted at
    every replica was lifted once per replica: its TTFT was 20x one router's at a 10 s sync.)"""
    calm = {
        k: sum(c["ttft"]["mean"] for n, c in s["per_client"].items() if n != "flood")
        for k, (_, s) in runs.items()
    }
    for key in ((3, 0.0), (3, 0.5), (3, 10.0)):
        assert calm[key] < 1.5 * calm[(1, 0.0)], (key, calm)
