"""The router core's parts, each driven alone: its config, roster, pools, indexes, latency
targets, load, progress accounting, split handoff, replication and hooks.

The whole sequence is tested through Router (test_router_core.py, with the differential tests);
these pin each part's own contract on hand-built views.
"""

from __future__ import annotations

import random

import pytest

import policies
from router.adapters import AdapterSlots
from router.classes import QUEUE_TIME, UNMEETABLE, ClassTable, Refused, TrafficClass
from router.config import RouterConfig, slowest_adapter_load
from router.dispatch import DispatchQueue
from router.flight import Flight
from router.handoff import DecodeHandoff
from router.hooks import Hooks
from router.indexes import Indexes
from router.latency import LatencyTargets
from router.load import Load
from router.policy import Decision, GlobalPolicy
from router.pools import Pools, UnknownModel
from router.prefix_index import PrefixIndex
from router.progress import Progress
from router.replication import Replication
from router.request import Request
from router.roster import Roster
from router.traits import IndexLevel, IndexMode, Role
from router.view import ClusterView, WorkerState
from tests.helpers import BS, COST, make_req, no_cache


def view_of(*states: WorkerState, cost=None) -> ClusterView:
    return ClusterView(0.0, {s.id: s for s in states}, PrefixIndex(), BS, cost, tracked=True)


def pools_of(*states: WorkerState) -> tuple[Pools, ClusterView]:
    """Workers join one by one, as Router.add_worker adds them."""
    view = view_of()
    pools = Pools(view)
    for state in states:
        view.workers[state.id] = state
        pools.add(state)
    return pools, view


class TestRouterConfig:
    @pytest.mark.parametrize(
        "field, value",
        [
            ("block_size", 0),
            ("window", 0),
            ("kv_capacity_blocks", 0),
            ("adapter_load_time", -1.0),
            ("step_tokens", 0),
            ("decode_slack", -1),
            ("index", "exact"),
        ],
    )
    def test_a_bad_value_is_an_error_naming_its_field(self, field: str, value: object) -> None:
        with pytest.raises(ValueError, match=f"^{field}: "):
            RouterConfig(**{field: value})  # type: ignore[arg-type]

    def test_latency_routing_or_admission_without_a_cost_model_names_cost(self) -> None:
        for switch in ("latency_routing", "admission"):
            with pytest.raises(ValueError, match="^cost: "):
                RouterConfig(**{switch: True})  # type: ignore[arg-type]

    def test_the_index_is_parsed_from_its_name_and_described_by_it(self) -> None:
        config = RouterConfig(index="precise", cost=COST, classes=ClassTable())  # type: ignore
        assert config.index is IndexMode.PRECISE and config.is_precise and config.is_banded
        described = config.describe()
        assert described["index"] == "precise"
        assert described["cost"] == COST.name and described["classes"] == []
        assert set(described) == set(RouterConfig.__dataclass_fields__)

    def test_it_is_frozen(self) -> None:
        with pytest.raises(AttributeError):
            RouterConfig().window = 2  # type: ignore[misc]

    def test_a_fleet_weighs_its_slowest_adapter_load(self) -> None:
        assert slowest_adapter_load([0.2, 1.5, 0.5]) == 1.5
        assert slowest_adapter_load([]) == 0.0


class TestPools:
    def test_a_fleet_of_one_mixed_model_routes_over_the_whole_view(self) -> None:
        pools, view = pools_of(WorkerState(0), WorkerState(1))
        assert pools.routing_pool(make_req(1, [1])) is view and not pools.is_split

    def test_a_split_fleet_routes_among_the_workers_that_prefill(self) -> None:
        # The mixed worker joins before the fleet splits.
        pools, view = pools_of(
            WorkerState(0), WorkerState(1, role="prefill"), WorkerState(2, role="decode")
        )
        req = make_req(1, [1])
        assert pools.is_split and set(pools.routing_pool(req).workers) == {0, 1}
        assert pools.has_decode(req)
        decode = pools.decode_pool(req, ())
        assert decode is not None and set(decode.workers) == {2}
        assert pools.decode_pool(req, [2]) is None, "its one decode worker excluded"
        view.workers[2].healthy = False
        view.changed(2)  # as the router tells a tracked view
        view.roster_changed()
        assert not pools.has_decode(req) and pools.decode_pool(req, ()) is None

    def test_model_groups_are_apart_and_an_unknown_one_is_an_error(self) -> None:
        pools, _ = pools_of(WorkerState(0, model="a"), WorkerState(1, model="b"))
        a = Request(1, 0.0, 20, 2, [1], model="a")
        assert set(pools.routing_pool(a).workers) == {0}
        assert pools.models() == ["a", "b"]
        with pytest.raises(UnknownModel):
            pools.routing_pool(Request(2, 0.0, 20, 2, [1], model="c"))


