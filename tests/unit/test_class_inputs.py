"""Traffic classes on the live side, without a server: cluster.yaml's classes and scheduling
policy (errors name the field), a request's priority (a tenant's, lowered but never raised by a
trusted gateway; hostile values a 400 naming the header), the body a worker is sent, the
servers' command lines, and the live driver's queue-limit refusals."""

from __future__ import annotations

import asyncio
import sys

import pytest
from aiohttp.test_utils import make_mocked_request

import policies
from router.classes import QUEUE_TIME, ClassTable, TrafficClass
from router.config import RouterConfig
from router.cost_model import roofline
from router.proxy.admission import queue_time_refused, refused, upstream_body
from router.proxy.driver import LiveCluster
from router.proxy.errors import APIError
from router.proxy.identity import authenticate, client_priority
from router.proxy.service.config import ClusterConfig, validate_config
from router.proxy.service.serve import build_cluster
from router.proxy.settings import ProxySettings, Tenant, keyed
from router.request import Request
from workers.emulated.cli import emulated_command
from workers.launch import server_specs

CLASSES = {
    "interactive": {"priority": 0, "ttft": 0.5, "tpot": 0.05, "max_queue_time": 2},
    "batch": {"priority": 10, "max_queue_time": 60},
}


class TestConfig:
    def test_classes_and_switches_build_a_banded_router(self) -> None:
        config = validate_config(
            {"classes": CLASSES, "latency_routing": True, "admission_control": True}
        )
        table = config.class_table
        assert [c.name for c in table] == ["interactive", "batch"]
        assert table.of_priority(0) == TrafficClass("interactive", 0, 0.5, 0.05, 2.0)
        cluster = build_cluster(config)
        router = cluster.router
        assert router.banded and router.config.admission and router.config.latency_routing
        worker = cluster.add_worker("http://127.0.0.1:1")
        assert not worker.priority_scheduling, "fcfs workers by default"
        assert cluster.queue_limit(Request(0, 0.0, 10, 1, priority=10)) == 60.0

    def test_without_priorities_the_router_has_no_bands(self) -> None:
        assert not build_cluster(ClusterConfig()).router.banded

    @pytest.mark.parametrize(
        "raw",
        [
            {"tenants": [{"api_key": "sk-0123456789", "client": "a", "priority": 5}]},
            {"trust_client_headers": True},
            {"workers": {"scheduling_policy": "priority"}},
        ],
    )
    def test_anything_that_can_carry_a_priority_puts_queues_in_bands(self, raw: dict) -> None:
        assert build_cluster(validate_config(raw)).router.banded

    def test_priority_workers_are_sent_priorities(self) -> None:
        cluster = build_cluster(validate_config({"workers": {"scheduling_policy": "priority"}}))
        assert cluster.add_worker("http://127.0.0.1:1").priority_scheduling
        assert not cluster.add_worker(
            "http://127.0.0.1:2", priority_scheduling=False
        ).priority_scheduling  # noqa: E501

    @pytest.mark.parametrize(
        "raw, field",
        [
            ({"classes": {"a": {"priority": 0}, "b": {"priority": 0}}}, "classes.b.priority"),
            ({"classes": {"a": {"priority": 0, "ttft": 0}}}, "classes.a.ttft"),
            ({"classes": {"a": {"priority": 0, "tpot": -1}}}, "classes.a.tpot"),
            (
                {"classes": {"a": {"priority": 0, "max_queue_time": "soon"}}},
                "classes.a.max_queue_time",
            ),  # noqa: E501
            ({"classes": {"a": {"priority": 0, "slo": 1}}}, "classes.a.slo"),
            ({"classes": {"a": {"ttft": 1}}}, "classes.a.priority"),
            ({"classes": {"a": {"priority": "1"}}}, "classes.a.priority"),
            ({"classes": {"a": {"priority": 101}}}, "classes.a.priority"),
            ({"classes": {"a b": {"priority": 1}}}, "classes.a b"),
            ({"classes": {"a": {"priority": 0, "ttft": float("inf")}}}, "classes.a.ttft"),
            ({"workers": {"scheduling_policy": "lifo"}}, "workers.scheduling_policy"),
            (
                {"tenants": [{"api_key": "sk-0123456789", "client": "a", "priority": True}]},
                "tenants.0.priority",
            ),
            (
                {"tenants": [{"api_key": "sk-0123456789", "client": "a", "priority": -101}]},
                "tenants.0.priority",
            ),
            ({"admission_control": "maybe"}, "admission_control"),
        ],
    )
    def test_errors_name_the_field(self, raw: dict, field: str) -> None:
        with pytest.raises(ValueError, match=rf"{field}"):
            validate_config(raw)


