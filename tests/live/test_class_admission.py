"""Traffic classes through the live proxy, over real HTTP: a request's priority (a tenant's, a
trusted gateway's X-Priority, never a client's own) reaches a priority-scheduling worker and the
records; a high-priority request overtakes a queue of low ones in the router's bands; a class's
queue limit and an unmeetable TTFT target are 503s with Retry-After in the OpenAI shape, with
nothing lost; the class metrics are on the admin listener."""

from __future__ import annotations

import asyncio
import csv
import json

import aiohttp
import pytest
from aiohttp import web

from router.proxy.settings import Tenant, keyed
from tests.live_helpers import emulated_workers, proxy, run, serving
from tests.metrics_page import samples

KEY_A, KEY_B = "sk-team-a-0123456789", "sk-team-b-0123456789"
TENANTS = keyed({KEY_A: Tenant("team-a"), KEY_B: Tenant("team-b", priority=10)})
BODY = {"model": "tiny", "prompt": "hello there " * 20, "max_tokens": 4}
PRIORITY_WORKERS = {"workers": {"scheduling_policy": "priority"}}


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


class Capture:
    """A worker that answers every completion at once and keeps what it was sent."""

    def __init__(self) -> None:
        self.seen: list[tuple[dict[str, str], dict]] = []
        self.app = web.Application()
        self.app.router.add_post("/v1/completions", self.complete)
        self.app.router.add_get("/health", self.health)

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def complete(self, request: web.Request) -> web.Response:
        self.seen.append((dict(request.headers), await request.json()))
        choice = {"index": 0, "text": "x", "logprobs": None, "finish_reason": "length"}
        usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
        return web.json_response(
            {
                "id": "cmpl-1",
                "object": "text_completion",
                "created": 0,
                "model": "tiny",
                "choices": [choice],
                "usage": usage,
            }  # fmt: skip
        )


async def post(
    s: aiohttp.ClientSession, base: str, headers: dict[str, str], **extra: object
) -> tuple[int, dict[str, str], dict]:
    async with s.post(f"{base}/v1/completions", json={**BODY, **extra}, headers=headers) as r:
        return r.status, dict(r.headers), await r.json()


class TestPriorityReachesTheWorker:
    def test_tenant_band_lowered_by_a_gateway_never_raised_nor_set_by_a_client(
        self, tmp_path
    ) -> None:
        cases = [  # (key, headers, body fields, the priority the worker is sent)
            (KEY_B, {}, {}, 10),
            (KEY_B, {"X-Priority": "0"}, {}, 10),
            (KEY_B, {"X-Priority": "20"}, {}, 20),
            (KEY_B, {"X-Vllm-Priority": "-100"}, {}, 10),  # vLLM's own header never passes
            (KEY_B, {}, {"priority": -100}, 10),
            (KEY_A, {}, {"priority": -100}, 0),
            (KEY_A, {"X-Priority": "5"}, {}, 5),
        ]

        async def go() -> None:
            worker = Capture()
            async with (
                serving(worker.app) as url,
                proxy(
                    [url], tenants=TENANTS, config=PRIORITY_WORKERS, record_dir=str(tmp_path)
                ) as (base, _),
                aiohttp.ClientSession() as s,
            ):
                for key, headers, fields, _ in cases:
                    status, _, body = await post(s, base, {**auth(key), **headers}, **fields)
                    assert status == 200, body
            sent = [body.get("priority") for _, body in worker.seen]
            assert sent == [expected for *_, expected in cases]
            assert not any("x-vllm-priority" in {k.lower() for k in h} for h, _ in worker.seen)

        run(go, timeout=60)
        with open(tmp_path / "requests.csv") as f:
            rows = list(csv.DictReader(f))
        assert [int(r["priority"]) for r in rows] == [expected for *_, expected in cases]
        assert all(float(r["predicted_ttft"]) > 0 for r in rows), "bands on: predicted"
        lines = (tmp_path / "trace.jsonl").read_text().splitlines()[1:]
        assert [json.loads(line).get("priority", 0) for line in lines] == [c[-1] for c in cases]

    def test_untrusted_headers_and_fields_are_ignored_and_fcfs_workers_get_no_priority(
        self,
    ) -> None:
        async def go() -> None:
            worker = Capture()
            async with (
                serving(worker.app) as url,
                proxy([url], tenants=TENANTS, trust_client_headers=False) as (base, _),
                aiohttp.ClientSession() as s,
            ):
                for headers, fields in [({"X-Priority": "20"}, {}), ({}, {"priority": -3})]:
                    status, _, body = await post(s, base, {**auth(KEY_B), **headers}, **fields)
                    assert status == 200, body
            assert [body.get("priority") for _, body in worker.seen] == [None, None]

        run(go, timeout=60)

    def test_a_hostile_x_priority_is_a_400_naming_it_before_any_worker(self) -> None:
        async def go() -> None:
            worker = Capture()
            async with (
                serving(worker.app) as url,
                proxy([url], tenants=TENANTS) as (base, _),
                aiohttp.ClientSession() as s,
            ):
                for value in ("x", "1.5", "+1", "1_0", "999999999999", "101", "-1e3", ""):
                    status, _, body = await post(s, base, {**auth(KEY_A), "X-Priority": value})
                    assert status == 400, (value, body)
                    assert body["error"]["param"] == "X-Priority"
                    assert body["error"]["type"] == "invalid_request_error"
                status, _, body = await post(s, base, auth(KEY_A), priority="high")
                assert status == 400 and body["error"]["param"] == "priority"
            assert worker.seen == []

        run(go, timeout=60)


