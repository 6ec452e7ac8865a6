"""Model groups and cache identity through the proxy, in front of emulated workers.

Two groups (alpha: two workers, beta: one), each worker serving its group's name: a request
goes only to its group's workers, an unknown model is the OpenAI 404, and the same prompt under
another `cache_salt` (or another group) is never predicted to hit what the first one cached.
"""

from __future__ import annotations

import contextlib

import aiohttp

from router.proxy.app import create_app
from router.proxy.catalog import Catalog
from router.proxy.ports import free_port
from router.proxy.prompts import PromptEncoder
from router.proxy.service.config import ClusterConfig
from router.proxy.service.serve import build_cluster
from router.proxy.settings import ProxySettings
from tests.live_helpers import BLOCK, run, serving, tokenizer_dir
from tests.metrics_page import total
from workers.emulated.app import create_app as create_emulated_app

PROMPT = "the same long document for every request " * 40
ADMIN_TOKEN = "admin-token-for-groups"
HITS = "fairway_prefix_hit_tokens_estimated_total"  # the router's predicted prefix hits


@contextlib.asynccontextmanager
async def two_groups():
    async with contextlib.AsyncExitStack() as stack:
        workers = []
        for name in ("alpha", "alpha", "beta"):
            app = create_emulated_app(tokenizer_dir(), name, BLOCK, speed=50)
            workers.append((await stack.enter_async_context(serving(app)), name))
        cluster = build_cluster(ClusterConfig(policy={"name": "lpm"}, block_size=BLOCK))
        for url, name in workers:
            cluster.add_worker(url, model=name)
        encoder = PromptEncoder(tokenizer_dir(), BLOCK)
        catalog = Catalog()
        for name in ("alpha", "beta"):
            catalog.add_group(name, encoder, 4096)
        admin = free_port()
        settings = ProxySettings(
            model_name="alpha", admin_port=admin, health_interval=0.2, admin_token=ADMIN_TOKEN
        )
        url = await stack.enter_async_context(
            serving(create_app(cluster, catalog, settings), admin_port=admin)
        )
        async with aiohttp.ClientSession() as session:
            yield session, url, f"http://127.0.0.1:{admin}"


async def complete(session, url: str, model: str, **extra) -> tuple[int, dict, dict]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 4, **extra}
    async with session.post(f"{url}/v1/completions", json=body) as r:
        return r.status, dict(r.headers), await r.json()


def test_each_group_is_served_by_its_workers_only() -> None:
    async def body() -> None:
        async with two_groups() as (session, url, _):
            async with session.get(f"{url}/v1/models") as r:
                assert [c["id"] for c in (await r.json())["data"]] == ["alpha", "beta"]
            seen: dict[str, set[str]] = {"alpha": set(), "beta": set()}
            for i in range(6):
                for model in seen:
                    status, headers, _ = await complete(session, url, model, user=f"u{i}")
                    assert status == 200
                    seen[model].add(headers["X-Fairway-Worker"])
            assert seen["beta"] == {"2"} and seen["alpha"] <= {"0", "1"}
            status, _, error = await complete(session, url, "gamma")
            assert status == 404 and error["error"]["code"] == "model_not_found"

    run(body)


def test_another_salt_or_group_predicts_no_hit() -> None:
    async def body() -> None:
        async with two_groups() as (session, url, admin):
            assert (await complete(session, url, "beta", cache_salt="s1"))[0] == 200
            assert await total(session, admin, HITS) == 0
            assert (await complete(session, url, "beta", cache_salt="s1"))[0] == 200
            hit = await total(session, admin, HITS)
            assert hit >= len(PROMPT.split()) // 2  # the document, once cached, is expected
            for other in ({"cache_salt": "s2"}, {}):  # another salt, or none
                assert (await complete(session, url, "beta", **other))[0] == 200
                assert await total(session, admin, HITS) == hit
            for bad in ("", 7):
                status, _, error = await complete(session, url, "beta", cache_salt=bad)
                assert status == 400 and error["error"]["param"] == "cache_salt"

    run(body)


def test_a_server_added_through_the_admin_api_joins_the_group_it_names() -> None:
    async def body() -> None:
        async with (
            two_groups() as (session, url, admin),
            serving(create_emulated_app(tokenizer_dir(), "beta", BLOCK, speed=50)) as beta,
        ):
            workers, auth = f"{admin}/admin/workers", {"Authorization": f"Bearer {ADMIN_TOKEN}"}
            for bad, why in (({"url": beta}, "is required"), ({"url": beta, "model": "x"}, "none")):
                async with session.post(workers, json=bad, headers=auth) as r:
                    error = (await r.json())["error"]
                    assert r.status == 400 and error["param"] == "model", error
                    assert why in error["message"] and "alpha, beta" in error["message"]
            async with session.post(
                workers, json={"url": beta, "model": "beta"}, headers=auth
            ) as r:
                assert r.status == 201 and (await r.json())["model"] == "beta"
            async with session.delete(f"{workers}?id=2", headers=auth) as r:
                assert r.status == 200  # beta's first server: the added one must serve beta
            for i in range(4):
                for model, expect in (("beta", {"3"}), ("alpha", {"0", "1"})):
                    status, headers, _ = await complete(session, url, model, user=f"u{i}")
                    assert status == 200 and headers["X-Fairway-Worker"] in expect, headers

    run(body)