class TestIndexes:
    def test_approximate_believes_what_was_routed_and_holds_what_was_sent(self) -> None:
        view = view_of(WorkerState(0, kv_capacity_blocks=100))
        indexes = Indexes(view, precise=False, keep_approximate=False, tracks_held=True)
        assert indexes.approximate is view.index and indexes.level is IndexLevel.APPROXIMATE
        req = make_req(1, [1, 2, 3])
        assert indexes.routed(req, 0, 0.0) == (0, 0)
        assert indexes.routed(make_req(2, [1, 2, 9]), 0, 1.0) == (0, 2)
        assert indexes.held.num_blocks(0) == 0, "routed is not computed"
        indexes.computed(req, 0, 1.0)
        assert indexes.held.match_of(req.block_hashes, 0) == 3

    def test_engine_placement_keeps_no_held_index(self) -> None:
        view = view_of(WorkerState(0))
        indexes = Indexes(view, precise=False, keep_approximate=False, tracks_held=False)
        indexes.computed(make_req(1, [1, 2]), 0, 0.0)
        assert indexes.held.num_blocks(0) == 0

    def test_the_approximate_index_keeps_within_a_workers_capacity(self) -> None:
        view = view_of(WorkerState(0, kv_capacity_blocks=4))
        indexes = Indexes(view, precise=False, keep_approximate=False, tracks_held=False)
        indexes.routed(make_req(1, list(range(10))), 0, 0.0)
        assert view.index.num_blocks(0) <= 4

    def test_levels_fall_back_and_are_logged_and_unknown_ones_refused(self) -> None:
        view = view_of(WorkerState(0))
        indexes = Indexes(view, precise=True, keep_approximate=True, tracks_held=False)
        assert indexes.levels() == (IndexLevel.PRECISE, IndexLevel.APPROXIMATE, IndexLevel.LOAD)
        precise = view.index
        indexes.set_level("load", 3.0)
        assert view.index is not precise and view.index.num_blocks(0) == 0
        assert indexes.level_changes == [(3.0, IndexLevel.PRECISE, IndexLevel.LOAD)]
        plain = Indexes(view_of(WorkerState(0)), False, False, False)
        with pytest.raises(ValueError, match="precise"):
            plain.set_level("precise", 0.0)

    def test_a_replica_logs_its_routing_and_another_learns_it(self) -> None:
        a = Indexes(view_of(WorkerState(0, kv_capacity_blocks=10)), False, False, False)
        b = Indexes(view_of(WorkerState(0, kv_capacity_blocks=10)), False, False, False)
        a.routing_log = []
        a.routed(make_req(1, [5, 6]), 0, 2.0)
        assert a.routing_log == [([5, 6], 0, 2.0)]
        b.learn_routed(a.routing_log)
        assert b.view.index.match_of([5, 6], 0) == 2

    def test_a_worker_removed_is_forgotten_by_every_index(self) -> None:
        view = view_of(WorkerState(0))
        indexes = Indexes(view, precise=False, keep_approximate=False, tracks_held=True)
        req = make_req(1, [1, 2])
        indexes.routed(req, 0, 0.0)
        indexes.computed(req, 0, 0.0)
        indexes.remove_worker(0)
        assert view.index.num_blocks(0) == 0 and indexes.held.num_blocks(0) == 0


INTERACTIVE = TrafficClass("interactive", 0, ttft=0.5, max_queue_time=2.0)
BATCH = TrafficClass("batch", 10)


def latency(**kw: object) -> tuple[LatencyTargets, ClusterView]:
    view = view_of(WorkerState(0), WorkerState(1), cost=COST)
    config = RouterConfig(block_size=BS, cost=COST, classes=ClassTable([INTERACTIVE, BATCH]), **kw)
    targets = LatencyTargets(view, config)  # type: ignore[arg-type]
    targets.add_worker(0)
    targets.add_worker(1)
    return targets, view