KEY_A, KEY_B = "sk-team-a-0123456789", "sk-team-b-0123456789"
TENANTS = keyed({KEY_A: Tenant("team-a"), KEY_B: Tenant("team-b", priority=10)})


def priority_of(
    headers: dict[str, str], body: dict | None = None, trusted: bool = True, tenants=TENANTS
) -> int:
    s = ProxySettings(model_name="tiny", tenants=tenants, trust_client_headers=trusted)
    http = make_mocked_request("POST", "/v1/completions", headers=headers)
    return client_priority(http, body or {}, authenticate(http, s), s)


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


class TestPriorityOfARequest:
    @pytest.mark.parametrize(
        "headers, body, trusted, expected",
        [
            ({}, {}, True, 10),  # the tenant's
            ({"X-Priority": "20"}, {}, True, 20),  # a gateway lowers it
            ({"X-Priority": "0"}, {}, True, 10),  # ... never raises it
            ({"X-Priority": "-100"}, {}, True, 10),
            ({}, {"priority": 0}, True, 10),  # nor does the body
            ({}, {"priority": 30}, True, 30),
            ({"X-Priority": "20"}, {"priority": 50}, True, 20),  # the header first
            ({"X-Priority": "20"}, {}, False, 10),  # untrusted: ignored
            ({}, {"priority": 50}, False, 10),
            ({"X-Priority": "nonsense"}, {"priority": "x"}, False, 10),  # ignored, not checked
        ],
    )
    def test_a_tenants_band_is_lowered_never_raised(self, headers, body, trusted, expected):
        assert priority_of({**auth(KEY_B), **headers}, body, trusted) == expected

    def test_without_tenants_a_trusted_gateway_chooses(self) -> None:
        assert priority_of({}, tenants={}) == 0
        assert priority_of({"X-Priority": "-5"}, tenants={}) == -5
        assert priority_of({}, {"priority": 7}, tenants={}) == 7
        assert priority_of({"X-Priority": "-5"}, trusted=False, tenants={}) == 0
        assert priority_of({**auth(KEY_A), "X-Priority": "3"}) == 3

    @pytest.mark.parametrize(
        "value",
        [
            "",
            "abc",
            "1.5",
            "+1",
            "1_0",
            "0x10",
            "1e3",
            "nan",
            "١",
            "101",
            "-101",
            "99999999999999999999",
            "5 5",
            "--1",
        ],  # fmt: skip
    )
    def test_a_hostile_header_is_a_400_naming_it(self, value: str) -> None:
        with pytest.raises(APIError) as e:
            priority_of({**auth(KEY_A), "X-Priority": value})
        assert e.value.status == 400 and e.value.param == "X-Priority"
        assert e.value.body["error"]["type"] == "invalid_request_error"

    @pytest.mark.parametrize("value", ["5", 1.5, True, 10**30, -(10**30), [1], {"a": 1}, 101])
    def test_a_hostile_body_field_from_a_gateway_is_a_400_naming_it(self, value) -> None:
        with pytest.raises(APIError) as e:
            priority_of(auth(KEY_A), {"priority": value})
        assert e.value.status == 400 and e.value.param == "priority"


