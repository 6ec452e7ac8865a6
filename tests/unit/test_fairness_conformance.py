"""The fairness disciplines (VTC, DLPM, D²LPM) and the LPM order against their contract and papers:
withdrawal charges nothing, hooks survive failure paths, bounds hold on random workloads."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import policies
from router.policy import LocalPolicy
from router.request import Request
from simulator.config import SimConfig
from simulator.driver import simulate
from simulator.engine import EngineConfig
from simulator.fairness import max_service_gap, service_curves
from tests.helpers import BS, COST, make_req, make_view, no_cache
from traces.schema import Trace


def accounts(q: LocalPolicy) -> dict[str, float]:
    """A discipline's per-client service accounts: VTC's counters, DLPM's deficits."""
    return dict(getattr(q, "counters", None) or getattr(q, "deficits", {}))


def drain(q: LocalPolicy) -> list[Request]:
    """Admit everything waiting, in the discipline's order, with nothing cached."""
    out = []
    while (r := q.peek(no_cache)) is not None:
        q.pop(r, 0)
        out.append(r)
    return out


FAIR_LOCALS = ["vtc", "dlpm"]
ALL_LOCALS = ["fcfs", "lpm", "vtc", "dlpm"]


# ------------------------------------------------------------------- defect 3: withdrawal


class TestRemoveChargesNothing:
    @pytest.mark.parametrize("name", FAIR_LOCALS)
    def test_remove_leaves_the_accounts_as_they_were(self, name: str) -> None:
        q = policies.local_policies.create(name)
        served = make_req(1, [1], "a")
        q.push(served)
        q.pop(served, 0)  # a has been served: a non-trivial account
        q.push(make_req(2, [2], "a"))
        q.push(make_req(3, [3], "b"))
        withdrawn = make_req(4, [4], "b", tail=500)
        q.push(withdrawn)
        before = accounts(q)
        q.remove(withdrawn)
        assert accounts(q) == before, "a withdrawn request must cost its client nothing"
        assert withdrawn not in list(q) and len(q) == 2

    @pytest.mark.parametrize("name", FAIR_LOCALS)
    def test_a_withdrawn_request_is_forgotten(self, name: str) -> None:
        """Removed, then sent again (a retry with the same id): charged once, in full."""
        q = policies.local_policies.create(name)
        r = make_req(1, [1], "a")
        q.push(r)
        q.push(make_req(2, [2], "a"))  # a stays backlogged throughout
        before = accounts(q)["a"]
        q.remove(r)
        q.push(r)
        q.pop(r, 0)
        charged = abs(accounts(q)["a"] - before)
        assert charged == r.prompt_len, "the retry is charged its input once, not twice"

    @pytest.mark.parametrize("name", ALL_LOCALS)
    def test_remove_of_the_last_request_empties_the_client(self, name: str) -> None:
        q = policies.local_policies.create(name)
        r = make_req(1, [1], "a")
        q.push(r)
        q.remove(r)
        assert len(q) == 0 and list(q) == [] and q.peek(no_cache) is None
        q.remove(r)  # not here any more: ignored
        other = make_req(2, [2], "b")
        q.push(other)
        assert drain(q) == [other]

    def test_vtc_client_emptied_by_withdrawal_is_no_longer_backlogged(self) -> None:
        q = policies.local_policies.create("vtc")
        q.counters.update(a=1000.0, b=0.0)
        a, b = make_req(1, [], "a"), make_req(2, [], "b")
        q.push(a)
        q.push(b)
        q.remove(b)
        # b left the queue: the newcomer c is lifted to the smallest *backlogged* counter, a's.
        q.push(make_req(3, [], "c"))
        assert q.counters["c"] == 1000.0

    def test_dlpm_withdrawal_leaves_the_waiting_counts_right(self) -> None:
        """A client emptied by withdrawal is out of the refill: refills go to those waiting."""
        q = policies.local_policies.create("dlpm", quantum=100)
        a, b = make_req(1, [1], "a"), make_req(2, [2], "b")
        q.push(a)
        q.push(b)
        q.deficits.update(a=-250.0, b=-120.0)
        q.remove(b)
        assert q.peek(no_cache) is a
        assert q.deficits == {"a": 50.0, "b": -120.0}, "only a, still waiting, is refilled"


