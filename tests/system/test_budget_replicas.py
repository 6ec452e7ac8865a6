"""Tenant budgets across router replicas: `fairway serve --routers 2` keeps one budget per
tenant in the replicas' Redis, however the requests spread; and when that Redis is killed, a
budget check fails open (admits, counts the errors, warns) or closed (503 in OpenAI's shape),
as `rate_limit_store_failure` says."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from router.proxy.service.replicas import REPLICA_HEADER
from router.proxy.service.store import OwnRedis
from tests.live_helpers import emulated_workers, run
from tests.metrics_page import samples
from tests.system.test_live_replicas import fairway_serve

pytestmark = pytest.mark.skipif(
    shutil.which("redis-server") is None, reason="needs redis-server (`make test` installs it)"
)

BURST = 6
LIMITED, OTHER, FREE = "sk-limited-0001", "sk-other-00001", "sk-free-000001"
# 0.01 requests a second: a test's few seconds refill nothing a request could use.
TENANTS = [
    {"api_key": LIMITED, "client": "alpha", "rate_limit": {"requests_per_s": 0.01, "burst": BURST}},
    {"api_key": OTHER, "client": "beta", "rate_limit": {"requests_per_s": 0.01, "burst": BURST}},
    {"api_key": FREE, "client": "gamma"},
]
BODY = {"model": "tiny", "prompt": "hello " * 20, "max_tokens": 2}
STORE_WARNING = "tenant budgets: the store is unreachable"


async def ask(s: aiohttp.ClientSession, url: str, key: str) -> tuple[int, dict[str, str], dict]:
    """One completion through `url` (a replica's own port), fresh connection each time."""
    headers = {"Authorization": f"Bearer {key}", "Connection": "close"}
    async with s.post(f"{url}/v1/completions", json=BODY, headers=headers) as r:
        return r.status, {k.lower(): v for k, v in r.headers.items()}, await r.json()


def replica(headers: dict[str, str]) -> str:
    return headers[REPLICA_HEADER.lower()].split("-")[0]


@contextlib.contextmanager
def own_redis(scratch: Path) -> Iterator[OwnRedis]:
    """A redis-server of this test's own (nothing restarts it when it is killed)."""
    server = OwnRedis(scratch)
    server.start()
    try:
        yield server
    finally:
        server.stop()


async def kill(server: OwnRedis) -> None:
    """SIGKILL the redis-server this test started (its guard's one child, by pid), and wait
    until its port refuses connections."""
    assert server.proc is not None
    guard = server.proc.pid
    children = Path(f"/proc/{guard}/task/{guard}/children").read_text().split()
    assert len(children) == 1, f"the guard {guard} runs one server: {children}"
    os.kill(int(children[0]), signal.SIGKILL)
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", server.port), 0.5).close()
        except OSError:
            return
        assert time.monotonic() < deadline, "the killed Redis still accepts connections"
        await asyncio.sleep(0.05)


@pytest.mark.slow
def test_two_replicas_enforce_one_budget(tmp_path) -> None:
    async def go() -> None:
        async with (
            emulated_workers(1, speed=20) as urls,
            fairway_serve(tmp_path, urls, 2, tenants=TENANTS) as (_, own, _, log_path),
            aiohttp.ClientSession() as s,
        ):
            # One after another, alternating replicas: the first BURST pass, at both.
            answers = [await ask(s, own[i % 2], LIMITED) for i in range(2 * BURST)]
            statuses = [status for status, _, _ in answers]
            assert statuses == [200] * BURST + [429] * BURST, statuses
            passed_at = Counter(replica(h) for status, h, _ in answers if status == 200)
            assert passed_at == {"0": BURST // 2, "1": BURST // 2}, passed_at
            refused_at = Counter(replica(h) for status, h, _ in answers if status == 429)
            assert refused_at == {"0": BURST // 2, "1": BURST // 2}, "both saw it spent"
            last = answers[-1][1]
            assert last["x-ratelimit-remaining-requests"] == "0"
            assert int(last["retry-after"]) >= 90, "0.01 a second: a request in 100 s"

            # All at once, half through each replica: still exactly BURST.
            many = await asyncio.gather(*(ask(s, own[i % 2], OTHER) for i in range(4 * BURST)))
            assert sorted(status for status, _, _ in many) == [200] * BURST + [429] * 3 * BURST

            refused = Counter()
            for url in own:
                for labels, value in (await samples(s, url, "fairway_rate_limited_total")).items():
                    refused[labels] += value
            assert refused == {
                '{client="alpha",limit="requests"}': BURST,
                '{client="beta",limit="requests"}': 3 * BURST,
            }, refused
            assert "Traceback" not in log_path.read_text()

    run(go, timeout=180)


@pytest.mark.slow
def test_a_killed_store_fails_open_admitting_and_counting(tmp_path) -> None:
    async def go() -> None:
        with own_redis(tmp_path / "redis") as server:
            async with (
                emulated_workers(1, speed=20) as urls,
                fairway_serve(
                    tmp_path, urls, 2, tenants=TENANTS, redis_url=server.url, router_sync=0.2
                ) as (_, own, _, log_path),
                aiohttp.ClientSession() as s,
            ):
                spent = [await ask(s, own[i % 2], LIMITED) for i in range(BURST + 1)]
                assert [a[0] for a in spent] == [200] * BURST + [429], "the store enforced it"

                await kill(server)
                answers = [await ask(s, own[i % 2], LIMITED) for i in range(2 * BURST)]
                assert [a[0] for a in answers] == [200] * (2 * BURST), "open: admitted"
                assert not [h for _, h, _ in answers if "x-ratelimit-limit-requests" in h], (
                    "unmetered answers claim no figures"
                )
                for url in own:
                    errors = await samples(s, url, "fairway_rate_limit_store_errors_total")
                    assert errors[""] >= BURST, (url, errors)
                text = log_path.read_text()
                warnings = Counter(
                    line.split(" replica ")[1][0]
                    for line in text.splitlines()
                    if STORE_WARNING in line
                )
                assert set(warnings) == {"0", "1"} and max(warnings.values()) <= 2, warnings
                assert "failing open" in text

    run(go, timeout=180)


@pytest.mark.slow
def test_a_killed_store_fails_closed_with_a_503(tmp_path) -> None:
    async def go() -> None:
        with own_redis(tmp_path / "redis") as server:
            async with (
                emulated_workers(1, speed=20) as urls,
                fairway_serve(
                    tmp_path,
                    urls,
                    2,
                    tenants=TENANTS,
                    redis_url=server.url,
                    rate_limit_store_failure="closed",
                ) as (_, own, _, log_path),
                aiohttp.ClientSession() as s,
            ):
                assert (await ask(s, own[0], LIMITED))[0] == 200
                await kill(server)
                for url in own:
                    status, headers, body = await ask(s, url, LIMITED)
                    assert status == 503, body
                    assert body == {
                        "error": {
                            "message": "The rate-limit store is unreachable; try again shortly.",
                            "type": "service_unavailable",
                            "param": None,
                            "code": "rate_limit_store_unavailable",
                        }
                    }
                    assert headers["retry-after"] == "1"
                    status, _, body = await ask(s, url, FREE)
                    assert status == 200, "a tenant without a budget needs no store"
                    errors = await samples(s, url, "fairway_rate_limit_store_errors_total")
                    assert errors[""] >= 1, errors
                assert "failing closed" in log_path.read_text()

    run(go, timeout=180)