def flight_on(worker: int, req: Request) -> Flight:
    queue = DispatchQueue(worker, policies.local_policies.create("fcfs"), None)
    return Flight(req, worker, queue, req.prompt_len + req.output_len, {}, 0, worker)


class TestLatencyTargets:
    def test_a_prompt_queued_on_a_worker_delays_later_requests_of_its_band_and_below(self) -> None:
        targets, view = latency()
        probe, probe_batch = make_req(1, [1]), Request(2, 0.0, 24, 4, [2], priority=10)
        alone, alone_batch = targets.predict(probe, 0), targets.predict(probe_batch, 0)
        long = Request(3, 0.0, 8000, 4, list(range(100, 600)), priority=10)
        flight = flight_on(0, long)
        targets.queued(flight, view.workers[0], 0)
        assert flight.predicted_ttft is not None and flight.prefill == 8000
        assert targets.predict(probe, 0) == alone, "a lower band's prompt is not ahead"
        assert targets.predict(probe_batch, 0) > alone_batch
        targets.prefilled(flight)
        assert targets.predict(probe_batch, 0) == pytest.approx(alone_batch)
        assert flight.prefill == 0

    def test_admission_refuses_what_no_worker_serves_in_time_and_counts_it(self) -> None:
        targets, view = latency(admission=True)
        for w in (0, 1):  # a long prompt ahead everywhere
            big = Request(10 + w, 0.0, 60_000, 4, list(range(1000 * w, 1000 * w + 3000)))
            targets.queued(flight_on(w, big), view.workers[w], 0)
        req = make_req(1, [1])
        with pytest.raises(Refused) as refused:
            targets.route(req, view, Decision(0, "policy"), lambda r, v: Decision(0, "again"))
        assert refused.value.reason == UNMEETABLE
        assert targets.refusals[("interactive", UNMEETABLE)] == 1

    def test_latency_routing_chooses_again_among_the_workers_that_meet_the_target(self) -> None:
        targets, view = latency(latency_routing=True)
        big = Request(10, 0.0, 60_000, 4, list(range(3000)))
        targets.queued(flight_on(0, big), view.workers[0], 0)
        among: list[set[int]] = []

        def route_again(r: Request, v: ClusterView) -> Decision:
            among.append(set(v.workers))
            return Decision(1, "again")

        decision, ttft = targets.route(make_req(1, [1]), view, Decision(0, "policy"), route_again)
        assert decision.worker == 1 and among == [{1}]
        assert ttft == targets.predict(make_req(1, [1]), 1)

    def test_a_class_without_a_target_keeps_the_policys_choice(self) -> None:
        targets, view = latency(latency_routing=True)
        batch = Request(1, 0.0, 24, 4, [1], priority=10)
        decision, ttft = targets.route(batch, view, Decision(0, "p"), lambda r, v: Decision(1, ""))
        assert decision.worker == 0 and ttft is None

    def test_queue_limits_only_with_admission_control(self) -> None:
        req = make_req(1, [1])
        assert latency()[0].queue_limit(req) is None
        on = latency(admission=True)[0]
        assert on.queue_limit(req) == 2.0
        on.refused(req, QUEUE_TIME)
        assert on.refusals[("interactive", QUEUE_TIME)] == 1


