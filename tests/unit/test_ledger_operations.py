"""The ledger's operations (router/ledger.py): what replicas send a store, and what it makes of
them. A lift repeated by several replicas counts once; charges still add; a replica's values
after a sync are the store's plus what it did since."""

from __future__ import annotations

import math
import random

import pytest

from router.ledger import Ledger, LedgerStore, Refill, Segment, apply_steps

INF = math.inf


def replicas(n: int, **start: float) -> tuple[list[Ledger], LedgerStore]:
    """`n` replicas' ledgers of one counter, all at `start` (synced), and their store."""
    store, ledgers = LedgerStore(), [Ledger() for _ in range(n)]
    for k, v in start.items():
        ledgers[0][k] = v
    sync(ledgers, store)
    return ledgers, store


def sync(ledgers: list[Ledger], store: LedgerStore, key: str = "queue") -> None:
    """Every replica sends, in turn, then every replica takes the store's values."""
    for ledger in ledgers:
        store.apply(key, ledger.take())
    for ledger in ledgers:
        ledger.rebase(store.values.get(key, {}))


def assert_agree(ledgers: list[Ledger], store: LedgerStore, key: str = "queue") -> None:
    for i, ledger in enumerate(ledgers):
        assert dict(ledger) == store.values[key], f"replica {i} is not the store"


class TestLift:
    def test_a_lift_repeated_by_several_replicas_counts_once(self) -> None:
        ledgers, store = replicas(3, flood=1000.0, calm=0.0)
        for ledger in ledgers:
            ledger.raise_to("calm", 1000.0)  # each replica lifts the returning client
        assert all(ledger["calm"] == 1000.0 for ledger in ledgers)
        sync(ledgers, store)
        assert store.values["queue"]["calm"] == 1000.0, "not 3,000: a max, not a difference"
        assert_agree(ledgers, store)

    def test_charges_after_the_lifts_add_up(self) -> None:
        ledgers, store = replicas(3, flood=1000.0)
        for i, ledger in enumerate(ledgers):
            ledger.raise_to("calm", 1000.0)
            ledger["calm"] += 10.0 * (i + 1)  # then each charges its own requests
        sync(ledgers, store)
        assert store.values["queue"]["calm"] == 1060.0
        assert_agree(ledgers, store)

    def test_charges_before_a_lift_below_them_survive_it(self) -> None:
        ledgers, store = replicas(2, calm=100.0)
        ledgers[0]["calm"] += 500.0  # served at one replica: 600
        ledgers[1].raise_to("calm", 300.0)  # lifted at the other, which has not seen it yet
        sync(ledgers, store)
        assert store.values["queue"]["calm"] == 600.0
        assert_agree(ledgers, store)

    def test_a_lift_a_replica_saw_as_a_no_op_still_applies_at_the_store(self) -> None:
        """One router applying the steps in the store's order lifts what the other lowered."""
        ledgers, store = replicas(2, calm=500.0)
        ledgers[0]["calm"] -= 400.0  # a refund: 100
        ledgers[1].raise_to("calm", 300.0)  # 500 here: nothing to lift yet
        sync(ledgers, store)
        assert store.values["queue"]["calm"] == 300.0
        assert_agree(ledgers, store)

    @pytest.mark.parametrize("order", [(0, 1, 2), (2, 1, 0), (1, 2, 0)])
    def test_replicas_agree_whatever_order_they_reach_the_store(self, order) -> None:
        ledgers, store = replicas(3, a=50.0, b=80.0)
        for i, ledger in enumerate(ledgers):
            ledger["a"] += 7.0 * i
            ledger.raise_to("b", 90.0 + i)
            ledger["b"] += 1.0
        for i in order:
            store.apply("queue", ledgers[i].take())
        for ledger in ledgers:
            ledger.rebase(store.values["queue"])
        assert store.values["queue"]["a"] == 50.0 + 7.0 * 3
        assert_agree(ledgers, store)


