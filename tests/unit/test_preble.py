"""Preble's E2 (global) and its hit-ratio priority groups (local), pinned on hand-built views."""

from __future__ import annotations

import pytest

import policies
from router.request import Request
from router.view import ClusterView
from tests import helpers
from tests.helpers import BS, COST, make_view


def make_req(i: int, blocks: list[int], tail: int = 8, out: int = 10) -> Request:
    return helpers.make_req(i, blocks, "default", tail, out)


def prefix(g: int, n: int = 8) -> list[int]:
    """A group's shared prefix: `n` blocks no other group has."""
    return [1000 * g + k for k in range(n)]


def dispatch(policy, view: ClusterView, req: Request, now: float | None = None) -> int:
    """Route `req` and dispatch it as the backends do: the index learns the prompt first."""
    if now is not None:
        view.now = now
    worker = policy.route(req, view).worker
    view.index.insert(req.block_hashes, worker, now=view.now)
    policy.on_dispatch(req, worker, view)
    return worker


def run(policy, req: Request, worker: int, first: float, last: float, num_output: int) -> None:
    """Stream `req` on `worker`: its first token at `first`, the rest evenly until `last`."""
    policy.on_first_token(req, worker, first)
    policy.on_token(req, worker, 1, first)  # the first token is also counted, as engines do
    for k in range(1, num_output):
        policy.on_token(req, worker, 1, first + (last - first) * k / (num_output - 1))


def decode_estimate(req: Request) -> float:
    return req.output_len * COST.decode_time(1, req.prompt_len)


def cached_all(r: Request) -> int:
    return r.num_blocks


def cached_none(_: Request) -> int:
    return 0


# ------------------------------------------------------------------ local: hit-ratio groups


class TestLocalGroups:
    def test_share_in_proportion_to_hit_ratio(self) -> None:
        q = policies.local_policies.create("preble", num_groups=2)
        hi = [make_req(i, [1, 2]) for i in range(40)]
        lo = [make_req(100 + i, [7, 8]) for i in range(40)]
        for r in hi + lo:
            q.push(r)
        cached = lambda r: 2 if r.id < 100 else 0  # noqa: E731
        served = []
        for _ in range(30):
            r = q.peek(cached)
            q.pop(r, 0)
            served.append(r.id < 100)
        assert served.count(True) == 20 and served.count(False) == 10, "2:1 shares"


class TestLocalRemove:
    """A queued request withdrawn (queue timeout, worker down) leaves without a charge."""

    def test_remove_a_request_never_peeked(self) -> None:
        q = policies.local_policies.create("preble", num_groups=2)
        a, b = make_req(1, [1, 2]), make_req(2, [3, 4])
        q.push(a)
        q.push(b)
        q.remove(a)  # still ungrouped: the engine never looked at it
        assert list(q) == [b] and len(q) == 1
        assert q.peek(cached_none) is b

    def test_remove_a_grouped_request_charges_nothing(self) -> None:
        q = policies.local_policies.create("preble", num_groups=2)
        reqs = [make_req(i, [i]) for i in range(3)]
        for r in reqs:
            q.push(r)
        assert q.peek(cached_all) is reqs[0]  # all three joined the high-hit group
        passes = list(q.passes)
        q.remove(reqs[1])
        assert q.passes == passes, "a withdrawn request is not served: no stride charge"
        assert list(q) == [reqs[0], reqs[2]] and len(q) == 2
        q.pop(reqs[0], 0)
        assert q.peek(cached_all) is reqs[2]

    def test_remove_the_last_of_a_group_then_peek(self) -> None:
        q = policies.local_policies.create("preble", num_groups=2)
        a = make_req(1, [1])
        q.push(a)
        assert q.peek(cached_none) is a
        q.remove(a)
        assert len(q) == 0 and q.peek(cached_none) is None

    def test_unknown_request_is_ignored(self) -> None:
        q = policies.local_policies.create("preble", num_groups=2)
        a, stranger = make_req(1, [1]), make_req(9, [9])
        q.push(a)
        q.remove(stranger)
        q.remove(a)
        q.remove(a)  # twice: the second is a stranger too
        q.on_token(stranger, 3)
        q.on_finish(stranger)
        assert len(q) == 0 and list(q) == []

    def test_a_removed_request_can_come_back(self) -> None:
        q = policies.local_policies.create("preble", num_groups=2)
        a = make_req(1, [1])
        q.push(a)
        q.peek(cached_all)
        q.remove(a)
        q.push(a)  # re-queued elsewhere or retried: it joins afresh
        assert q.peek(cached_none) is a
        q.pop(a, 0)
        assert len(q) == 0