class TestLoad:
    def test_work_added_and_credited_moves_tokens_in_flight(self) -> None:
        view = view_of(WorkerState(0))
        load = Load(view)
        load.add(0, 100)
        load.credit(0, 30, kv_used_blocks=7)
        load.credit(None, 5)  # work done nowhere: nothing moves
        assert view.workers[0].tokens_in_flight == 70 and view.workers[0].kv_used_blocks == 7

    def test_requests_a_server_says_wait_count_as_waiting_not_running(self) -> None:
        view = view_of(WorkerState(0))
        load = Load(view)
        queue = DispatchQueue(0, policies.local_policies.create("fcfs"), 4)
        for i in range(6):
            queue.push(make_req(i, [i]))
        list(queue.release(PrefixIndex(), BS))
        load.count(0, queue)
        state = view.workers[0]
        assert (state.num_waiting, state.num_running) == (2, 4)
        load.report(0, waiting=3, kv_used_blocks=None, kv_capacity_blocks=None, queue=queue)
        assert (state.num_waiting, state.num_running) == (5, 1)
        load.report(0, waiting=3, kv_used_blocks=None, kv_capacity_blocks=50, queue=queue)
        assert state.kv_capacity_blocks == 50 and (state.num_waiting, state.num_running) == (5, 1)
        load.report(0, waiting=1, kv_used_blocks=None, kv_capacity_blocks=None, queue=queue)
        assert (state.num_waiting, state.num_running) == (3, 3)
        load.count(0, queue)  # a recount keeps what the server last said
        assert (state.num_waiting, state.num_running) == (3, 3)

    def test_an_unknown_worker_is_ignored(self) -> None:
        load = Load(view_of())
        load.report(9, waiting=1, kv_used_blocks=1, kv_capacity_blocks=1, queue=None)
        load.count(9, None)


class Parts:
    """The parts a Router composes, built as it builds them, over one view."""

    def __init__(self, policy: str = "least_load", local: str = "fcfs", **config: object) -> None:
        self.config = RouterConfig(block_size=BS, **config)  # type: ignore[arg-type]
        self.policy = policies.global_policies.build(policy, {}, 0)
        self.view = view_of()
        self.pools = Pools(self.view)
        self.indexes = Indexes(self.view, False, False, tracks_held=True)
        self.latency = LatencyTargets(self.view, self.config)
        self.load = Load(self.view)
        self.adapters = AdapterSlots()
        self.hooks = Hooks(strict=True)
        self.roster = Roster(
            self.config, lambda: policies.local_policies.build(local, {}, 0), self.view,
            self.pools, self.indexes, self.latency, self.load, self.adapters,
        )  # fmt: skip
        self.flights: dict[int, Flight] = {}
        self.progress = Progress(self.flights, self.policy, self.load, self.latency, self.hooks)

    def add(self, wid: int, role: str = "mixed") -> DispatchQueue:
        queue = self.roster.add(wid, role=role)
        self.progress.queue_added(queue)
        return queue

    def fly(self, request: Request, wid: int, work: int, released: bool = True) -> Flight:
        """`request` routed to `wid` with `work` tokens to do, as the core records it."""
        queue = self.roster.queues[wid]
        flight = Flight(request, wid, queue, work, {}, 0, wid)
        flight.released = released
        self.flights[request.id] = flight
        self.load.add(wid, work)
        return flight


class TestDispatchQueue:
    @pytest.mark.parametrize("name", ["fcfs", "lpm", "vtc", "dlpm"])
    def test_it_counts_what_its_discipline_holds(self, name: str) -> None:
        # Its length is counted as requests come and go, not asked of the discipline: random
        # pushes, releases and withdrawals, and the two agree after each.
        rng = random.Random(name)
        for window in (None, 1, 3):
            queue = DispatchQueue(0, policies.local_policies.build(name, {}, 0), window)
            waiting: list[Request] = []
            for i in range(300):
                move = rng.random()
                if move < 0.5:
                    request = make_req(i, [rng.randrange(4), i], client=rng.choice("ab"))
                    queue.push(request)
                    waiting.append(request)
                elif move < 0.7 and waiting:
                    queue.withdraw(waiting.pop(rng.randrange(len(waiting))))
                else:
                    for request in queue.release(PrefixIndex(), BS):
                        waiting.remove(request)
                        queue.done(request)
                assert len(queue) == len(queue.discipline) == len(waiting)