# ------------------------------------------------- defect 4: hooks on failure paths never raise


class TestHooksOnForgottenRequests:
    @pytest.mark.parametrize("name", ALL_LOCALS)
    def test_local_hooks_for_a_request_never_seen(self, name: str) -> None:
        q = policies.local_policies.create(name)
        stranger = make_req(1, [1], "nobody")
        q.on_token(stranger, 5)
        q.on_finish(stranger)
        q.remove(stranger)
        assert accounts(q) == {} and len(q) == 0

    @pytest.mark.parametrize("name", ALL_LOCALS)
    def test_local_discipline_rebuilt_under_running_requests(self, name: str) -> None:
        """A worker marked down gets a fresh discipline while its requests still run: their
        tokens and finishes reach a discipline that never admitted them, and charge nothing."""
        old = policies.local_policies.create(name)
        running = [make_req(i, [i], f"c{i % 2}") for i in range(4)]
        for r in running:
            old.push(r)
        drain(old)
        fresh = policies.local_policies.create(name)
        waiting = make_req(10, [10], "c0")
        fresh.push(waiting)
        before = accounts(fresh)
        for r in running:
            fresh.on_token(r, 7)
            fresh.on_finish(r)
        assert accounts(fresh) == before
        assert drain(fresh) == [waiting]

    def test_d2lpm_hooks_for_unknown_requests_clients_and_workers(self) -> None:
        policy = policies.global_policies.create("d2lpm")
        view = make_view(0, 0)
        stranger = make_req(1, [1], "nobody")
        policy.on_first_token(stranger, 0, 1.0)
        policy.on_token(stranger, 0, 5, 1.0)
        policy.on_token(stranger, 9, 5, 1.0)  # a worker it never heard of
        policy.on_finish(stranger, 9, view)
        policy.on_withdraw(stranger, 9, view)
        policy.on_finish(stranger, 0, view)
        assert policy.deficits == {} and not any(policy.active.values())

    def test_d2lpm_finish_after_withdraw_is_ignored(self) -> None:
        policy = policies.global_policies.create("d2lpm")
        view = make_view(0, 0)
        r, other = make_req(1, [1], "a"), make_req(2, [2], "a")
        for req in (r, other):
            policy.on_dispatch(req, policy.route(req, view).worker, view)
        policy.on_withdraw(r, 0, view)
        policy.on_finish(r, 0, view)  # a late duplicate from a failure path
        assert policy.active[0] == {"a": 1}, "other is still outstanding on worker 0"


# --------------------------------------------- defect 5: DLPM sees every backlogged client


class TestDLPMBeyondTheScanWindow:
    def test_a_calm_client_behind_a_long_burst_is_admitted_soon(self) -> None:
        """300 cached requests of one client (more than the 128 the longest-prefix order
        scans) ahead of one calm request: the calm client is in credit once the flood has
        spent its quantum, and must be found there, not after the whole burst."""
        q = policies.local_policies.create("dlpm", quantum=2048)
        flood = [make_req(i, [1, 2, 3], "flood", tail=200) for i in range(300)]
        calm = make_req(1000, [9], "calm")
        for r in [*flood, calm]:
            q.push(r)
        cached = lambda r: 3 if r.client == "flood" else 0  # noqa: E731
        order = []
        while (r := q.peek(cached)) is not None:
            q.pop(r, cached(r) * BS)
            order.append(r.client)
        # Each flood admission charges its 200 extend tokens: one quantum lasts 11 of them.
        assert order.index("calm") <= 2048 // 200 + 1
        assert order.count("flood") == 300

    def test_refill_counts_clients_beyond_the_window(self) -> None:
        """The richest waiting client decides how many quanta a refill takes, wherever its
        requests wait."""
        q = policies.local_policies.create("dlpm", quantum=100, max_scan=2)
        for i in range(3):
            q.push(make_req(i, [1], "a"))
        b = make_req(10, [2], "b")
        q.push(b)
        q.deficits.update(a=-450.0, b=-50.0)
        # One quantum lifts b (the richest) into credit; a, in the window, stays in deficit.
        assert q.peek(no_cache) is b
        assert q.deficits == {"a": -350.0, "b": 50.0}