# ------------------------------------------------------------------ global: exploit, explore


class TestExploitExplore:
    def test_exploit_the_lighter_holder_when_cached_part_exceeds_missed_part(self) -> None:
        policy = policies.global_policies.create("preble")
        view = make_view(0, 0, 0)
        view.index.insert([1, 2, 3], 1, now=0.0)
        view.index.insert([1, 2, 3], 2, now=0.0)
        policy.on_dispatch(make_req(9, [77], out=500), 1, view)  # worker 1 is busy
        decision = policy.route(make_req(1, [1, 2, 3, 4]), view)  # 48 cached of 72
        assert (decision.worker, decision.reason) == (2, "exploit")

    def test_explore_minimises_load_plus_eviction_plus_prefill(self) -> None:
        policy = policies.global_policies.create("preble")
        view = make_view(0, 0, 0, capacity=4)
        view.index.insert([1], 0, now=0.0)  # 1 of 4 blocks cached: explore
        for t in range(5):  # full, with a hot prefix that placing the request here evicts
            view.index.insert([50, 51, 52, 53], 1, now=float(t))
        policy.on_dispatch(make_req(9, [77], out=5000), 2, view)  # worker 2 is very busy
        req = make_req(1, [1, 2, 3, 4])
        terms = policy.explore_costs(req, view, view.index.match(req.block_hashes))
        assert terms[1][0] == 0 and terms[1][1] > 0, "worker 1 must evict its hot prefix"
        assert terms[2][0] == policy.load(2) > 0 and terms[2][1] == 0
        assert terms[0][:2] == (0.0, 0.0), "worker 0: no load, nothing to evict"
        decision = policy.route(req, view)
        assert (decision.worker, decision.reason) == (0, "explore")

    def test_requests_sharing_a_new_prefix_join_the_group_of_the_first(self) -> None:
        """The first request of a document explores and names a group of its own; the next
        ones find the document cached and join that group, with its cost."""
        policy = policies.global_policies.create("preble")
        view = make_view(0, 0)
        first, second = make_req(1, [*prefix(1), 101]), make_req(2, [*prefix(1), 102])
        w = dispatch(policy, view, first)
        assert policy.route(second, view).reason == "exploit"
        assert dispatch(policy, view, second) == w
        assert policy.window.count == {101: 2}, "one group, named by the first request"
        assert policy.alloc == {101: {w}}


# ------------------------------------------------------------------ global: load L