class TestRoster:
    def test_a_worker_joins_the_view_its_pool_and_gets_a_queue_of_its_own(self) -> None:
        parts = Parts(kv_capacity_blocks=77)
        queue = parts.add(0)
        parts.add(1, role="prefill")
        parts.add(2, role="decode")
        assert queue is parts.roster.queues[0] and queue.discipline.name == "fcfs"
        assert parts.roster.queues[1].discipline is not queue.discipline
        assert parts.view.workers[0].kv_capacity_blocks == 77
        assert parts.pools.is_split
        assert set(parts.pools.routing_pool(make_req(0, [1])).workers) == {0, 1}
        with pytest.raises(ValueError, match="worker 0 is already known"):
            parts.add(0)

    def test_with_classes_each_queue_holds_one_band_per_priority(self) -> None:
        table = ClassTable((TrafficClass("interactive", 1), TrafficClass("batch", 0)))
        parts = Parts(classes=table)
        assert sorted(parts.add(0).discipline.bands) == [0, 1]

    def test_down_forgets_what_it_held_and_hands_back_its_queue_for_the_core(self) -> None:
        parts = Parts(adapter_load_time=0.1)
        parts.add(0)
        parts.add(1)
        queued = [make_req(i, [i]) for i in range(3)]
        for request in queued:
            parts.roster.queues[0].push(request)
        parts.indexes.routed(queued[0], 0, 0.0)
        parts.adapters.use(0, "ada")
        assert parts.roster.down(0) == queued
        assert not parts.view.workers[0].healthy
        assert parts.view.index.match(queued[0].block_hashes) == {}
        assert not parts.adapters.holds(0, "ada")
        assert len(parts.roster.queues[0]) == 3  # withdrawing them is the core's
        assert parts.roster.down(0) == [] and parts.roster.down(9) == []
        parts.roster.up(0)
        parts.roster.up(9)  # unknown: nothing happens
        assert parts.view.workers[0].healthy

    def test_a_worker_removed_is_forgotten_by_every_part(self) -> None:
        parts = Parts()
        parts.add(0)
        parts.add(1)
        parts.roster.report(0, waiting=2, kv_used_blocks=5, kv_capacity_blocks=None)
        parts.roster.remove(0)
        assert 0 not in parts.roster.queues and 0 not in parts.view.workers
        assert set(parts.pools.routing_pool(make_req(0, [1])).workers) == {1}
        parts.add(0)  # the id may join again, as new
        assert parts.view.workers[0].kv_used_blocks == 0

    def test_a_report_recounts_requests_waiting_inside_the_server(self) -> None:
        parts = Parts(window=4)
        queue = parts.add(0)
        for i in range(3):
            queue.push(make_req(i, [i]))
        list(queue.release(parts.indexes.held, BS))
        parts.roster.count(0)
        state = parts.view.workers[0]
        assert (state.num_waiting, state.num_running) == (0, 3)
        parts.roster.report(0, waiting=2, kv_used_blocks=9, kv_capacity_blocks=None)
        assert (state.num_waiting, state.num_running, state.kv_used_blocks) == (2, 1, 9)


class CountingTokens(GlobalPolicy):
    """Least loaded, recording each on_tokens call as (worker, request ids, tokens)."""

    name = "counting"

    def __init__(self) -> None:
        self.calls: list[tuple[int, list[int], int]] = []

    def route(self, request: Request, view) -> Decision:
        return Decision(min(view.workers), "first")

    def on_tokens(self, requests, worker, num_tokens, now) -> None:
        self.calls.append((worker, [r.id for r in requests], num_tokens))