class TestBands:
    def test_a_high_priority_request_overtakes_the_queued_low_ones(self) -> None:
        async def go() -> None:
            async with (
                emulated_workers(1, speed=1) as urls,
                proxy(urls, window=1, config={"trust_client_headers": True}) as (base, cluster),
                aiohttp.ClientSession() as s,
            ):
                done: list[str] = []

                async def ask(name: str, priority: int) -> None:
                    headers = {"X-Priority": str(priority)}
                    status, _, body = await post(s, base, headers, max_tokens=16)
                    assert status == 200, body
                    done.append(name)

                low = [asyncio.create_task(ask(f"low-{i}", 10)) for i in range(8)]
                dispatch = cluster.workers[0].dispatch
                for _ in range(250):
                    if len(dispatch) >= 6:
                        break
                    await asyncio.sleep(0.01)
                assert len(dispatch) >= 6, "the low ones wait in the router"
                high = asyncio.create_task(ask("high", 0))
                await asyncio.gather(high, *low)
                assert done.index("high") <= 1, done  # behind at most the one in flight

        run(go, timeout=90)


class TestEmulatedPriorityScheduling:
    @pytest.mark.parametrize("policy", ["priority", "fcfs"])
    def test_the_worker_itself_orders_by_priority_under_its_priority_policy(
        self, policy: str
    ) -> None:
        """A window wide enough that the worker orders, and KV room for one request at a
        time: under `priority` the high request sent last starts next; under fcfs, last."""
        done: list[str] = []

        async def go() -> None:
            async with (
                emulated_workers(1, speed=2, scheduling_policy=policy, num_kv_blocks=6) as urls,
                proxy(urls, window=64, config={"workers": {"scheduling_policy": policy}}) as (
                    base,
                    cluster,
                ),
                aiohttp.ClientSession() as s,
            ):

                async def ask(name: str, i: int, priority: int) -> None:
                    fields = {"prompt": [10 + i] * 600, "max_tokens": 32, "priority": priority}
                    status, _, body = await post(s, base, {}, **fields)
                    assert status == 200, body
                    done.append(name)

                low = [asyncio.create_task(ask(f"low-{i}", i, 10)) for i in range(6)]
                for _ in range(250):
                    if cluster.workers[0].dispatch.in_flight == 6:
                        break
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0.05)  # at the worker, behind the one it runs
                await asyncio.gather(asyncio.create_task(ask("high", 6, 0)), *low)

        run(go, timeout=90)
        if policy == "priority":
            assert done.index("high") <= 1, done
        else:
            assert done.index("high") == 6, done


ADMISSION = {
    "classes": {
        "interactive": {"priority": 0, "ttft": 0.001},  # no worker starts anything that fast
        "batch": {"priority": 10, "ttft": 30, "max_queue_time": 0.3},
    },
    "admission_control": True,
    "trust_client_headers": True,
}