class TestLoad:
    def test_prefill_of_what_is_new_to_the_cluster_and_estimated_decode(self) -> None:
        """Until a worker has a measured time per token, the cost model prices decode; the
        prefill counted is of the tokens no worker holds, wherever the request runs."""
        policy = policies.global_policies.create("preble")
        view = make_view(0, 0)
        view.index.insert(prefix(1), 1, now=0.0)
        req = make_req(1, [*prefix(1), 9])
        policy.route(req, view)
        policy.on_dispatch(req, 0, view)  # sent to worker 0, which does not hold the prefix
        cached = 8 * BS
        expected = COST.prefill_time(req.prompt_len - cached, cached) + decode_estimate(req)
        assert policy.load(0) == pytest.approx(expected)
        assert policy.load(1) == 0.0

    def test_measured_time_per_output_token_prices_later_requests(self) -> None:
        policy = policies.global_policies.create("preble")
        view = make_view(0, 0)
        a = make_req(1, [1], out=10)
        policy.on_dispatch(a, 0, view)
        run(policy, a, 0, first=1.0, last=1.9, num_output=10)  # 9 gaps of 0.1 s
        policy.on_finish(a, 0, view)
        before = policy.load(0)
        b = make_req(2, [2], out=20)
        policy.on_dispatch(b, 0, view)
        prefill = COST.prefill_time(b.prompt_len, 0)
        assert policy.load(0) - before == pytest.approx(prefill + 20 * 0.1)
        c = make_req(3, [3], out=20)
        policy.on_dispatch(c, 1, view)  # worker 1 has no sample yet: the cost model
        assert policy.load(1) == pytest.approx(prefill + decode_estimate(c))

    def test_time_per_token_is_the_median_of_recent_requests(self) -> None:
        policy = policies.global_policies.create("preble", tpot_samples=3)
        view = make_view(0)
        for i, gap in enumerate([0.5, 0.01, 0.02, 0.03]):  # the first falls out of the 3
            r = make_req(i, [i], out=5)
            policy.on_dispatch(r, 0, view)
            run(policy, r, 0, first=10.0 * i, last=10.0 * i + 4 * gap, num_output=5)
            policy.on_finish(r, 0, view)
        assert list(policy.tpot[0]) == pytest.approx([0.01, 0.02, 0.03])
        before, r = policy.load(0), make_req(9, [9], out=100)
        policy.on_dispatch(r, 0, view)
        assert policy.load(0) - before == pytest.approx(COST.prefill_time(r.prompt_len, 0) + 2.0)

    def test_tokens_counted_late_and_summed_give_the_same_time_per_token(self) -> None:
        """`tokens_read_at_finish`: a simulator may settle a decode run's tokens at its end,
        summed and stamped with the last one's time; the sample must not change."""
        assert policies.global_policies.get("preble").traits.tokens_read_at_finish
        view = make_view(0)
        samples = []
        for summed in (False, True):
            policy = policies.global_policies.create("preble")
            r = make_req(1, [1], out=9)
            policy.on_dispatch(r, 0, view)
            if summed:
                policy.on_first_token(r, 0, 1.0)
                policy.on_token(r, 0, 1, 1.0)
                policy.on_token(r, 0, 5, 1.5)  # steps 2-6, told at the 6th's end
                policy.on_token(r, 0, 3, 1.8)  # the rest, at the finish
            else:
                run(policy, r, 0, first=1.0, last=1.8, num_output=9)
            policy.on_finish(r, 0, view)
            samples.append(list(policy.tpot[0]))
        assert samples[0] == samples[1] == [pytest.approx(0.1)]

    def test_a_groups_prefill_is_split_over_its_workers_and_decode_stays_put(self) -> None:
        """As the reference's get_node_cost: the group's prefill divided by the number of
        workers it is allocated to; each request's decode where it runs."""
        policy = policies.global_policies.create("preble")
        view = make_view(0, 0, 0)
        view.index.insert(prefix(1), 0, now=0.0)
        view.index.insert(prefix(1), 1, now=0.0)
        short, long = make_req(1, [*prefix(1), 101], out=10), make_req(2, [*prefix(1), 102], out=90)
        for r, w in ((short, 0), (long, 1)):
            policy.route(r, view)
            policy.on_dispatch(r, w, view)
        assert policy.alloc == {prefix(1)[-1]: {0, 1}}
        cached = 8 * BS
        half = COST.prefill_time(short.prompt_len - cached, cached)  # both alike: 2 halves
        assert policy.load(0) == pytest.approx(half + decode_estimate(short))
        assert policy.load(1) == pytest.approx(half + decode_estimate(long))
        assert policy.load(2) == 0.0

    def test_work_leaves_with_the_window_and_so_does_the_allocation(self) -> None:
        policy = policies.global_policies.create("preble", window=10.0)
        view = make_view(0, 0)
        dispatch(policy, view, make_req(1, [1, 2]), now=0.0)
        assert policy.load(0) + policy.load(1) > 0 and policy.alloc
        view.now = 10.5
        policy.route(make_req(2, [7]), view)
        assert policy.load(0) == policy.load(1) == 0.0
        assert not policy.alloc and not policy.window.count


# ------------------------------------------------------------------ global: eviction cost M


class TestEvictionCost:
    def setup_view(self, capacity: int) -> ClusterView:
        view = make_view(0, capacity=capacity)
        for t in range(3):  # 38 blocks, reused three times
            view.index.insert(list(range(500, 538)), 0, now=float(t))
        return view

    def test_a_full_cache_evicts_the_missed_blocks_even_with_room_left(self) -> None:
        """38 of 40 blocks held: 2 free fit the 2 missed blocks, but the cache is full (an LRU
        cache in steady state), so placing the request evicts as many as it brings."""
        policy = policies.global_policies.create("preble")
        view = self.setup_view(capacity=40)
        req = make_req(1, [1, 2])
        _, evict, _ = policy.explore_costs(req, view, {})[0]
        node = view.index.path(list(range(500, 538)))[0]
        hot = COST.prefill_time(38 * BS, 0) * view.index.hit_count(node, view.now)
        assert evict == pytest.approx(hot) and hot > 0

    def test_a_cache_with_room_evicts_only_the_shortfall(self) -> None:
        policy = policies.global_policies.create("preble")
        view = self.setup_view(capacity=100)
        assert policy.explore_costs(make_req(1, [1, 2]), view, {})[0][1] == 0.0
        assert policy.explore_costs(make_req(2, list(range(70))), view, {})[0][1] > 0

    def test_unknown_capacity_costs_nothing(self) -> None:
        policy = policies.global_policies.create("preble")
        view = self.setup_view(capacity=0)
        assert policy.explore_costs(make_req(1, [1, 2]), view, {})[0][1] == 0.0


