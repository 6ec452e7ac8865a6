"""Predicted against actual cache hits through a real proxy, and the fallback when they drift."""

from __future__ import annotations

import aiohttp

from router.drift import DriftGuard
from tests.live_helpers import client, emulated_workers, proxy, run


def metric(text: str, name: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and not line.startswith("#")
    )


def test_a_worker_losing_its_cache_makes_routing_fall_back_and_recover() -> None:
    """The approximate index promises what was routed; a worker whose cache is reset behind
    the router's back (a restart its health checks missed) reuses none of it. Routing drops to
    load only, and climbs back once the index and the workers agree again."""

    async def go() -> None:
        async with emulated_workers(2, speed=20) as urls, proxy(urls, "lpm") as (base, cluster):
            cluster.router.drift = DriftGuard(cluster.router.index_levels(), window=6)
            oa = client(base)
            docs = [f"document {d} " * 120 for d in range(2)]

            async def ask(i: int) -> int:
                c = await oa.completions.create(
                    model="tiny", prompt=docs[i % 2] + f"question {i}", max_tokens=2
                )
                return c.usage.prompt_tokens_details.cached_tokens

            for i in range(8):  # warm: predictions and reuse agree
                await ask(i)
            assert cluster.router.index_level == "approximate"

            async with aiohttp.ClientSession() as http:
                for i in range(8, 16):  # each worker forgets everything before every request
                    for url in urls:
                        async with http.post(f"{url}/reset_prefix_cache") as r:
                            assert r.status == 200
                    assert await ask(i) == 0
                assert cluster.router.index_level == "load"
                for i in range(16, 40):  # caches refill; the index is believable again
                    await ask(i)
                    if cluster.router.index_level == "approximate":
                        break
                assert cluster.router.index_level == "approximate"
                levels = [change[2] for change in cluster.router.level_changes]
                assert levels == ["load", "approximate"]

                async with http.get(f"{base}/metrics") as r:
                    text = await r.text()
            assert (
                metric(text, "fairway_prefix_hit_tokens_predicted_total")
                > metric(text, "fairway_prefix_hit_tokens_actual_total")
                > 0
            )
            assert metric(text, 'fairway_index_level_changes_total{level="load"}') == 1
            assert metric(text, "fairway_index_level ") == 1.0

    run(go)
