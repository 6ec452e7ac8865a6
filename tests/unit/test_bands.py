"""Traffic classes in the router core: strict bands, a window per band, predicted TTFT,
latency routing and admission control, driven by hand."""

from __future__ import annotations

import pytest

import policies
from router.bands import Banded
from router.classes import QUEUE_TIME, UNMEETABLE, ClassTable, Refused, TrafficClass
from router.config import RouterConfig
from router.core import Router
from router.dispatch import DispatchQueue
from router.prefix_index import PrefixIndex
from router.request import Request
from tests.helpers import BS, COST, no_cache

INTERACTIVE = TrafficClass("interactive", 0, ttft=0.5, tpot=0.1, max_queue_time=2.0)
BATCH = TrafficClass("batch", 10, max_queue_time=30.0)


def req(i: int, priority: int, client: str = "a", prompt: int = 512, blocks: int = 0) -> Request:
    hashes = [1000 * i + k for k in range(blocks)] if blocks else []
    return Request(i, 0.0, prompt, 16, hashes, client=client, priority=priority)


def vtc() -> object:
    return policies.local_policies.build("vtc", {}, 0)


class TestBanded:
    def test_a_higher_band_always_goes_first(self) -> None:
        q = Banded(policies.local_policies.get("fcfs"), [0, 10])
        for i in range(3):
            q.push(req(i, 10))
        q.push(req(3, 0))
        order = []
        while (r := q.peek(no_cache)) is not None:
            q.pop(r, 0)
            order.append(r.id)
        assert order == [3, 0, 1, 2]

    def test_inside_a_band_the_discipline_orders_as_alone(self) -> None:
        """VTC inside the batch band releases in the order VTC alone does, an interactive
        request among them going first."""
        orders = []
        for q, extra in ((vtc(), False), (Banded(vtc, [0, 10]), True)):
            for i, client in enumerate("aaaabbc"):
                q.push(req(i, 10, client, prompt=100 * (i + 1)))
            if extra:
                q.push(req(99, 0, "z"))
            order = []
            while (r := q.peek(no_cache)) is not None:
                q.pop(r, 0)
                q.on_token(r, 20)
                order.append(r.id)
            orders.append(order)
        assert orders[1] == [99, *orders[0]]
        assert orders[0] != sorted(orders[0])  # VTC reordered: the test is not FCFS's

    def test_unknown_priorities_get_bands_of_their_own(self) -> None:
        q = Banded(policies.local_policies.get("fcfs"), [0])
        q.push(req(0, 7))
        q.push(req(1, 3))
        assert q.peek(no_cache).id == 1
        assert sorted(q.bands) == [0, 3, 7]
        q.remove(req(1, 3))
        assert [r.id for r in q] == [0]


class TestWindowPerBand:
    def test_lower_bands_in_flight_never_hold_a_higher_one_back(self) -> None:
        queue = DispatchQueue(0, Banded(policies.local_policies.get("fcfs"), [0, 10]), 2, True)
        for i in range(3):
            queue.push(req(i, 10))
        assert [r.id for r in queue.release(PrefixIndex(), BS)] == [0, 1]
        queue.push(req(3, 0))
        queue.push(req(4, 0))
        queue.push(req(5, 0))
        assert [r.id for r in queue.release(PrefixIndex(), BS)] == [3, 4]  # its own window
        queue.done(req(0, 10))  # a batch slot frees, but the interactive band's window is full
        assert list(queue.release(PrefixIndex(), BS)) == []
        queue.done(req(3, 0))
        assert [r.id for r in queue.release(PrefixIndex(), BS)] == [5]


def router(**kw: object) -> Router:
    r = Router(
        policies.global_policies.build("lpm", {}, 0),
        policies.local_policies.get("fcfs"),
        RouterConfig(
            block_size=BS, window=1, cost=COST, classes=ClassTable([INTERACTIVE, BATCH]), **kw
        ),
    )
    r.add_worker(0)
    r.add_worker(1)
    return r