class TestProgress:
    def test_a_batch_credits_each_worker_its_tokens_never_past_a_requests_work(self) -> None:
        parts = Parts()
        parts.add(0)
        parts.add(1)
        a, b, c = make_req(1, [1]), make_req(2, [2]), make_req(3, [3])
        parts.fly(a, 0, 10)
        parts.fly(b, 0, 3)
        parts.fly(c, 1, 10)
        unknown = make_req(9, [9])  # finished already: skipped
        parts.progress.tokens_many([a, b, unknown, c], 4, 1.0, credited=False)
        assert [parts.flights[r.id].remaining for r in (a, b, c)] == [6, 0, 6]
        assert parts.view.workers[0].tokens_in_flight == 13 - 7
        assert parts.view.workers[1].tokens_in_flight == 10 - 4
        parts.progress.tokens_many([a], -2, 1.1, credited=False)  # a correction moves nothing
        assert parts.flights[a.id].remaining == 6

    def test_tokens_credited_ahead_are_settled_on_requests_not_counted_again(self) -> None:
        parts = Parts()
        parts.add(0)
        a = make_req(1, [1])
        parts.fly(a, 0, 10)
        parts.progress.work_done_on(0, 4, kv_used_blocks=3)
        assert (parts.view.workers[0].tokens_in_flight, parts.view.workers[0].kv_used_blocks) == (
            6,
            3,
        )
        parts.progress.tokens_many([a], 4, 1.0, credited=True)
        assert parts.flights[a.id].remaining == 6 and parts.view.workers[0].tokens_in_flight == 6

    def test_the_policy_hears_a_batch_in_one_call_per_worker_charged(self) -> None:
        parts = Parts()
        parts.policy = policy = CountingTokens()
        parts.progress = Progress(parts.flights, policy, parts.load, parts.latency, parts.hooks)
        for wid in (0, 1):
            parts.add(wid)
        batch = [make_req(i, [i]) for i in range(4)]
        for request, wid in zip(batch, (0, 0, 1, 0), strict=True):
            parts.fly(request, wid, 10)
        parts.progress.tokens_many(batch, 2, 1.0, credited=False)
        assert policy.calls == [(0, [0, 1], 2), (1, [2], 2), (0, [3], 2)]

    def test_a_queue_hears_tokens_only_once_released_and_a_prefill_queue_after(self) -> None:
        parts = Parts(local="vtc")
        for wid in (0, 1):
            parts.add(wid)
        waiting, running = make_req(1, [1], client="x"), make_req(2, [2], client="y")
        for request, wid in ((waiting, 0), (running, 1)):
            parts.roster.queues[wid].push(request)
        list(parts.roster.queues[1].release(parts.indexes.held, BS))
        parts.fly(waiting, 0, 10, released=False)
        parts.fly(running, 1, 10)
        parts.progress.tokens_many([waiting, running], 3, 1.0, credited=False)
        counters = {w: dict(q.discipline.counters) for w, q in parts.roster.queues.items()}
        handed = parts.flights[running.id]
        handed.prefill_queue, handed.queue, handed.released = (
            handed.queue,
            parts.roster.queues[0],
            False,
        )
        parts.progress.tokens_many([running], 5, 2.0, credited=False)
        after = parts.roster.queues[1].discipline.counters
        assert counters[0].get("x", 0.0) == 0.0  # queued: its account has not opened
        assert after["y"] > counters[1]["y"] > 0.0  # the prefill worker's, charged the output

    def test_a_first_token_ends_the_prompts_work_but_not_on_a_decode_worker(self) -> None:
        parts = Parts()
        parts.add(0)
        mixed, decoded = make_req(1, [1, 2], out=5), make_req(2, [3], out=5)
        parts.fly(mixed, 0, mixed.prompt_len + 5)
        parts.fly(decoded, 0, 5).handed_off = True
        parts.progress.first_token(mixed, 1.0)
        parts.progress.first_token(decoded, 1.0)
        parts.progress.first_token(make_req(9, [9]), 1.0)  # gone already: nothing
        assert [parts.flights[r.id].remaining for r in (mixed, decoded)] == [5, 5]
        parts.progress.done(parts.flights[mixed.id], -3)
        assert parts.view.workers[0].tokens_in_flight == 10


class TestDecodeHandoff:
    def handoff(self) -> tuple[Parts, DecodeHandoff]:
        parts = Parts()
        for wid, role in ((0, "prefill"), (1, "decode"), (2, "decode")):
            parts.add(wid, role=role)
        handoff = DecodeHandoff(
            0, parts.view, parts.pools, parts.roster.queues, parts.indexes, parts.load
        )
        return parts, handoff

    def test_the_request_moves_to_a_decode_worker_as_its_output_and_its_prompts_kv(
        self,
    ) -> None:
        parts, handoff = self.handoff()
        r = make_req(1, [1, 2, 3], out=7)
        flight = parts.fly(r, 0, r.prompt_len)
        parts.progress.done(flight, flight.remaining)
        prefill_queue = flight.queue
        wid = handoff.hand_off(flight, 1.0, exclude=())
        assert wid in (1, 2) and handoff.handoffs[wid] == 1
        assert (flight.worker, flight.queue) == (wid, parts.roster.queues[wid])
        assert flight.prefill_queue is prefill_queue and flight.charged_to == 0
        assert flight.handed_off and not flight.split and not flight.released
        assert flight.remaining == 7 and parts.view.workers[wid].tokens_in_flight == 7
        assert list(flight.queue.discipline) == [r]
        assert parts.view.index.match(r.block_hashes)[wid] == 3

    def test_with_no_healthy_decode_worker_the_flight_is_left_as_it_was(self) -> None:
        parts, handoff = self.handoff()
        r = make_req(1, [1])
        flight = parts.fly(r, 0, 0)
        parts.roster.down(2)
        assert handoff.hand_off(flight, 1.0, exclude=(1,)) is None
        assert (flight.worker, flight.handed_off, sum(handoff.handoffs.values())) == (0, False, 0)