class TestClampAndRefill:
    def test_a_clamp_repeated_counts_once(self) -> None:
        ledgers, store = replicas(2, c=300.0)
        for ledger in ledgers:
            ledger.lower_to("c", 0.0)  # DLPM: leaving keeps the debt, not the credit
        ledgers[0]["c"] -= 50.0
        sync(ledgers, store)
        assert store.values["queue"]["c"] == -50.0
        assert_agree(ledgers, store)

    def test_a_refill_repeated_by_two_replicas_counts_once(self) -> None:
        ledgers, store = replicas(2, a=-100.0, b=-3000.0)
        for ledger in ledgers:
            ledger.refill(["a", "b"], 2048.0)
        assert dict(ledgers[0]) == {"a": 1948.0, "b": -952.0}
        sync(ledgers, store)
        assert store.values["queue"] == {"a": 1948.0, "b": -952.0}, "the second found a > 0"
        assert_agree(ledgers, store)

    def test_a_refill_with_someone_in_credit_does_nothing(self) -> None:
        ledger = Ledger()
        ledger["a"], ledger["b"] = 5.0, -10.0
        ledger.take()
        ledger.refill(["a", "b"], 2048.0)
        assert dict(ledger) == {"a": 5.0, "b": -10.0} and ledger.take() == []

    def test_charges_between_refills_keep_their_order(self) -> None:
        ledger = Ledger()
        ledger["a"] = -10.0
        ledger.refill(["a"], 8.0)  # -10 -> 6
        ledger["a"] -= 20.0  # -14
        ledger.refill(["a"], 8.0)  # -> 2
        steps = ledger.take()
        assert steps == [
            Segment({"a": (-INF, INF, -10.0)}),
            Refill(("a",), 8.0),
            Segment({"a": (-INF, INF, -20.0)}),
            Refill(("a",), 8.0),
        ]
        values: dict = {}
        apply_steps(values, steps)
        assert values == {"a": 2.0} == dict(ledger)


class TestRebase:
    def test_after_a_sync_a_replica_is_the_store_plus_what_it_did_since(self) -> None:
        ledgers, store = replicas(2, x=10.0)
        a, b = ledgers
        a["x"] += 5.0
        store.apply("queue", a.take())  # a's round trip begins
        a["x"] += 2.0  # charged while the reply is on its way
        a.raise_to("y", 4.0)
        b["x"] += 100.0
        store.apply("queue", b.take())  # b's round lands first
        a.rebase(store.values["queue"])
        assert dict(a) == {"x": 117.0, "y": 4.0}, "the store's 115, plus 2, plus the lift"
        assert a.take() == [Segment({"x": (-INF, INF, 2.0), "y": (4.0, INF, 0.0)})]

    def test_own_adjustments_stay_across_syncs(self) -> None:
        ledgers, store = replicas(2, k=-100.0)
        ledgers[0].adjust("k", 2048.0)  # D²LPM's activation: this replica's own
        ledgers[0]["k"] -= 48.0
        sync(ledgers, store)
        assert store.values["queue"]["k"] == -148.0
        assert ledgers[0]["k"] == 1900.0 and ledgers[1]["k"] == -148.0
        sync(ledgers, store)
        assert ledgers[0]["k"] == 1900.0, "not added twice"

    def test_untouched_keys_are_not_sent(self) -> None:
        ledger = Ledger()
        ledger.setdefault("idle", 0.0)
        ledger["same"] = 0.0
        assert ledger.take() == []


def test_random_operations_replay_to_the_same_values() -> None:
    """Whatever a replica does, its steps applied to its starting values give its values."""
    rng = random.Random(3)
    for _ in range(500):
        ledger, start = Ledger(), {k: rng.uniform(-50, 50) for k in "abc"}
        for k, v in start.items():
            ledger[k] = v
        ledger.take()
        for _ in range(rng.randrange(1, 15)):
            k, op = rng.choice("abcd"), rng.randrange(4)
            if op == 0:
                ledger[k] = ledger.get(k, 0.0) + rng.uniform(-20, 20)
            elif op == 1:
                ledger.raise_to(k, rng.uniform(-30, 30))
            elif op == 2:
                ledger.lower_to(k, rng.uniform(-30, 30))
            else:
                ledger.refill(rng.sample("abcd", 2), 16.0)
        values = dict(start)
        apply_steps(values, ledger.take())
        assert values == pytest.approx(dict(ledger), abs=1e-9)