# ------------------------------------------------------------------ global: rebalancing


def build_groups(policy, view: ClusterView, outputs: dict[int, int], holder: int = 0) -> None:
    """Two requests for each group g (outputs[g] tokens each), all exploiting `holder`."""
    rid = 0
    for g, out in outputs.items():
        view.index.insert(prefix(g), holder, now=view.now)
        for _ in range(2):
            rid += 1
            assert (
                dispatch(policy, view, make_req(100 * g + rid, [*prefix(g), -rid], out=out))
                == holder
            )


class TestRebalancing:
    def test_starts_after_warmup_and_the_group_takes_its_load_along(self) -> None:
        policy = policies.global_policies.create("preble", warmup=2)  # from the 4th request
        view = make_view(0, 0)
        view.index.insert(prefix(1), 0, now=0.0)
        view.index.insert(prefix(2), 0, now=0.0)
        small, big = prefix(1)[-1], prefix(2)[-1]
        for rid, (g, out) in enumerate([(1, 10), (1, 10), (2, 200)], start=1):
            dispatch(policy, view, make_req(rid, [*prefix(g), -rid], out=out))
        assert policy.alloc == {small: {0}, big: {0}}, "no rebalancing during the warm-up"
        dispatch(policy, view, make_req(4, [*prefix(2), -4], out=200))
        assert policy.alloc == {small: {1}, big: {0}}, "the cheaper group moved"
        work = {
            g: policy.window.prefill[g] + decode
            for (_, g), decode in policy.window.decode_of.items()
        }
        assert policy.load(1) == pytest.approx(work[small])
        assert policy.load(0) == pytest.approx(work[big])
        assert set(policy.window.decode_of) == {(1, small), (0, big)}, "decode moved along"
        decision = policy.route(make_req(5, [*prefix(1), -5]), view)
        assert (decision.worker, decision.reason) == (1, "exploit: rebalanced")

    def test_a_move_replaces_the_heavy_worker_in_a_shared_allocation(self) -> None:
        """A group on workers 0 and 2 moves off 0: to 1 and 2, not to 1 alone (which would
        pile the whole group on the light worker); every request of the group follows."""
        policy = policies.global_policies.create("preble", warmup=100)
        view = make_view(0, 0, 0)
        for w in (0, 2):
            view.index.insert(prefix(1), w, now=0.0)
        group = prefix(1)[-1]
        for i, w in enumerate((0, 2, 0, 0)):
            r = make_req(i, [*prefix(1), -i - 1], out=200)
            policy.route(r, view)
            policy.on_dispatch(r, w, view)
        build_groups(policy, view, {2: 2000})  # a heavier group, only on worker 0
        loads = [policy.load(w) for w in range(3)]
        policy.warmup = 0
        policy.on_dispatch(make_req(9, [9], out=1), 2, view)  # any dispatch rebalances
        assert policy.moved[group] == policy.alloc[group] == {1, 2}
        assert policy.load(0) < loads[0] and policy.load(1) > 0
        deeper = make_req(10, [*prefix(1), -1, 10])  # continues what only worker 0 holds
        assert policy.route(deeper, view).worker in {1, 2}

    def test_a_moved_group_does_not_relocate_the_hotspot(self) -> None:
        """Twelve prefix groups all start on worker 0. Rebalancing must split them between the
        two workers, not move every group one after the other (the hotspot relocating)."""
        policy = policies.global_policies.create("preble", warmup=0)
        view = make_view(0, 0)
        for g in range(12):
            view.index.insert(prefix(g), 0, now=0.0)
        rid = 0
        for _ in range(4):
            last_round = {}
            for g in range(12):
                rid += 1
                last_round[g] = dispatch(policy, view, make_req(rid, [*prefix(g), -rid]))
        on_light = sum(1 for w in last_round.values() if w == 1)
        assert 3 <= on_light <= 9, f"{on_light} of 12 groups served by worker 1"
        high, low = sorted((policy.load(0), policy.load(1)), reverse=True)
        assert high <= 1.5 * low + 1e-9, f"loads {high:.3f} vs {low:.3f} stay imbalanced"

    def test_moves_no_more_than_evens_the_pair(self) -> None:
        """Three equal groups on worker 0: one moves (2:1); a second would overshoot (1:2)."""
        policy = policies.global_policies.create("preble", warmup=3)  # from the 6th request
        view = make_view(0, 0)
        build_groups(policy, view, {1: 10, 2: 10, 3: 10})
        assert sum(a == {1} for a in policy.alloc.values()) == 1
        total = sum(policy.window.prefill.values()) + sum(policy.window.decode.values())
        assert policy.load(0) + policy.load(1) == pytest.approx(total)

    def test_stops_once_the_pair_is_within_the_ratio(self) -> None:
        """Ten equal groups on worker 0, ratio 2: after four moves (6:4) the pair is balanced;
        a fifth would not overshoot (5:5) but is not needed."""
        policy = policies.global_policies.create("preble", rebalance_ratio=2.0, warmup=10)
        view = make_view(0, 0)
        build_groups(policy, view, dict.fromkeys(range(1, 11), 10))
        assert sum(a == {1} for a in policy.alloc.values()) == 4

    def test_balanced_workers_move_nothing(self) -> None:
        policy = policies.global_policies.create("preble", warmup=4)
        view = make_view(0, 0)
        build_groups(policy, view, {1: 10, 2: 10}, holder=0)
        build_groups(policy, view, {3: 10, 4: 12}, holder=1)
        assert policy.alloc == {prefix(g)[-1]: {g > 2} for g in (1, 2, 3, 4)}

    def test_a_group_of_one_request_does_not_move(self) -> None:
        policy = policies.global_policies.create("preble", warmup=0)
        view = make_view(0, 0)
        build_groups(policy, view, {1: 10})  # 2 requests: movable, but alone it overshoots
        view.index.insert(prefix(2), 0, now=0.0)
        dispatch(policy, view, make_req(99, [*prefix(2), -99], out=5))  # 1 request: not movable
        assert all(a == {0} for a in policy.alloc.values())


