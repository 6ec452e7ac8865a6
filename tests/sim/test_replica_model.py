"""The simulator's router replicas follow the live replicas' rule (router/ledger.py): at each
sync every replica sends its steps to one store, and takes the store's values. Right after a
sync every replica's ledgers are the store's (D²LPM's up to each replica's own activation
grants), under every fairness policy's operations: VTC's lifts, DLPM's clamps and refills. The
store applies the same arithmetic as the live replicas' Redis script (checked against a real
redis-server in tests/system/test_replica_agreement.py)."""

from __future__ import annotations

import pytest

from router.cost_model import roofline
from simulator.config import SimConfig
from simulator.driver import SimCluster
from traces.generators import flood

COST = roofline("llama-3-8b", "a100-80g")


class CheckedCluster(SimCluster):
    """Checks, right after every sync, that each replica holds the store's values."""

    num_checked = 0

    def _sync_routers(self):
        syncs = super()._sync_routers()
        event = next(syncs)  # the first wait
        while True:
            yield event
            event = next(syncs, None)  # one sync, up to the next wait
            self.check_replicas_hold_the_store()
            if event is None:
                return

    def check_replicas_hold_the_store(self) -> None:
        store = self.ledger_store
        for i, router in enumerate(self.routers):
            for key, ledger in router.ledgers().items():
                stored = store.values.get(key, {})
                if self.config.policy != "d2lpm":
                    assert not ledger.local, "only D²LPM's activations are a replica's own"
                for field in set(ledger) | set(stored):
                    mine = ledger.get(field, 0.0) - ledger.local.get(field, 0.0)
                    assert mine == stored.get(field, 0.0), (i, key, field, mine, stored)
        self.num_checked += 1


def run(policy: str, local: str | None, routers: int = 3, sync: float = 0.5) -> CheckedCluster:
    trace = flood(duration=20.0, flood_rate=40.0, calm_rate=3.0, seed=1)
    config = SimConfig(
        num_workers=2,
        policy=policy,
        local_policy=local,
        placement="router",
        window=8,
        routers=routers,
        router_sync=sync,
    )
    cluster = CheckedCluster(trace, COST, config)
    summary = cluster.run().summary
    assert summary["completed"] == len(trace)
    return cluster


@pytest.mark.parametrize(
    "policy, local", [("vtc", None), ("lpm", "dlpm"), ("d2lpm", "dlpm"), ("least_load", "lcf")]
)
def test_every_replica_holds_the_store_after_every_sync(policy: str, local: str | None) -> None:
    cluster = run(policy, local)
    assert cluster.num_checked > 10
    assert any(cluster.ledger_store.values.values()), "something was charged"


def test_the_store_holds_every_replicas_charges_once() -> None:
    """With nothing but charges (LCF: VTC without the lift), the store's total is what one
    router would have charged: the sum of every replica's, each once."""
    cluster = run("least_load", "lcf")
    for key in cluster.routers[0].ledgers():
        stored = cluster.ledger_store.values.get(key, {})
        assert all(v >= 0 for v in stored.values()), (key, stored)
    total = sum(sum(v.values()) for v in cluster.ledger_store.values.values())
    charged = sum(r.prompt_len + 2 * r.output_len for r in cluster.trace.requests)
    assert total == pytest.approx(charged, rel=1e-9)


def test_a_write_through_store_gives_every_replica_the_same_ledgers() -> None:
    """Sync 0: the replicas' counters are one object, the global policy's (D²LPM's deficits)
    and each worker's queue discipline's alike."""
    cluster = run("d2lpm", "dlpm", sync=0.0)
    first = cluster.routers[0].ledgers()
    assert ("global", "deficits") in first and any(k[0] == "queue" for k in first)
    for router in cluster.routers[1:]:
        ledgers = router.ledgers()
        assert ledgers.keys() == first.keys()
        assert all(ledgers[key] is first[key] for key in first)
    assert cluster.num_checked == 0, "no sync ran: one store, written through"
