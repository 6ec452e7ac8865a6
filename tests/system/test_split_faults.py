"""Faults on a split fleet under load, through a real proxy in front of emulated prefill and
decode servers, each a process of its own, killed by its pid mid-load.

As for mixed workers (tests/system/test_faults.py), every request sent ends, complete or with
a clean OpenAI-shaped error, judged from the bytes the client got. A prefill server's failure
is always before the client's first byte (a prefill is never streamed to it): each request it
held is sent through again, and every request is answered. A decode server's failure after
the first byte ends its streams with an error event; the rest are decoded by the other one.
Load is bounded in count and time, on 127.0.0.1 only.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator

import aiohttp

from router.proxy.driver import LiveCluster
from tests.live_helpers import (
    ProxyURL,
    assert_every_request_ended,
    emulated_role_processes,
    eventually,
    run,
    split_proxy,
)
from tests.metrics_page import samples
from tests.system.test_faults import FAST, under_load
from traces.load import LoadResult, LoadSpec

LOAD = LoadSpec(num_requests=200, concurrency=24, duration=30, max_tokens=24, timeout=30)


@contextlib.asynccontextmanager
async def killed_mid_load(
    roles: list[str], victim: int
) -> AsyncIterator[tuple[ProxyURL, LiveCluster, LoadResult]]:
    """Emulated servers of `roles` behind a proxy, server `victim` SIGKILLed (by its pid) a
    second into LOAD; yields the proxy, its cluster and the load's result once the load has
    ended and the victim is seen down."""
    async with emulated_role_processes(roles) as servers:
        fleet = [(s.url, role) for s, role in zip(servers, roles, strict=True)]
        async with split_proxy(fleet, policy="round_robin", **FAST) as (base, cluster):

            async def fault() -> None:
                await asyncio.sleep(1.0)
                servers[victim].signal(signal.SIGKILL)

            result = await under_load(base, fault, LOAD)
            assert await eventually(lambda: not cluster.view.workers[victim].healthy)
            yield base, cluster, result


class TestPrefillWorkerKilled:
    def test_every_request_is_answered_by_the_other_prefill_worker(self) -> None:
        async def go() -> None:
            roles = ["prefill", "prefill", "decode"]
            async with (
                killed_mid_load(roles, 1) as (base, _, result),
                aiohttp.ClientSession() as s,
            ):
                answered = await samples(s, base.admin, "fairway_requests_total")
            assert_every_request_ended(result, LOAD.num_requests)
            assert result.counts["ok"] == LOAD.num_requests, result.summary()
            ok = sum(v for labels, v in answered.items() if 'status="ok"' in labels)
            assert ok == LOAD.num_requests, answered  # count in = count out, at the proxy too
            retried = sum(v for labels, v in answered.items() if 'status="retried"' in labels)
            assert retried >= 1, "some requests were held by the killed prefill worker"

        run(go, timeout=180)


class TestDecodeWorkerKilled:
    def test_clean_errors_then_the_other_decode_worker_serves(self) -> None:
        async def go() -> None:
            roles = ["prefill", "decode", "decode"]
            async with killed_mid_load(roles, 1) as (base, cluster, result):
                before = cluster.router.handoffs[2]
                async with aiohttp.ClientSession() as s:
                    for stream in (False, True):
                        body = {"model": "tiny", "prompt": "after the fault " * 20,
                                "max_tokens": 4, "stream": stream}  # fmt: skip
                        async with s.post(f"{base}/v1/completions", json=body) as r:
                            assert r.status == 200 and r.headers["X-Fairway-Worker"] == "2"
                            await r.read()
                handoffs = dict(cluster.router.handoffs)
                assert handoffs[2] == before + 2
                assert handoffs.get(1, 0) > 0, (handoffs, "the killed one served before")
            assert_every_request_ended(result, LOAD.num_requests)
            assert result.counts["ok"] >= LOAD.num_requests * 0.8, result.summary()

        run(go, timeout=180)