# ------------------------------------------------ defect 7: D²LPM's holder and its withdrawal


class TestD2LPMHolders:
    def test_shortest_queue_among_holders_in_credit(self) -> None:
        """Both hold the prefix and the client is in credit on both: the holder with the
        shorter queue wins, even with the shorter match (Cao et al., D²LPM)."""
        policy = policies.global_policies.create("d2lpm")
        view = make_view(48, 8)  # apart by 40: not imbalanced by LPM's guard
        view.index.insert([1, 2, 3, 4], 0, now=0.0)
        view.index.insert([1, 2, 3], 1, now=0.0)
        decision = policy.route(make_req(1, [1, 2, 3, 4]), view)
        assert decision.worker == 1, "a holder with 48 outstanding must not beat one with 8"

    def test_equal_queues_prefer_the_longer_match(self) -> None:
        policy = policies.global_policies.create("d2lpm")
        view = make_view(8, 8)
        view.index.insert([1, 2, 3], 0, now=0.0)
        view.index.insert([1, 2, 3, 4], 1, now=0.0)
        assert policy.route(make_req(1, [1, 2, 3, 4]), view).worker == 1

    @pytest.mark.parametrize("debt", [0.0, -1000.0, 700.0])
    def test_withdraw_undoes_the_dispatch(self, debt: float) -> None:
        """Refund the charge, and the quantum granted on arrival once the client is inactive
        there again. (A refill the dispatch triggered stays: it went to every active client.)"""
        policy = policies.global_policies.create("d2lpm", quantum=2048)
        view = make_view(0, 0)
        view.index.insert([1, 2], 0, now=0.0)
        policy.deficits[("a", 0)] = debt
        before = dict(policy.deficits), policy.deficit("a", 0)
        r = make_req(1, [1, 2, 3, 4], "a", tail=100)  # 2 blocks cached: 100 + 32 extend
        worker = policy.route(r, view).worker
        assert worker == 0
        policy.on_dispatch(r, worker, view)
        assert policy.deficits[("a", 0)] < policy.deficit("a", 1)
        policy.on_withdraw(r, worker, view)
        assert (dict(policy.deficits), policy.deficit("a", 0)) == before
        assert policy.active[0] == {}

    def test_withdraw_refunds_only_its_own_request(self) -> None:
        policy = policies.global_policies.create("d2lpm", quantum=2048)
        view = make_view(0)
        r, other = make_req(1, [1], "a", tail=100), make_req(2, [2], "a", tail=300)
        for req in (r, other):
            policy.route(req, view)
            policy.on_dispatch(req, 0, view)
        after_both = policy.deficits[("a", 0)]
        policy.on_withdraw(other, 0, view)
        assert policy.deficits[("a", 0)] == after_both + other.prompt_len
        assert policy.active[0] == {"a": 1}


# ------------------------------------------------------- item C: LPM as SGLang's scheduler


