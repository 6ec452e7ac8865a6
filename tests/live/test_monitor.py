"""The proxy's watch over its workers: what a /metrics scrape reads, and how a round is paced."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import policies
from router.config import RouterConfig
from router.proxy.driver import LiveCluster
from router.proxy.monitor import CHECKS_AT_ONCE, REPORTED, Monitor, wanted_families
from tests.live_helpers import run, serving

CONFIG = "vllm:cache_config_info"


def vllm_page(blocks: int = 1024, running: tuple[int, ...] = (3, 4)) -> str:
    """A page as vLLM writes it (prometheus_client's exposition, vLLM's names), one engine
    per entry of `running`, with neighbours whose names begin or contain the wanted ones."""
    r = CollectorRegistry()
    labels = ["engine", "model_name"]
    families = {
        "running": Gauge("vllm:num_requests_running", "Running", labels, registry=r),
        "waiting": Gauge("vllm:num_requests_waiting", "Waiting", labels, registry=r),
        "by_reason": Gauge(
            "vllm:num_requests_waiting_by_reason", "By reason", [*labels, "reason"], registry=r
        ),
        "kv": Gauge("vllm:kv_cache_usage_perc", "KV use", labels, registry=r),
        "queries": Counter("vllm:prefix_cache_queries", "Queried tokens", labels, registry=r),
        "hits": Counter("vllm:prefix_cache_hits", "Hit tokens", labels, registry=r),
        "external": Counter("vllm:external_prefix_cache_hits", "Elsewhere", labels, registry=r),
        "ttft": Histogram("vllm:time_to_first_token_seconds", "TTFT", labels, registry=r),
    }
    for engine, n in enumerate(running):
        at = (str(engine), "tiny")
        families["running"].labels(*at).set(n)
        families["waiting"].labels(*at).set(2 * n)
        families["by_reason"].labels(*at, "capacity").set(99)
        if engine == 0:  # (how engines' KV use should combine is not this test's question)
            families["kv"].labels(*at).set(0.25)
        families["queries"].labels(*at).inc(1000)
        families["hits"].labels(*at).inc(400)
        families["external"].labels(*at).inc(77)
        families["ttft"].labels(*at).observe(0.1)
    info = Gauge(CONFIG, "Cache config", ["block_size", "num_gpu_blocks", "engine"], registry=r)
    info.labels("16", str(blocks), "0").set(1)
    return generate_latest(r).decode()


def read(text: str) -> dict[str, list]:
    return {
        family.name: sorted((s.name, sorted(s.labels.items()), s.value) for s in family.samples)
        for family in text_string_to_metric_families(text)
    }


def test_the_wanted_families_read_as_in_the_whole_page() -> None:
    page = vllm_page()
    whole, wanted = read(page), read(wanted_families(page))
    assert set(wanted) == {*REPORTED, CONFIG}
    assert wanted == {name: whole[name] for name in wanted}
    assert set(read(wanted_families(page, with_config=False))) == set(REPORTED)


def cluster_of(urls: list[str]) -> LiveCluster:
    cluster = LiveCluster(
        policies.global_policies.create("round_robin"),
        lambda: policies.local_policies.create("fcfs"),
        RouterConfig(block_size=16),
    )
    for url in urls:
        cluster.add_worker(url)
    return cluster


def test_a_scrape_sums_the_engines_and_reads_the_capacity_once_a_server() -> None:
    """The gauges are read on every scrape and handed to the router at once; the cache config
    once, and again only after a failed health check (a restarted server may have another
    capacity)."""
    state = {"page": vllm_page(blocks=1024), "healthy": True}

    async def health(_: web.Request) -> web.Response:
        return web.Response(status=200 if state["healthy"] else 503)

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=state["page"])

    async def go() -> None:
        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_get("/metrics", metrics)
        async with serving(app) as base, aiohttp.ClientSession() as session:
            cluster = cluster_of([base])
            worker = cluster.workers[0]
            monitor = Monitor(cluster, session)
            await monitor.check(worker)
            assert worker.reported == {
                "running": 7.0,
                "waiting": 14.0,
                "kv_usage": 0.25,
                "prefix_queries": 2000.0,
                "prefix_hits": 800.0,
            }
            assert cluster.view.workers[0].kv_capacity_blocks == 1024
            assert cluster.view.workers[0].kv_used_blocks == 256  # the router has them now
            state["page"] = vllm_page(blocks=512, running=(1,))
            await monitor.check(worker)
            assert worker.reported["running"] == 1.0  # gauges: every scrape
            assert cluster.view.workers[0].kv_capacity_blocks == 1024  # config: once
            state["healthy"] = False
            await monitor.check(worker)
            state["healthy"] = True
            await monitor.check(worker)
            assert cluster.view.workers[0].kv_capacity_blocks == 512
            await monitor.stop()

    run(go)


class PacedMonitor(Monitor):
    """Records in which of a round's pauses each check began (a group's checks begin in the
    pause after it is started; 0: none), and pauses without sleeping."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pauses: list[float] = []
        self.checked: dict[int, int] = {}  # worker id -> the pause its check began in

    async def check(self, worker) -> None:
        self.checked[worker.id] = len(self.pauses)

    async def _pause(self, seconds: float) -> None:
        self.pauses.append(seconds)
        await asyncio.sleep(0)


def test_a_round_starts_its_checks_in_groups_spread_over_the_interval() -> None:
    """Answers to checks started together are handled in one piece of the event loop, which
    every stream waits for; groups spread over the interval keep each piece short."""
    workers = 2 * CHECKS_AT_ONCE + 3

    async def go() -> None:
        cluster = cluster_of([f"http://127.0.0.1:9/w{i}" for i in range(workers)])
        monitor = PacedMonitor(cluster, session=None)  # type: ignore[arg-type]
        await monitor.check_all(spread=0.9)
        assert monitor.pauses == [0.3, 0.3, 0.3]  # the round lasts the interval
        groups = [monitor.checked[w] for w in sorted(monitor.checked)]
        assert groups == [1] * CHECKS_AT_ONCE + [2] * CHECKS_AT_ONCE + [3] * 3
        monitor.pauses.clear()
        await monitor.check_all()  # no spread: every check at once, no pause
        assert monitor.pauses == [] and set(monitor.checked.values()) == {0}
        await monitor.stop()

    run(go)


def test_a_small_fleet_is_checked_at_once_then_waits_the_interval() -> None:
    async def go() -> None:
        cluster = cluster_of([f"http://127.0.0.1:9/w{i}" for i in range(3)])
        monitor = PacedMonitor(cluster, session=None)  # type: ignore[arg-type]
        await monitor.check_all(spread=1.0)
        assert monitor.pauses == [1.0] and set(monitor.checked.values()) == {1}
        await monitor.stop()

    run(go)