class TestPredictedTTFT:
    def test_grows_with_the_prompts_ahead_in_its_band_and_above_only(self) -> None:
        r = router()
        alone = r.latency.predict(req(100, 0), 0)
        long_prefill = COST.prefill_time(4000, 0)
        r.route(req(0, 10, prompt=4000), 0.0, exclude=[1])  # batch work comes after it
        batch_ahead = r.latency.predict(req(100, 0), 0)
        assert alone < batch_ahead < alone + long_prefill / 2  # only its decode slows it
        r.route(req(1, 0, prompt=4000), 0.0, exclude=[1])
        assert r.latency.predict(req(100, 0), 0) > batch_ahead + long_prefill * 0.9

    def test_a_cached_prefix_is_predicted_faster(self) -> None:
        r = router()
        first = req(0, 0, prompt=4096 + 8, blocks=256)
        r.route(first, 0.0)
        wid = r.routed.most_common(1)[0][0]
        r.first_token(first, 0.1)
        again = Request(1, 0.2, 4096 + 8, 16, list(first.block_hashes), client="b")
        assert r.latency.predict(again, wid) < r.latency.predict(again, 1 - wid) / 4

    def test_routed_requests_carry_their_prediction(self) -> None:
        routed = router().route(req(0, 0), 0.0)
        assert routed.predicted_ttft is not None and routed.predicted_ttft > 0


class TestLatencyRouting:
    def test_goes_where_the_target_is_met_rather_than_to_the_prefix(self) -> None:
        """lpm alone follows the cached prefix to a worker buried in interactive work; with
        latency routing the request goes where it can start within its target."""
        shared = list(range(1, 257))
        for kw, expect_prefix in (({}, True), ({"latency_routing": True}, False)):
            r = router(**kw)
            warm = Request(0, 0.0, 4104, 16, shared, client="w")
            r.route(warm, 0.0)
            held = r.routed.most_common(1)[0][0]
            r.first_token(warm, 0.1)
            for i in range(1, 6):  # a backlog of long interactive prompts on the holder
                r.route(req(i, 0, prompt=8000), 0.1, exclude=[1 - held])
            routed = r.route(Request(9, 0.2, 4104, 16, shared, client="x"), 0.2)
            assert (routed.decision.worker == held) is expect_prefix

    def test_admission_refuses_what_no_worker_can_meet(self) -> None:
        r = router(admission=True)
        admitted = 0
        with pytest.raises(Refused) as refused:
            for i in range(50):  # long prompts pile up until no worker can meet 0.5 s
                r.route(req(i, 0, prompt=2000), 0.0)
                admitted += 1
        assert admitted >= 2  # one each at first
        assert refused.value.reason == UNMEETABLE and refused.value.retry_after >= 1.0
        assert r.refusals[("interactive", UNMEETABLE)] == 1
        assert not r.is_released(req(admitted, 0)) and r.prediction(req(admitted, 0)) is None
        r.route(req(100, 10, prompt=8000), 0.0)  # batch has no TTFT target: never refused


class TestQueueTime:
    def test_a_request_still_queued_is_timed_out_and_one_released_goes_on(self) -> None:
        r = router(admission=True)
        first, second = req(0, 0), req(1, 0)
        r.route(first, 0.0, exclude=[1])
        r.route(second, 0.0, exclude=[1])  # window 1: waits behind the first
        assert r.queue_limit(second) == INTERACTIVE.max_queue_time
        assert not r.time_out(first, 2.0)  # released: it goes on
        assert r.time_out(second, 2.0)
        assert r.refusals[("interactive", QUEUE_TIME)] == 1
        assert r.view.workers[0].tokens_in_flight == first.prompt_len + first.output_len
        assert r.finish(first, 3.0) == []  # nothing else waits there

    def test_no_limit_without_admission_control(self) -> None:
        assert router().queue_limit(req(0, 0)) is None


def test_classes_are_checked() -> None:
    with pytest.raises(ValueError, match="ttft: must be positive"):
        TrafficClass("x", ttft=0)
    with pytest.raises(ValueError, match="priority: 0 is 'a'"):
        ClassTable([TrafficClass("a", 0), TrafficClass("b", 0)])
    with pytest.raises(ValueError, match="unknown field"):
        ClassTable.of({"a": {"priority": 0, "deadline": 3}})