class TestAdmission:
    def test_past_the_queue_limit_a_503_with_retry_after_and_nothing_lost(self) -> None:
        sent = 8

        async def go() -> None:
            async with (
                emulated_workers(1, speed=1) as urls,
                proxy(urls, window=1, config=ADMISSION) as (base, cluster),
                aiohttp.ClientSession() as s,
            ):
                headers = {"X-Priority": "10"}
                answers = await asyncio.gather(
                    *(post(s, base, headers, max_tokens=64) for _ in range(sent))
                )
                statuses = [status for status, _, _ in answers]
                answered, refused = statuses.count(200), statuses.count(503)
                assert answered + refused == sent, statuses  # count in = count out
                assert answered >= 1 and refused >= 1, statuses
                for status, headers_back, body in answers:
                    if status == 503:
                        assert body["error"]["code"] == "queue_time", body
                        assert body["error"]["type"] == "service_unavailable"
                        assert body["error"]["param"] is None
                        assert headers_back["Retry-After"] == "1"  # 0.3 s, rounded up
                counted = await samples(s, base.admin, "fairway_refusals_total")
                assert counted['{class="batch",reason="queue_time"}'] == refused
                assert counted['{class="interactive",reason="unmeetable"}'] == 0
                assert cluster.router.refusals[("batch", "queue_time")] == refused
                routed = await samples(s, base.admin, "fairway_requests_total")
                assert sum(v for k, v in routed.items() if 'status="queue_time"' in k) == refused
                outcomes = await samples(s, base.admin, "fairway_class_requests_total")
                assert sum(v for k, v in outcomes.items() if 'class="batch"' in k) == answered
                worker = cluster.workers[0]
                assert len(worker.dispatch) == 0 and worker.dispatch.in_flight == 0
                assert cluster.view.workers[0].tokens_in_flight == 0

        run(go, timeout=90)

    def test_an_unmeetable_target_is_a_503_with_retry_after_others_are_served(self) -> None:
        async def go() -> None:
            async with (
                emulated_workers(1, speed=20) as urls,
                proxy(urls, config=ADMISSION) as (base, _),
                aiohttp.ClientSession() as s,
            ):
                status, headers, body = await post(s, base, {"X-Priority": "0"})
                assert status == 503, body
                assert body["error"]["code"] == "unmeetable"
                assert body["error"]["type"] == "service_unavailable"
                assert "interactive" in body["error"]["message"]
                assert int(headers["Retry-After"]) >= 1
                status, _, body = await post(s, base, {"X-Priority": "10"})
                assert status == 200, body
                counted = await samples(s, base.admin, "fairway_refusals_total")
                assert counted['{class="interactive",reason="unmeetable"}'] == 1
                routed = await samples(s, base.admin, "fairway_requests_total")
                refused = (
                    '{api="completions",decision="refused",policy="round_robin",'
                    'status="unmeetable",worker="none"}'
                )
                assert routed[refused] == 1

        run(go, timeout=60)


class TestClassMetrics:
    def test_outcomes_and_the_ttft_prediction_on_the_admin_listener_only(self) -> None:
        config = {"classes": {"chat": {"priority": 0, "ttft": 30, "tpot": 5}}}

        async def go() -> None:
            async with (
                emulated_workers(1, speed=20) as urls,
                proxy(urls, config=config) as (base, _),
                aiohttp.ClientSession() as s,
            ):
                for stream in (True, True, False):
                    async with s.post(
                        f"{base}/v1/completions", json={**BODY, "stream": stream}
                    ) as r:
                        assert r.status == 200
                        await r.read()
                outcomes = await samples(s, base.admin, "fairway_class_requests_total")
                assert outcomes == {'{class="chat",outcome="met"}': 3.0}
                predicted = await samples(s, base.admin, "fairway_ttft_predicted_seconds_total")
                observed = await samples(s, base.admin, "fairway_ttft_observed_seconds_total")
                assert predicted['{class="chat"}'] > 0 and observed['{class="chat"}'] > 0
                errors = await samples(
                    s, base.admin, "fairway_ttft_prediction_abs_error_seconds_count"
                )
                assert errors == {'{class="chat"}': 2.0}, "streams only"
                async with s.get(f"{base}/metrics") as r:
                    assert r.status == 404, "not on the public listener"

        run(go, timeout=60)