class TestLPMAsSGLang:
    def test_fcfs_for_the_whole_queue_past_128_waiting(self) -> None:
        """SGLang turns prefix matching off once more than 128 requests wait: pure FCFS, even
        for a cached request among the first 128."""
        q = policies.local_policies.create("lpm")
        reqs = [make_req(i, [100 + i]) for i in range(129)]
        for r in reqs:
            q.push(r)
        cached = lambda r: 5 if r.id == 3 else 0  # noqa: E731
        assert q.peek(cached) is reqs[0]
        q.pop(reqs[0], 0)  # 128 left: sorted by cached prefix again
        assert q.peek(cached) is reqs[3]

    def test_sorts_the_whole_queue_up_to_128(self) -> None:
        q = policies.local_policies.create("lpm")
        reqs = [make_req(i, [100 + i]) for i in range(128)]
        for r in reqs:
            q.push(r)
        assert q.peek(lambda r: 1 if r.id == 127 else 0) is reqs[127]

    def test_a_prefix_being_computed_holds_its_siblings_back(self) -> None:
        """Two uncached requests share a document: once one is admitted, the other waits
        behind unrelated work until the shared blocks are computed, then hits them."""
        q = policies.local_policies.create("lpm")
        doc = [1, 2, 3, 4, 5, 6]
        first, sibling = make_req(1, doc + [7]), make_req(2, doc + [8])
        other = make_req(3, [50, 51, 52])
        for r in (first, sibling, other):
            q.push(r)
        computed: set[int] = set()  # blocks the worker has computed

        def cached(r: Request) -> int:
            n = 0
            while n < r.num_blocks and r.block_hashes[n] in computed:
                n += 1
            return n

        assert q.peek(cached) is first
        q.pop(first, 0)
        assert q.peek(cached) is other, "sibling would recompute the document first is computing"
        q.pop(other, 0)
        assert q.peek(cached) is sibling, "deprioritized, not blocked: nothing else waits"
        computed.update(first.block_hashes)  # first's prefill lands
        q.push(make_req(4, [60, 61, 62]))
        assert q.peek(cached) is sibling and cached(sibling) == 6

    def test_released_once_the_blocks_it_is_matched_on_are_computed(self) -> None:
        """A prompt's last hash may cover a partial block the worker never caches (Mooncake's
        hash_ids): the hold ends with the matched blocks, not the whole prompt, computed."""
        q = policies.local_policies.create("lpm")
        first, sibling, other = make_req(1, [1, 2, 3]), make_req(2, [1, 2, 4]), make_req(3, [9])
        for r in (first, sibling, other):
            q.push(r)
        q.pop(q.peek(no_cache), 0)
        prefix = lambda r: 2 if r.block_hashes[:2] == [1, 2] else 0  # noqa: E731
        assert q.peek(no_cache) is other
        assert q.peek(prefix) is sibling

    def test_siblings_waiting_together_go_one_at_a_time(self) -> None:
        """SGLang's waiting-queue tree: of uncached requests sharing a prefix, the first goes
        in its place, the rest behind everything else."""
        q = policies.local_policies.create("lpm")
        a1, a2, a3 = (make_req(i, [1, 2, 3, 10 + i]) for i in range(3))
        b = make_req(9, [7, 8])
        for r in (a1, a2, a3, b):
            q.push(r)
        order = []
        while (r := q.peek(no_cache)) is not None:
            q.pop(r, 0)
            order.append(r)
        assert order == [a1, b, a2, a3]

    def test_short_shared_prefixes_and_cached_requests_are_not_held_back(self) -> None:
        q = policies.local_policies.create("lpm")
        one_block = [make_req(i, [1, 20 + i]) for i in range(2)]  # share 1 block < 2
        for r in one_block:
            q.push(r)
        q.pop(q.peek(no_cache), 0)
        q.push(make_req(5, [40]))
        assert q.peek(no_cache) is one_block[1]

    def test_in_batch_check_can_be_turned_off(self) -> None:
        q = policies.local_policies.create("lpm", in_batch_check_blocks=None)
        a1, a2, b = make_req(1, [1, 2, 3, 4]), make_req(2, [1, 2, 3, 5]), make_req(3, [9])
        for r in (a1, a2, b):
            q.push(r)
        q.pop(q.peek(no_cache), 0)
        assert q.peek(no_cache) is a2

    def test_a_finished_or_preempted_request_stops_holding_siblings(self) -> None:
        for ending in ("finish", "preempt"):
            q = policies.local_policies.create("lpm")
            a1, a2, b = make_req(1, [1, 2, 3, 4]), make_req(2, [1, 2, 3, 5]), make_req(3, [9])
            for r in (a1, a2, b):
                q.push(r)
            q.pop(q.peek(no_cache), 0)
            if ending == "finish":
                q.on_finish(a1)
                assert q.peek(no_cache) is a2, ending
            else:
                q.push_front(a1)  # back in front: its prefix is not being computed any more
                assert q.peek(no_cache) is a1, ending


# -------------------------------------------------- item D: VTC's cost functions, everywhere