# ------------------------------------------------------------------ global: replication


class TestTTFTOverloadDetector:
    def test_later_half_at_twice_the_earlier_half(self) -> None:
        detector = policies.preble.TTFTOverloadDetector(window=10.0, factor=2.0)
        detector.add("g", 0, 1.0, 0.1)
        detector.add("g", 0, 2.0, 0.1)
        assert not detector.is_overloaded("g", 0, now=4.0), "no later half yet"
        detector.add("g", 0, 7.0, 0.15)
        assert not detector.is_overloaded("g", 0, now=8.0), "1.5x is not overloaded"
        detector.add("g", 0, 8.0, 0.35)
        assert detector.is_overloaded("g", 0, now=8.0), "mean 0.25 >= 2 x 0.1"
        assert not detector.is_overloaded("g", 1, now=8.0), "per worker"
        assert not detector.is_overloaded("g", 0, now=14.0), "the early samples left the window"


class TestReplication:
    def drive(self, ttfts: list[float]) -> tuple[object, ClusterView]:
        """One group on worker 0, its requests 3 s apart with these TTFTs; worker 1 idle."""
        policy = policies.global_policies.create("preble", ttft_window=10.0, warmup=1)
        view = make_view(0, 0)
        view.index.insert(prefix(1), 0, now=0.0)
        for i, ttft in enumerate(ttfts):
            req = make_req(i, [*prefix(1), -i - 1])
            assert dispatch(policy, view, req, now=3.0 * i) == 0
            policy.on_first_token(req, 0, 3.0 * i + ttft)
        return policy, view

    def test_an_overloaded_group_is_replicated_on_the_lightest_worker(self) -> None:
        """Alone on the heavy worker, the group cannot move without overshooting; its TTFT
        doubled there, so it gets a second worker and its load splits over both."""
        policy, view = self.drive([0.1, 0.1, 0.5])
        group = prefix(1)[-1]
        assert policy.alloc[group] == {0}
        dispatch(policy, view, make_req(9, [*prefix(1), -9]), now=9.0)
        assert policy.alloc[group] == {0, 1} and policy.replicas[group] == {1}
        assert policy.load(1) == pytest.approx(policy.window.prefill[group] / 2)
        fresh = policy.route(make_req(20, [*prefix(1), 20]), view)
        assert (fresh.worker, fresh.reason) == (1, "exploit: rebalanced")
        deeper = make_req(21, [*prefix(1), -9, 21])  # continues a prompt only worker 0 holds
        assert policy.route(deeper, view).worker == 0

    def test_a_steady_ttft_is_not_replicated(self) -> None:
        policy, view = self.drive([0.1, 0.1, 0.12])
        dispatch(policy, view, make_req(9, [*prefix(1), -9]), now=9.0)
        assert policy.alloc[prefix(1)[-1]] == {0}


