"""The replicas' store fails under load, as stores do: killed (and restarted by `fairway serve`
empty), then stopped with SIGSTOP for 10 s (connections open, nothing answered), then resumed.

Checked: no request is lost; each replica says it is out of sync (fairway_shared_state_up 0,
/health `degraded`, failures counted by kind) and then in sync again; the counters are not
reset by the empty store (re-published) nor counted twice by rounds a stopped store applied
late; and the two replicas' VTC counters agree with each other and the store again within a
few sync intervals of the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import aiohttp
import pytest
import redis
import yaml

from dashboards import grafana
from router.proxy.ports import free_port
from router.proxy.service.store import memory_bound
from router.proxy.settings import RESPONSES_MAX_BYTES
from tests.live_helpers import run
from tests.metrics_page import samples
from tests.system.test_dashboards import wait_until_scraping
from tests.system.test_live_replicas import replica_state
from tests.system.test_replica_agreement import (
    SYNC,
    load_through,
    read_agreement,
    redis_url_of,
    vtc_replicas,
)

pytestmark = pytest.mark.skipif(
    shutil.which("redis-server") is None, reason="needs redis-server (`make test` installs it)"
)

TOLERANCE = 0.01  # relative, between replicas and against the store
STOPPED = 10.0  # seconds the store is stopped


def redis_pid(log_path: Path) -> int:
    """The redis-server process itself (its guard's child), as last started."""
    guard = int(
        re.findall(r"redis-server (?:restarted )?on \S+ \(pid (\d+)", log_path.read_text())[-1]
    )
    children = Path(f"/proc/{guard}/task/{guard}/children").read_text().split()
    assert len(children) == 1, f"the guard {guard} runs one server: {children}"
    return int(children[0])


class Watch:
    """What each replica said about its sync, sampled every 50 ms."""

    def __init__(self, own: list[str]) -> None:
        self.own = own
        self.up: list[set[float]] = [set() for _ in own]
        self.health: list[set[str]] = [set() for _ in own]

    async def run(self, session: aiohttp.ClientSession) -> None:
        while True:
            for i, url in enumerate(self.own):
                with_up = await samples(session, url, "fairway_shared_state_up")
                self.up[i].add(with_up[""])
                async with session.get(f"{url}/health") as r:
                    assert r.status == 200, await r.text()  # degraded is still serving
                    self.health[i].add((await r.json())["status"])
            await asyncio.sleep(0.05)


async def wait_in_sync(
    session: aiohttp.ClientSession, own: list[str], patience: float, resets: int = 0
) -> None:
    """Until every replica is in sync, having re-published at least `resets` times."""
    deadline = time.monotonic() + patience
    while True:
        states = [await replica_state(session, u) for u in own]
        if all(s["in_sync"] and s["resets"] >= resets for s in states):
            return
        assert time.monotonic() < deadline, f"not in sync after {patience} s: {states}"
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def prometheus(scratch: Path, own: list[str]):
    """A real Prometheus scraping the replicas' own ports every 0.5 s, with Fairway's alert
    rules (the out-of-sync one held 2 s); yields its URL, or None without Prometheus."""
    binary = shutil.which("prometheus")
    if binary is None:
        yield None
        return
    scratch.mkdir()
    targets = tuple(u.removeprefix("http://") for u in own)
    config = grafana.prometheus_config(proxy=targets, workers=(), interval="500ms")
    (scratch / "prometheus.yml").write_text(yaml.safe_dump(config))
    rules = grafana.alert_rules(sync_hold="2s")
    (scratch / "fairway-alerts.yml").write_text(yaml.safe_dump(rules))
    port = free_port()
    prom = subprocess.Popen(
        [binary, f"--config.file={scratch / 'prometheus.yml'}",
         f"--storage.tsdb.path={scratch / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        await wait_until_scraping(url, jobs={"fairway"})
        yield url
    finally:
        prom.terminate()
        prom.wait(10)


async def firing(session: aiohttp.ClientSession, prom_url: str, alert: str) -> set[str]:
    """The instances for which `alert` fires now."""
    async with session.get(f"{prom_url}/api/v1/alerts") as r:
        alerts = (await r.json())["data"]["alerts"]
    return {
        a["labels"]["instance"]
        for a in alerts
        if a["labels"]["alertname"] == alert and a["state"] == "firing"
    }


def total(ledgers: dict[str, dict[str, float]]) -> float:
    return sum(sum(fields.values()) for fields in ledgers.values())


@pytest.mark.slow
def test_a_store_killed_then_stopped_under_load(tmp_path) -> None:
    async def go() -> None:
        async with (
            vtc_replicas(tmp_path) as (own, log_path, session),
            prometheus(tmp_path / "prometheus", own) as prom_url,
        ):
            spec = {"concurrency": 6, "duration": STOPPED + 8, "max_tokens": 16, "timeout": 30.0}
            load = asyncio.ensure_future(load_through(own, 1200, num_tenants=3, **spec))
            watch = Watch(own)
            watcher = asyncio.create_task(watch.run(session))
            try:
                await asyncio.sleep(1.5)
                charged_before = total((await replica_state(session, own[0]))["ledgers"])
                assert charged_before > 0, "the load was charged before the store died"

                os.kill(redis_pid(log_path), signal.SIGKILL)
                deadline = time.monotonic() + 15
                while "redis-server restarted" not in log_path.read_text():
                    assert time.monotonic() < deadline, log_path.read_text()[-3000:]
                    await asyncio.sleep(0.1)
                await wait_in_sync(session, own, 10, resets=1)  # each re-published
                restarted = redis.Redis.from_url(redis_url_of(log_path.read_text()))
                try:  # bounded as it was first started
                    maxmemory = int(restarted.config_get("maxmemory")["maxmemory"])
                    assert maxmemory == memory_bound(RESPONSES_MAX_BYTES), maxmemory
                finally:
                    restarted.close()
                states = [await replica_state(session, u) for u in own]
                charged_after = total(states[0]["ledgers"])
                assert charged_after >= charged_before, (
                    f"the counters restarted from the empty store: {charged_before} -> "
                    f"{charged_after}"
                )

                stopped = redis_pid(log_path)
                os.kill(stopped, signal.SIGSTOP)
                try:
                    started, fired = time.monotonic(), set()
                    while prom_url and time.monotonic() - started < STOPPED - 1:
                        fired = await firing(session, prom_url, "FairwayReplicaOutOfSync")
                        if len(fired) == len(own):
                            break
                        await asyncio.sleep(0.25)
                    if prom_url:
                        assert len(fired) == len(own), f"the alert fired for {fired} only"
                    await asyncio.sleep(max(0.0, STOPPED - (time.monotonic() - started)))
                    out = [await replica_state(session, u) for u in own]
                    assert not any(s["in_sync"] for s in out), out
                    assert all(s["seconds_since_sync"] > STOPPED / 2 for s in out), out
                finally:
                    os.kill(stopped, signal.SIGCONT)
                await load  # nothing lost: every request answered ok
            finally:
                watcher.cancel()
                await asyncio.gather(watcher, return_exceptions=True)
            await wait_in_sync(session, own, 10)
            await asyncio.sleep(3 * SYNC + 0.1)  # a round of each after the load, and replies
            agreement = await read_agreement(session, own, redis_url_of(log_path.read_text()))
            worst, where = agreement.worst_between_replicas
            off, off_where = agreement.worst_against_store
            assert worst <= TOLERANCE, f"replicas differ by {100 * worst:.1f} %: {where}"
            assert off <= TOLERANCE, f"a replica differs from the store: {off_where}"
            for i, url in enumerate(own):
                assert watch.up[i] == {0.0, 1.0}, f"replica {i}'s up went {watch.up[i]}"
                assert watch.health[i] >= {"ok", "degraded"}, watch.health[i]
                failures = await samples(session, url, "fairway_shared_state_sync_failures_total")
                kinds = {re.search(r'kind="(\w+)"', k)[1]: v for k, v in failures.items()}  # type: ignore[index]
                assert kinds["connection"] > 0 and kinds["timeout"] > 0, kinds
                assert (await samples(session, url, "fairway_shared_state_up"))[""] == 1.0
                since = await samples(session, url, "fairway_shared_state_seconds_since_sync")
                assert since[""] < 1.0, since
            text = log_path.read_text()
            assert "came back without its state" in text and "in sync again" in text
            assert "Traceback" not in text, text[-4000:]

    run(go, timeout=240)