class TestReplication:
    def test_a_router_names_its_policys_counters_and_each_queues_by_worker(self) -> None:
        parts = Parts(policy="d2lpm", local="vtc")
        parts.add(3)
        replication = Replication(parts.policy, parts.roster.queues, parts.indexes)
        ledgers = replication.ledgers()
        assert set(ledgers) == {("global", "deficits"), ("queue", 3, "counters")}
        assert ledgers[("global", "deficits")] is parts.policy.deficits
        assert ledgers[("queue", 3, "counters")] is parts.roster.queues[3].discipline.counters

    def test_a_replica_routes_by_the_others_approximate_index(self) -> None:
        first, second = Parts(), Parts()
        for parts in (first, second):
            parts.add(0)
        first.indexes.routed(make_req(1, [5, 6]), 0, 0.0)
        mine = Replication(second.policy, second.roster.queues, second.indexes)
        mine.share_indexes(Replication(first.policy, first.roster.queues, first.indexes))
        assert second.view.index is first.view.index
        assert second.view.index.match([5, 6]) == {0: 2}


class TestHooks:
    def test_strict_hooks_raise_and_forgiving_ones_are_logged_and_counted(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        def faulty(x: int) -> None:
            raise KeyError(x)

        heard: list[int] = []
        with pytest.raises(KeyError):
            Hooks(strict=True).run(faulty, 1)
        forgiving = Hooks(strict=False)
        forgiving.run(faulty, 2)
        forgiving.run(heard.append, 3)
        assert forgiving.errors == 1 and heard == [3]
        assert "policy hook" in caplog.text and "faulty" in caplog.text


def test_role_strings_and_members_agree() -> None:
    """Pools take a worker's role as the view stores it (a string)."""
    assert Role("decode") is Role.DECODE and no_cache(make_req(0, [1])) == 0


class TestPrintConfig:
    """`fairway simulate` and `fairway serve` print the RouterConfig each would run with, in one
    format, so a diff of the two shows where the backends differ."""

    @staticmethod
    def printed(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, str]:
        from router.cli import main

        assert main(argv) == 0
        lines = capsys.readouterr().out.splitlines()
        return {k: v.strip() for k, _, v in (line.partition(":") for line in lines)}

    def test_both_print_every_field_and_show_where_they_differ(
        self, capsys: pytest.CaptureFixture[str]
    ) -> None:
        from tests.helpers import SAMPLE

        sim = self.printed(
            ["simulate", "--trace", str(SAMPLE), "--policy", "lpm", "--print-config"], capsys
        )
        live = self.printed(
            ["serve", "--backend", "emulated", "--workers", "2", "--print-config"], capsys
        )
        fields = {"policy", "local_policy", *RouterConfig.__dataclass_fields__}
        assert set(sim) == set(live) == fields
        assert sim["policy"] == live["policy"] == "lpm"
        # Engine placement in the simulator by default; the proxy's window in front of vLLM.
        assert (sim["window"], live["window"]) == ("None", "8")
        assert (sim["strict"], live["strict"]) == ("True", "False")
        assert sim["step_tokens"] == "8192" and live["step_tokens"] == "2048"
        # The proxy exports hit estimates for any policy; a simulation makes them when read.
        assert (sim["estimate_hits"], live["estimate_hits"]) == ("False", "True")

    def test_the_proxy_reads_the_step_budget_from_the_workers_vllm_arguments(self) -> None:
        from router.proxy.service.config import validate_config
        from router.proxy.service.serve import step_tokens_of

        def config(*args: str):
            return validate_config({"workers": {"vllm_args": list(args)}})

        assert step_tokens_of(config()) == 2048
        assert step_tokens_of(config("--max-num-batched-tokens", "4096")) == 4096
        assert step_tokens_of(config("--max-num-batched-tokens=1024", "--enforce-eager")) == 1024
