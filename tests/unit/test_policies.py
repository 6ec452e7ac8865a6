"""Each policy pinned on small hand-built cases, driven by hand through the ClusterView contract."""

from __future__ import annotations

import pytest

import policies
from router.view import ClusterView
from tests.helpers import BS, make_req, make_view, no_cache

# ----------------------------------------------------------------------------------- LPM


class TestLPM:
    @pytest.mark.parametrize(
        "outstanding, held_by, prompt, expected, reason",
        [
            # 3 of 4 blocks cached on worker 1: above the 0.3 threshold.
            ((5, 5, 5), {1: [1, 2, 3]}, [1, 2, 3, 4], 1, "longest prefix match"),
            # 1 of 4 blocks: below threshold -> the worker holding the least.
            ((5, 5, 5), {1: [1], 0: [9, 9, 9]}, [1, 2, 3, 4], 2, "low match: smallest cache"),
            # Imbalanced by both rules (100 - 10 > 64 and 100 > 1.5 x 10): shortest queue.
            ((100, 10, 50), {0: [1, 2, 3, 4]}, [1, 2, 3, 4], 1, "imbalanced: shortest queue"),
            # Apart by 70 but not by the ratio (100 < 1.5 x 70): still locality.
            ((100, 70, 90), {0: [1, 2, 3, 4]}, [1, 2, 3, 4], 0, "longest prefix match"),
        ],
    )
    def test_routing(self, outstanding, held_by, prompt, expected, reason) -> None:
        view = make_view(*outstanding)
        for worker, blocks in held_by.items():
            view.index.insert(blocks, worker, now=0.0)
        decision = policies.global_policies.create("lpm").route(make_req(0, prompt), view)
        assert (decision.worker, decision.reason) == (expected, reason)

    def test_local_order_is_longest_cached_prefix_then_fifo(self) -> None:
        q = policies.local_policies.create("lpm")
        reqs = [make_req(i, [i]) for i in range(4)]
        for r in reqs:
            q.push(r)
        cached = {0: 1, 1: 3, 2: 3, 3: 0}
        assert q.peek(lambda r: cached[r.id]) is reqs[1]
        q.pop(reqs[1], 3 * BS)
        assert q.peek(lambda r: cached[r.id]) is reqs[2]


# ----------------------------------------------------------------------------------- VTC


class TestVTC:
    def test_admits_smallest_counter_fcfs_within_client(self) -> None:
        q = policies.local_policies.create("vtc")
        a1, a2, b1 = make_req(1, [], "a"), make_req(2, [], "a"), make_req(3, [], "b")
        for r in (a1, a2, b1):
            q.push(r)
        assert q.peek(no_cache) is a1  # both at 0: ties by name
        q.pop(a1, 0)
        assert q.counters["a"] == a1.prompt_len  # w_in = 1
        assert q.peek(no_cache) is b1
        q.pop(b1, 0)
        q.on_token(b1, 10)
        assert q.counters["b"] == b1.prompt_len + 2 * 10  # w_out = 2
        assert q.peek(no_cache) is a2

    def test_counter_lift_on_arrival(self) -> None:
        q = policies.local_policies.create("vtc")
        q.counters.update(a=100.0, b=300.0, c=5.0)
        q.push(make_req(1, [], "a"))
        q.push(make_req(2, [], "b"))
        # c arrives while a (100) and b (300) are backlogged: lifted to the minimum, 100.
        q.push(make_req(3, [], "c"))
        assert q.counters["c"] == 100.0
        # A client above the minimum is never lowered.
        q.counters["d"] = 500.0
        q.push(make_req(4, [], "d"))
        assert q.counters["d"] == 500.0

    def test_lift_to_last_departed_when_nobody_is_backlogged(self) -> None:
        q = policies.local_policies.create("vtc")
        r = make_req(1, [], "a")
        q.push(r)
        q.pop(r, 0)  # a leaves the queue with counter = its input
        q.push(make_req(2, [], "z"))
        assert q.counters["z"] == r.prompt_len

    def test_weights_divide_the_charge(self) -> None:
        q = policies.local_policies.create("vtc", w_in=1.0, w_out=2.0)
        r = make_req(1, [], "a", weight=4.0)
        q.push(r)
        q.pop(r, 0)
        q.on_token(r, 8)
        assert q.counters["a"] == r.prompt_len / 4 + 2 * 8 / 4

    def test_preempted_request_is_not_charged_twice(self) -> None:
        q = policies.local_policies.create("vtc")
        r = make_req(1, [], "a")
        q.push(r)
        q.pop(r, 0)
        q.push_front(r)
        assert q.peek(no_cache) is r
        q.pop(r, 0)
        assert q.counters["a"] == r.prompt_len


# ---------------------------------------------------------------------------------- DLPM