# ------------------------------------------------------------------ global: failure paths


class TestWithdrawAndStrangers:
    def test_withdraw_takes_back_the_windowed_work(self) -> None:
        policy = policies.global_policies.create("preble")
        view = make_view(0, 0)
        keep, drop = make_req(1, [1, 2], out=50), make_req(2, [7, 8], out=50)
        dispatch(policy, view, keep)
        loads = (policy.load(0), policy.load(1))
        w = dispatch(policy, view, drop)
        assert (policy.load(0), policy.load(1)) != loads
        policy.on_withdraw(drop, w, view)
        assert (policy.load(0), policy.load(1)) == pytest.approx(loads)
        assert policy.num_routed == 1 and set(policy.window.count) == {2}
        view.now = 500.0  # both entries expire: the withdrawn one is not taken twice
        policy.route(make_req(3, [9]), view)
        assert policy.load(0) == policy.load(1) == 0.0

    def test_hooks_ignore_unknown_requests_and_workers(self) -> None:
        policy = policies.global_policies.create("preble")
        view = make_view(0)
        stranger = make_req(42, [1])
        policy.on_first_token(stranger, 7, 1.0)
        policy.on_token(stranger, 7, 3, 2.0)
        policy.on_finish(stranger, 7, view)
        policy.on_withdraw(stranger, 7, view)
        r = make_req(1, [1])
        policy.on_dispatch(r, 0, view)
        policy.on_finish(r, 0, view)
        policy.on_finish(r, 0, view)  # twice
        assert policy.num_routed == 1 and not policy.tpot, "no tokens: no time per token"

    def test_a_reused_request_id_expires_cleanly(self) -> None:
        policy = policies.global_policies.create("preble", window=10.0)
        view = make_view(0, 0)
        for t in (0.0, 1.0):  # the same id dispatched twice (a retry that was not withdrawn)
            dispatch(policy, view, make_req(1, [1, 2]), now=t)
        view.now = 20.0
        policy.route(make_req(2, [9]), view)
        assert policy.load(0) == policy.load(1) == 0.0 and not policy.window.count

    def test_forgotten_groups_leave_no_ttft_samples(self) -> None:
        policy = policies.global_policies.create("preble", window=10.0)
        view = make_view(0)
        r = make_req(1, [1, 2])
        dispatch(policy, view, r, now=0.0)
        policy.on_first_token(r, 0, 0.5)
        view.now = 20.0
        policy.route(make_req(2, [9]), view)  # the group leaves the window
        policy.on_first_token(make_req(3, [3]), 0, 21.0)
        assert not policy.overload._samples


def test_the_fleet_vector_search_picks_what_explore_costs_ranks_first(monkeypatch) -> None:
    """Explore reads L and P as vectors and walks M's victims only while L + P can still win:
    on a simulated run with full caches (M > 0) and rebalancing, every choice is the argmin of
    the per-worker terms `explore_costs` lists."""
    from policies.preble import PrebleE2
    from simulator.config import SimConfig
    from simulator.driver import simulate
    from simulator.engine import EngineConfig
    from traces.generators import shared_prefix

    vector_search, seen = PrebleE2._cheapest, {"choices": 0, "evicting": 0}

    def checked(self, request, view, matched, workers):
        terms = self.explore_costs(request, view, matched, workers)
        expected = min(terms, key=lambda w: (sum(terms[w]), w))
        assert vector_search(self, request, view, matched, workers) == expected
        seen["choices"] += 1
        seen["evicting"] += any(m > 0 for _, m, _ in terms.values())
        return expected

    monkeypatch.setattr(PrebleE2, "_cheapest", checked)
    trace = shared_prefix(
        num_requests=300,
        num_tenants=20,
        prefixes_per_tenant=6,
        rate=40,
        prefix_tokens=1500,
        question_tokens=1200,
        output_tokens=100,
    )
    config = SimConfig(
        5, "preble", policy_params={"warmup": 5}, engine=EngineConfig(num_kv_blocks=600)
    )
    simulate(trace, COST, config)
    assert seen["choices"] > 50 and seen["evicting"] > 10, seen