class TestWhatTheWorkerIsSent:
    def test_a_priority_worker_gets_the_requests_band_others_none(self) -> None:
        body = {"model": "tiny", "prompt": "x", "priority": -50}
        assert upstream_body(body, 10, True)["priority"] == 10
        assert "priority" not in upstream_body(body, 10, False)
        plain = {"model": "tiny", "prompt": "x"}
        assert upstream_body(plain, 0, True) is plain and upstream_body(plain, 0, False) is plain
        assert upstream_body(plain, 3, True) == {**plain, "priority": 3}
        assert body["priority"] == -50, "the client's body is left as it was"

    def test_the_servers_are_started_with_the_policy(self, tmp_path) -> None:
        argv = emulated_command(8100, tmp_path, scheduling_policy="priority")
        assert argv[-2:] == ["--scheduling-policy", "priority"]
        assert "--scheduling-policy" not in emulated_command(8100, tmp_path)
        for backend in ("vllm", "emulated"):
            workers = {"backend": backend, "count": 1, "vllm_python": sys.executable}
            for policy, flag in (("priority", True), ("fcfs", False)):
                config = validate_config({"workers": {**workers, "scheduling_policy": policy}})
                (spec,) = server_specs(config, tmp_path, tmp_path)
                assert ("--scheduling-policy" in spec.argv) is flag, (backend, policy)
                if flag:
                    i = spec.argv.index("--scheduling-policy")
                    assert spec.argv[i + 1] == "priority"


class TestRefusals:
    def test_openai_shape_with_a_whole_retry_after(self) -> None:
        from router.classes import UNMEETABLE, Refused

        e = refused(Refused(UNMEETABLE, "no worker in time", retry_after=1.2))
        assert e.status == 503 and e.headers["Retry-After"] == "2"
        assert e.body["error"] == {
            "message": "no worker in time",
            "type": "service_unavailable",
            "param": None,
            "code": "unmeetable",
        }
        e = queue_time_refused(TrafficClass("batch", 10, max_queue_time=0.25), 0.25)
        assert e.headers["Retry-After"] == "1" and e.body["error"]["code"] == QUEUE_TIME


def live(window: int = 1) -> LiveCluster:
    table = ClassTable(
        [TrafficClass("interactive", 0), TrafficClass("batch", 10, max_queue_time=1)]
    )
    cluster = LiveCluster(
        policies.global_policies.create("round_robin"),
        lambda: policies.local_policies.create("fcfs"),
        RouterConfig(
            block_size=16,
            window=window,
            cost=roofline("llama-3-8b", "a100-80g"),
            classes=table,
            admission=True,
        ),
        clock=lambda: 0.0,
    )
    cluster.add_worker("http://127.0.0.1:1")
    return cluster


class TestQueueLimit:
    def test_a_queued_request_is_refused_a_released_one_goes_on(self) -> None:
        async def go() -> None:
            cluster = live()
            first, second = (Request(i, 0.0, 100, 4, priority=10) for i in range(2))
            worker, _, released = cluster.route(first)
            _, _, queued = cluster.route(second)
            assert released.done() and not queued.done()
            assert cluster.queue_limit(second) == 1.0
            assert not cluster.time_out(worker, first), "released: it goes on"
            assert cluster.time_out(worker, second)
            assert cluster.router.refusals[("batch", QUEUE_TIME)] == 1
            assert len(worker.dispatch) == 0 and worker.dispatch.in_flight == 1
            assert cluster.predicted_ttft(second) is None
            assert cluster.predicted_ttft(first) is not None
            cluster.release(worker, first, 4)
            assert cluster.view.workers[0].tokens_in_flight == 0
            page = cluster.metrics.render().decode()
            assert 'fairway_refusals_total{class="batch",reason="queue_time"} 1.0' in page
            assert 'fairway_refusals_total{class="interactive",reason="unmeetable"} 0.0' in page

        asyncio.run(go())

    def test_a_priority_no_class_names_is_labelled_other(self) -> None:
        cluster = live()
        assert cluster.class_label(Request(0, 0.0, 10, 1, priority=10)) == "batch"
        assert cluster.class_label(Request(1, 0.0, 10, 1, priority=3)) == "other"
        assert cluster.traffic_class(Request(1, 0.0, 10, 1, priority=3)).name == "priority 3"