class TestDLPM:
    def test_admits_only_clients_in_credit_longest_prefix_first(self) -> None:
        q = policies.local_policies.create("dlpm", quantum=1000)
        a, b = make_req(1, [1, 2], "a"), make_req(2, [7], "b")
        q.push(a)
        q.push(b)
        q.deficits.update(a=-5.0, b=10.0)
        cached = {1: 2, 2: 0}
        # a has the longer prefix but is in deficit: b goes first.
        assert q.peek(lambda r: cached[r.id]) is b

    def test_charges_extend_tokens_and_output(self) -> None:
        q = policies.local_policies.create("dlpm", quantum=1000, w_in=1.0, w_out=2.0)
        r = make_req(1, [1, 2, 3], "a")  # 56 tokens
        q.push(r)
        q.push(make_req(2, [4], "a"))  # a stays backlogged, so it keeps its credit
        q.deficits["a"] = 100.0
        q.pop(r, num_cached_tokens=32)
        assert q.deficits["a"] == 100.0 - (56 - 32)
        q.on_token(r, 5)
        assert q.deficits["a"] == 100.0 - 24 - 10

    def test_refill_when_every_waiting_client_is_in_deficit(self) -> None:
        q = policies.local_policies.create("dlpm", quantum=100)
        a, b = make_req(1, [1], "a"), make_req(2, [2], "b")
        q.push(a)
        q.push(b)
        q.deficits.update(a=-250.0, b=-120.0)
        chosen = q.peek(no_cache)
        # Two quanta turn b positive (-120 + 200 = 80); a gets the same (-50).
        assert chosen is b
        assert q.deficits == {"a": -50.0, "b": 80.0}

    def test_credit_is_not_banked_once_the_queue_empties(self) -> None:
        q = policies.local_policies.create("dlpm", quantum=1000)
        r = make_req(1, [1], "a")
        q.push(r)
        q.deficits["a"] = 500.0
        q.pop(r, 0)
        assert q.deficits["a"] == -r.prompt_len, "credit dropped, the charge is kept"

    def test_larger_quantum_lets_locality_run_longer(self) -> None:
        """Q^u large: a client with a hot prefix keeps going; small: clients alternate
        (the hot client still wins more admissions: its cached requests cost less)."""

        def admitted_clients(quantum: float) -> list[str]:
            q = policies.local_policies.create("dlpm", quantum=quantum)
            reqs = [make_req(i, [1, 2, 3], "hot") for i in range(6)]
            reqs += [make_req(10 + i, [9], "cold") for i in range(6)]
            for r in reqs:
                q.push(r)
            order = []
            for _ in range(6):
                r = q.peek(lambda r: 3 if r.client == "hot" else 0)
                q.pop(r, 3 * BS if r.client == "hot" else 0)
                order.append(r.client)
            return order

        assert admitted_clients(10_000).count("hot") == 6
        assert admitted_clients(10) == ["hot", "hot", "cold", "hot", "hot", "cold"]


# --------------------------------------------------------------------------------- D2LPM


class TestD2LPM:
    def setup_view(self) -> ClusterView:
        view = make_view(3, 1, 0)
        view.index.insert([1, 2, 3, 4], 0, now=0.0)  # worker 0 holds the whole prefix
        view.index.insert([1, 2, 3], 1, now=0.0)  # worker 1 most of it
        return view

    def test_prefers_the_shortest_holder_where_the_client_has_credit(self) -> None:
        policy = policies.global_policies.create("d2lpm", quantum=1000)
        view = self.setup_view()
        # Worker 0 matches more, worker 1 has the shorter queue (1 against 3).
        assert policy.route(make_req(1, [1, 2, 3, 4]), view).worker == 1

    def test_skips_a_holder_where_the_client_is_in_deficit(self) -> None:
        policy = policies.global_policies.create("d2lpm", quantum=1000)
        view = self.setup_view()
        policy.active[1] = {"a": 1, "other": 1}
        policy.deficits[("a", 1)] = -10.0
        policy.deficits[("other", 1)] = 50.0
        assert policy.route(make_req(1, [1, 2, 3, 4]), view).worker == 0

    def test_no_holder_in_credit_goes_to_the_shortest_queue(self) -> None:
        policy = policies.global_policies.create("d2lpm", quantum=1000)
        view = self.setup_view()
        for w in (0, 1):
            policy.active[w] = {"a": 1, "other": 1}
            policy.deficits[("a", w)] = -10.0
            policy.deficits[("other", w)] = 50.0
        decision = policy.route(make_req(1, [1, 2, 3, 4]), view)
        assert decision.worker == 2 and "shortest queue" in decision.reason

    def test_a_holder_where_every_active_client_is_in_deficit_refills(self) -> None:
        policy = policies.global_policies.create("d2lpm", quantum=1000)
        view = self.setup_view()
        policy.active[1] = {"a": 1, "other": 1}
        policy.deficits[("a", 1)] = -10.0
        policy.deficits[("other", 1)] = -1500.0
        assert policy.route(make_req(1, [1, 2, 3, 4]), view).worker == 1
        # One quantum lifts the richest, "a", to credit; everyone there got the same.
        assert policy.deficits[("a", 1)] == 990.0 and policy.deficits[("other", 1)] == -500.0

    def test_dispatch_charges_the_chosen_workers_deficit(self) -> None:
        policy = policies.global_policies.create("d2lpm", quantum=1000)
        view = self.setup_view()
        r = make_req(1, [1, 2, 3, 4])  # 72 tokens, 3 blocks (48) cached on worker 1
        policy.deficits[("a", 1)] = -10.0
        policy.active[1] = {"other": 1}
        policy.deficits[("other", 1)] = 5.0
        policy.active[0] = {"a": 1, "x": 1}
        policy.deficits[("a", 0)] = -1.0
        policy.deficits[("x", 0)] = 5.0
        assert policy.route(r, view).worker == 1  # worker 0: a in deficit there, x not
        policy.on_dispatch(r, 1, view)
        # a joins worker 1 with its debt plus one quantum, then pays the 24 extend tokens.
        assert policy.deficits[("a", 1)] == -10.0 + 1000 - 24
        policy.on_token(r, 1, 3, now=1.0)
        assert policy.deficits[("a", 1)] == -10.0 + 1000 - 24 - 6