def run(q: LocalPolicy, r: Request, output: int, chunks: int = 3) -> None:
    """Admit waiting `r` (nothing cached) and run it to its finish, its output in parts."""
    q.pop(r, 0)
    for i in range(chunks):
        q.on_token(r, output // chunks + (1 if i < output % chunks else 0))
    q.on_finish(r)


def charged(q: LocalPolicy, client: str) -> float:
    """Service charged to `client` so far: VTC's counter, or DLPM's deficit spent."""
    return q.counters[client] if hasattr(q, "counters") else -q.deficits[client]


class TestCostFunctions:
    @pytest.mark.parametrize("name", FAIR_LOCALS)
    def test_predicted_output_settles_to_the_linear_charge_of_the_real_output(
        self, name: str
    ) -> None:
        q = policies.local_policies.create(name, charge_output="predicted")
        q.push(make_req(99, [99], "a"))  # keeps a backlogged: no lift, no credit dropped
        start = charged(q, "a")
        for i, out in enumerate([40, 100, 7, 55]):
            r = make_req(i, [i], "a", tail=30, out=out)
            q.push(r)
            before, guess = charged(q, "a"), q.meter.predicted.get("a", 0.0)
            q.pop(r, 0)
            upfront = charged(q, "a") - before
            assert upfront == pytest.approx(r.prompt_len + 2 * guess), "prediction charged early"
            for _ in range(out):
                q.on_token(r, 1)
            q.on_finish(r)
            assert charged(q, "a") - before == pytest.approx(r.prompt_len + 2 * out), i
        prompt = BS + 30
        assert charged(q, "a") - start == pytest.approx(4 * prompt + 2 * (40 + 100 + 7 + 55))
        # The prediction is the artifact's moving average over a window of 5.
        assert q.meter.predicted["a"] == pytest.approx(
            (((40 * 4 + 100) / 5 * 4 + 7) / 5 * 4 + 55) / 5
        )

    @pytest.mark.parametrize("cost, first", [("linear", "b"), ("profiled", "a")])
    def test_service_order_follows_the_cost_function(self, cost: str, first: str) -> None:
        """a: long prompts, short answers; b: short prompts, long answers. Linear (1, 2)
        charges a more; the profiled h's x*y and y^2 terms charge b's long decode more."""
        q = policies.local_policies.create("vtc", cost=cost)
        a1, b1 = make_req(1, [], "a", tail=2000, out=10), make_req(2, [], "b", tail=100, out=500)
        for r in (a1, make_req(3, [], "a"), b1, make_req(4, [], "b")):
            q.push(r)  # both stay backlogged throughout
        run(q, a1, 10)
        run(q, b1, 500)
        assert q.peek(no_cache).client == first

    def test_profiled_h_is_the_artifacts_fit(self) -> None:
        from policies.service_cost import VTC_PROFILE

        q = policies.local_policies.create("vtc", cost="profiled")
        r = make_req(1, [], "a", tail=300, out=64)
        q.push(r)
        run(q, r, 64, chunks=7)
        a, b, c, d, e = VTC_PROFILE
        x, y = 300, 64
        assert q.counters["a"] == pytest.approx(a * x + b * y + c * x * y + d * y * y + e)

    @pytest.mark.parametrize("name", ["vtc", "dlpm", "d2lpm"])
    @pytest.mark.parametrize(
        "params, named",
        [
            ({"cost": "quadratic"}, "cost"),
            ({"charge_output": "at_admission"}, "charge_output"),
            ({"cost": "profiled", "cost_coeffs": [1, 2, 3]}, "cost_coeffs"),
            ({"cost": "profiled", "cost_coeffs": [1, 2, 3, -4, 5]}, "cost_coeffs"),
            ({"charge_output": "predicted", "predict_window": 0}, "predict_window"),
        ],
    )
    def test_a_bad_option_names_its_parameter(self, name, params, named) -> None:
        registry = policies.global_policies if name == "d2lpm" else policies.local_policies
        with pytest.raises(ValueError, match=named):
            registry.build(name, params)

    def test_d2lpm_predicted_charge_is_refunded_on_withdraw_and_settled_on_finish(self) -> None:
        policy = policies.global_policies.create("d2lpm", quantum=2048, charge_output="predicted")
        view = make_view(0)
        policy.meter.predicted["a"] = 50.0
        r = make_req(1, [], "a", tail=100, out=20)
        policy.route(r, view)
        policy.on_dispatch(r, 0, view)
        start = policy.deficits[("a", 0)]
        assert start == 2048 - 100 - 2 * 50, "input and predicted output charged at dispatch"
        policy.on_withdraw(r, 0, view)
        assert policy.deficits[("a", 0)] == 0.0, "withdrawn: all of it back"
        policy.route(r, view)
        policy.on_dispatch(r, 0, view)
        policy.on_token(r, 0, 20, now=1.0)
        policy.on_finish(r, 0, view)
        assert policy.deficits[("a", 0)] == 2048 - 100 - 2 * 20, "settled to the real output"


# ------------------------------------ item E: the bounds on random workloads, both placements


class TestBatchedTokens:
    """A simulated engine hands tokens over per batch (`on_tokens`): the accounts must hold
    exactly (==, not approximately) what one hook per request leaves, in every charge mode."""

    PARAMS = [
        {},
        {"cost": "profiled"},  # a charge that depends on each request's own progress
        {"charge_output": "predicted"},
        {"w_out": 3.7, "cost": "profiled", "charge_output": "predicted"},
    ]

    def requests(self) -> list[Request]:
        rng = random.Random(7)
        return [
            make_req(i, [i], f"c{i % 3}", tail=rng.randrange(1, 300), weight=rng.choice([1, 3]))
            for i in range(12)
        ]

    def steps(self) -> list[tuple[list[int], int]]:
        """(indices into the batch, tokens each) for a run of steps; members leave and join."""
        rng = random.Random(11)
        return [
            (sorted(rng.sample(range(12), rng.randrange(1, 12))), rng.choice([1, 1, 5, 33]))
            for _ in range(40)
        ]

    @pytest.mark.parametrize("params", PARAMS)
    @pytest.mark.parametrize("name", FAIR_LOCALS)
    def test_local_disciplines(self, name: str, params: dict) -> None:
        one, batched = (policies.local_policies.create(name, **params) for _ in range(2))
        reqs = self.requests()
        for q in (one, batched):
            for r in reqs:
                q.push(r)
            drain(q)
        for members, n in self.steps():
            for i in members:
                one.on_token(reqs[i], n)
            batched.on_tokens([reqs[i] for i in members], n)
        assert accounts(one) == accounts(batched)

    @pytest.mark.parametrize("params", PARAMS)
    def test_d2lpm(self, params: dict) -> None:
        one, batched = (policies.global_policies.create("d2lpm", **params) for _ in range(2))
        reqs = self.requests()
        stranger = make_req(99, [99], "c0")  # never sent: charges nothing, batched or not
        for policy in (one, batched):
            view = make_view(0, 0)
            for r in reqs:
                policy.on_dispatch(r, r.id % 2, view)
        for members, n in self.steps():
            for worker in (0, 1):
                batch = [reqs[i] for i in members if reqs[i].id % 2 == worker] + [stranger]
                for r in batch:
                    one.on_token(r, worker, n, 0.0)
                batched.on_tokens(batch, worker, n, 0.0)
        assert dict(one.deficits) == dict(batched.deficits)
        assert one.deficits.take() == pytest.approx(batched.deficits.take())  # what replicas get


def random_trace(seed: int, num_clients: int, max_in: int, max_out: int, burst: int) -> Trace:
    """Clients that each send more than one worker serves, at different rates and sizes, and
    optionally one that queues `burst` requests at once first (more than any scan limit).
    No prompt shares a block with another, so every input token is charged as service."""
    rng = random.Random(seed)
    reqs = [
        Request(0, 0.001 * i, rng.randint(1, max_in), rng.randint(1, max_out), client="burst")
        for i in range(burst)
    ]
    for c in range(num_clients):
        rate, t = rng.uniform(5, 20), rng.uniform(0.0, 0.5)
        for _ in range(rng.randint(10, 25)):
            t += rng.expovariate(rate)
            reqs.append(
                Request(0, t, rng.randint(1, max_in), rng.randint(1, max_out), client=f"c{c}")
            )
    reqs.sort(key=lambda r: r.arrival)
    for i, r in enumerate(reqs):
        r.id = i
    return Trace(reqs, BS)


PLACEMENTS = {
    # Concurrency: requests that can run at once, which the bounds carry a term for.
    "engine": lambda n: SimConfig(num_workers=1, engine=EngineConfig(max_num_seqs=n)),
    "router": lambda n: SimConfig(num_workers=1, placement="router", window=n),
}


def service_gap(trace: Trace, config: SimConfig) -> tuple[float, int, int]:
    records = simulate(trace, COST, config).records
    assert len(records) == len(trace.requests), "every request completes"
    gap = max_service_gap(service_curves(records, step=0.01))
    return gap, max(r.prompt_tokens for r in records), max(r.output_tokens for r in records)


workloads = st.fixed_dictionaries(
    {
        "seed": st.integers(0, 10_000),
        "num_clients": st.integers(1, 3),
        "max_in": st.integers(16, 1500),
        "max_out": st.integers(2, 120),
        "burst": st.sampled_from([0, 0, 140]),
    }
)
# A burst of 140 ahead of three clients: DLPM that scanned only the first 128 waiting broke its
# bound here (gap 7,474 against 4,448).
BURST = {"seed": 7, "num_clients": 3, "max_in": 1000, "max_out": 100, "burst": 140}
bounded = settings(
    max_examples=50, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)


class TestServiceGapBounds:
    """VTC: clients backlogged together differ by at most 2 x (max input x w_in + concurrency x
    max output x w_out) of service. DLPM: their deficits get the same refills and stay within
    (-(a request's cost x concurrency), Q], so by at most 2 x (Q + concurrency x (max input x
    w_in + max output x w_out)). Concurrency is what runs at once (the engine's max_num_seqs,
    or the router's window): running requests keep being served whatever the counters say."""

    @bounded
    @given(w=workloads, placement=st.sampled_from(sorted(PLACEMENTS)), n=st.sampled_from([1, 3]))
    @example(w=BURST, placement="engine", n=1)
    @example(w=BURST, placement="router", n=1)
    def test_vtc(self, w, placement, n) -> None:
        config = replace(PLACEMENTS[placement](n), policy="vtc")
        gap, max_in, max_out = service_gap(random_trace(**w), config)
        assert gap <= 2 * (max_in + n * 2 * max_out)

    @bounded
    @given(
        w=workloads,
        placement=st.sampled_from(sorted(PLACEMENTS)),
        n=st.sampled_from([1, 3]),
        quantum=st.sampled_from([64, 1024, 8192]),
    )
    @example(w=BURST, placement="engine", n=1, quantum=1024)
    @example(w=BURST, placement="router", n=1, quantum=1024)
    def test_dlpm(self, w, placement, n, quantum) -> None:
        config = replace(
            PLACEMENTS[placement](n),
            policy="lpm",
            local_policy="dlpm",
            local_params={"quantum": quantum},
        )
        gap, max_in, max_out = service_gap(random_trace(**w), config)
        assert gap <= 2 * (quantum + n * (max_in + 2 * max_out))


OPS = st.lists(
    st.tuples(
        st.sampled_from(
            ["push", "push", "admit", "token", "finish", "withdraw", "preempt", "down"]
        ),
        st.integers(0, 10_000),
    ),
    max_size=80,
)


def shared_blocks(r: Request) -> int:
    """Some prompts share their first two blocks; a cache that holds the first of some."""
    return r.block_hashes[0] % 2


class TestFailurePathsChargeNothing:
    @settings(max_examples=150, deadline=None, derandomize=True)
    @given(
        name=st.sampled_from(ALL_LOCALS), charge=st.sampled_from(["on_token", "predicted"]), ops=OPS
    )
    def test_withdrawal_and_hooks_of_a_replaced_discipline(self, name, charge, ops) -> None:
        """Random pushes, admissions, tokens, finishes, preemptions, withdrawals, and workers
        marked down (the discipline replaced under its running requests, its queue handed
        elsewhere): nothing raises, the queue holds what it should, and neither a withdrawal
        nor a hook for a request the current discipline did not admit charges anything (DLPM
        only drops the unused credit of a client left with nothing waiting, as DRR does)."""
        params = {"charge_output": charge} if name in FAIR_LOCALS else {}
        make = lambda: policies.local_policies.create(name, **params)  # noqa: E731
        q = make()
        waiting: list[Request] = []
        running: list[Request] = []  # admitted by q
        admitted: set[int] = set()  # ever admitted by q (a preempted request is back waiting)
        stale: list[Request] = []  # running, admitted by a discipline since replaced
        for i, (op, x) in enumerate(ops):
            before = accounts(q)
            if op == "push":
                blocks = [x % 7, 100 + x % 5, 1000 + i]
                r = make_req(i, blocks, f"c{x % 3}", tail=x % 50, out=1 + x % 9)
                q.push(r)
                waiting.append(r)
            elif op == "admit":
                r = q.peek(shared_blocks)
                assert (r is None) == (not waiting) and (r is None or r in waiting)
                if r is not None:
                    q.pop(r, shared_blocks(r) * BS)
                    waiting.remove(r)
                    running.append(r)
                    admitted.add(r.id)
            elif op in ("token", "finish") and running + stale:
                pool = running + stale
                r = pool[x % len(pool)]
                is_stale = r in stale
                if op == "token":
                    q.on_token(r, 1 + x % 4)
                else:
                    q.on_finish(r)
                    (stale if is_stale else running).remove(r)
                if is_stale:
                    assert accounts(q) == before, "a stale request charged the new discipline"
            elif op == "withdraw" and waiting:
                r = waiting.pop(x % len(waiting))
                q.remove(r)
                q.remove(r)  # a second time: not here any more, ignored
                after = accounts(q)
                others = {c: v for c, v in before.items() if c != r.client}
                assert {c: v for c, v in after.items() if c != r.client} == others
                if r.client in before:
                    own = before[r.client]
                    if name == "dlpm" and all(w.client != r.client for w in waiting):
                        own = min(own, 0.0)  # DRR: no credit kept with nothing waiting
                    spent = (own - after[r.client]) * (-1 if name == "vtc" else 1)
                    if r.id in admitted:  # preempted back here: settled, which only refunds
                        assert spent <= 1e-9
                    else:
                        assert spent == pytest.approx(0.0), "a withdrawal charged its client"
            elif op == "preempt" and running:
                r = running.pop(x % len(running))
                q.push_front(r)
                waiting.insert(0, r)
            elif op == "down":
                q = make()
                stale += running
                running, waiting, admitted = [], [], set()
            assert len(q) == len(waiting)
            assert sorted(r.id for r in q) == sorted(r.id for r in waiting)

    @settings(max_examples=150, deadline=None, derandomize=True)
    @given(charge=st.sampled_from(["on_token", "predicted"]), ops=OPS)
    def test_d2lpm_hooks_on_failure_paths(self, charge, ops) -> None:
        """Random dispatches, tokens, finishes and withdrawals, some for workers the request
        was not sent to (or that do not exist, as after a removal): nothing raises, the active
        counts are the outstanding requests, and a withdrawal never lowers the client's deficit
        on that worker as a new request would find it."""
        policy = policies.global_policies.create("d2lpm", quantum=500, charge_output=charge)
        view = make_view(0, 0, 0)
        outstanding: dict[int, tuple[Request, int]] = {}  # id -> (request, worker)
        for i, (op, x) in enumerate(ops):
            worker = x % 4  # worker 3 does not exist
            if op in ("push", "admit"):
                r = make_req(i, [x % 5, 10 + x % 3], f"c{x % 3}", tail=x % 80, out=1 + x % 9)
                sent = policy.route(r, view).worker
                policy.on_dispatch(r, sent, view)
                view.index.insert(r.block_hashes, sent, now=float(i))
                outstanding[r.id] = (r, sent)
            elif outstanding:
                r, sent = list(outstanding.values())[x % len(outstanding)]
                target = sent if x % 3 else worker  # now and then the wrong worker
                before = policy.deficit(r.client, target)
                if op == "token":
                    policy.on_token(r, target, 1 + x % 4, now=float(i))
                elif op in ("finish", "down"):
                    policy.on_finish(r, target, view)
                else:
                    policy.on_withdraw(r, target, view)
                    assert policy.deficit(r.client, target) >= before - 1e-9, "withdraw charged"
                if target == sent and op != "token":
                    del outstanding[r.id]
                if target != sent:
                    assert policy.deficit(r.client, target) == before, "charged the wrong worker"
            counts: dict[int, dict[str, int]] = {}
            for r, sent in outstanding.values():
                clients = counts.setdefault(sent, {})
                clients[r.client] = clients.get(r.client, 0) + 1
            assert {w: c for w, c in policy.active.items() if c} == counts
